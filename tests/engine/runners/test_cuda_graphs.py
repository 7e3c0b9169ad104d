"""The CUDA path of the decode step (engine/runners/torch/compiled_step.py: one CUDA graph
per bucket, rows padded up to it) on a tiny random model: captured steps give HF
``generate``'s greedy tokens for every row count, padded ones included, under preemption
and with speculative rows in the graph; bf16 (the CUDA default) agrees with eager. These
need a CUDA device: CI has none, and they run on a lent GPU machine (README, Performance)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from specdecode.config import SpeculativeConfig
from specdecode.worker import speculator_for
from tests.engine.test_engine import PROMPTS, run_to_completion
from tests.specdecode.test_spec_engine import CopyPrompt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BUCKETS = [1, 2, 4, 8]
NEW = 16


def cuda_engine(model_dir, eager: bool = False, dtype: str = "float32", spec=None,
                **kw) -> LLMEngine:
    kw.setdefault("max_num_seqs", 8)
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype=dtype,
                                    enforce_eager=eager, decode_buckets=BUCKETS, **kw),
                       speculator=speculator_for(spec) if spec else None)
    report = engine.runner.warmup()
    if not eager:
        assert report.ready and all(g.status == "captured" for g in report.graphs), report
    return engine


def replayed(engine: LLMEngine) -> list[tuple[int, int, int]]:
    """(rows, bucket, width in blocks) of every captured step the engine runs from now."""
    graphs = engine.runner.decode_graphs
    assert graphs is not None
    calls: list[tuple[int, int, int]] = []
    keys: list[tuple[int, int]] = []
    for key, step in list(graphs._cuda_steps.items()):
        def spy(inputs, key=key, step=step):
            keys.append(key)
            return step(inputs)
        graphs._cuda_steps[key] = spy
    run = graphs.run

    def counted(decodes):
        before = len(keys)
        out = run(decodes)
        if len(keys) > before:
            calls.append((len(decodes), *keys[-1]))
        return out
    graphs.run = counted  # type: ignore[method-assign]
    return calls


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, min_new_tokens=n)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


def hf_greedy_tokens(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    """HF ``generate``'s NEW greedy tokens for each prompt (float32, on the CPU)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW,
                               do_sample=False)[0, len(ids):].tolist() for ids in prompts]


@pytest.fixture(scope="module")
def hf_greedy(tiny_model_dir, prompt_ids):
    return hf_greedy_tokens(tiny_model_dir, prompt_ids)


def tokens(res, n: int) -> list[list[int]]:
    return [res[f"r{i}"][0].token_ids for i in range(n)]


def test_captured_steps_give_hf_greedy_tokens_for_every_row_count(tiny_model_dir, prompt_ids,
                                                                  hf_greedy):
    engine = cuda_engine(tiny_model_dir)
    calls = replayed(engine)
    # one arrival every other step: decode steps of 1..8 rows, and down again as they end
    arrivals = {2 * i: [(f"r{i}", ids, greedy())] for i, ids in enumerate(prompt_ids)}
    res = run_to_completion(engine, arrivals)
    assert tokens(res, len(prompt_ids)) == hf_greedy
    rows = {r for r, _, _ in calls}
    assert set(range(1, 9)) <= rows, calls  # 3, 5, 6, 7 ran padded
    assert all(b == min(x for x in BUCKETS if x >= r) for r, b, _ in calls)
    assert {w for _, _, w in calls} == {256 // 16}  # short contexts: the narrowest graphs


def test_graphs_of_the_eager_model_give_hf_greedy_tokens(tiny_model_dir, prompt_ids,
                                                        hf_greedy):
    """--no-compile-cuda-graphs: the eager model captured (the default captures the
    compiled forward), same tokens."""
    engine = cuda_engine(tiny_model_dir, compile_cuda_graphs=False)
    assert engine.runner.decode_graphs is not None
    assert not engine.runner.decode_graphs._inductor_on_cuda()
    arrivals = {i: [(f"r{i}", ids, greedy())] for i, ids in enumerate(prompt_ids)}
    assert tokens(run_to_completion(engine, arrivals), len(prompt_ids)) == hf_greedy


def test_captured_steps_keep_greedy_output_under_preemption(tiny_model_dir, prompt_ids,
                                                           hf_greedy):
    bytes_per_block = 2 * 2 * 4 * 2 * 16 * 4  # (k, v) * layers * block * kv heads * dim * 4 B
    engine = cuda_engine(tiny_model_dir, block_size=4, kv_cache_memory=bytes_per_block * 40)
    calls = replayed(engine)
    res = run_to_completion(engine, {0: [(f"r{i}", ids, greedy())
                                         for i, ids in enumerate(prompt_ids)]})
    assert engine.scheduler.num_preemptions > 0
    assert calls
    assert tokens(res, len(prompt_ids)) == hf_greedy


def test_speculative_rows_run_in_the_graphs_and_keep_greedy_output(tiny_model_dir,
                                                                  prompt_ids):
    spec = SpeculativeConfig(method="ngram", num_spec_tokens=3, ngram_min=1, ngram_max=3,
                             disable_batch_size=64)
    engine = cuda_engine(tiny_model_dir, max_num_seqs=2, spec=spec)
    plain = cuda_engine(tiny_model_dir, eager=True, max_num_seqs=2)
    calls = replayed(engine)
    # copy-heavy output (the prompt repeated), so n-gram lookup proposes and is accepted
    params = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW,
                            logits_processors=[CopyPrompt()])
    arrivals = {0: [(f"r{i}", ids, params) for i, ids in enumerate(prompt_ids[:2])]}
    assert tokens(run_to_completion(engine, arrivals), 2) == tokens(
        run_to_completion(plain, arrivals), 2)
    assert engine.speculator is not None and engine.speculator.stats.accepted > 0
    assert any(r > 2 for r, _, _ in calls), calls  # expansion rows went through a graph


def test_bf16_captured_steps_agree_with_eager(tiny_model_dir, prompt_ids):
    graphs = cuda_engine(tiny_model_dir, dtype="bfloat16")
    eager = cuda_engine(tiny_model_dir, eager=True, dtype="bfloat16")
    arrivals = {i: [(f"r{i}", ids, greedy())] for i, ids in enumerate(prompt_ids)}
    a = tokens(run_to_completion(graphs, arrivals), len(prompt_ids))
    b = tokens(run_to_completion(eager, arrivals), len(prompt_ids))
    # bf16 sums in another order (a full-width masked gather vs the used blocks) may flip
    # a near-tie; the large init keeps margins wide, so nearly every token must agree
    same = sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    assert same >= 0.9 * NEW * len(prompt_ids), (a, b)


def test_a_long_context_runs_in_a_wider_graph_with_the_same_tokens(tiny_model_dir, tokenizer):
    long_ids = tokenizer("one two three four " * 100)["input_ids"][:300]
    ref = hf_greedy_tokens(tiny_model_dir, [long_ids])[0]
    engine = cuda_engine(tiny_model_dir)
    calls = replayed(engine)
    res = run_to_completion(engine, {0: [("r0", long_ids, greedy())]})
    assert res["r0"][0].token_ids == ref
    assert {w for _, _, w in calls} == {1024 // 16}, calls  # 300 tokens: the 1024 graphs


def test_prefix_cache_hits_share_blocks_inside_the_graphs_with_hf_greedy_tokens(
        tiny_model_dir, tokenizer):
    """Prefix caching on CUDA: later prompts take the first one's cached system-prompt
    blocks, and the three decode together in captured steps whose block tables point at
    the same blocks (the Triton kernel reads them in place). Greedy output is HF's, and
    equals a run with caching off."""
    system = "You are a careful assistant. Answer briefly and precisely. " * 6
    prompts = [tokenizer(system + q)["input_ids"] for q in
               ("What is the capital of France?", "Name three prime numbers.",
                "How far is the Moon?")]
    ref = hf_greedy_tokens(tiny_model_dir, prompts)
    # the first prompt alone, the others once its blocks are cached: all three then decode
    arrivals = {0: [("r0", prompts[0], greedy())],
                3: [(f"r{i}", ids, greedy()) for i, ids in enumerate(prompts) if i]}
    outs = {}
    for caching in (True, False):
        engine = cuda_engine(tiny_model_dir, enable_prefix_caching=caching)
        calls = replayed(engine)
        outs[caching] = tokens(run_to_completion(engine, arrivals), 3)
        assert any(r == 3 for r, _, _ in calls), calls
        if caching:
            assert engine.stats().prefix_cache_hits >= 2 * 16, engine.stats()
    assert outs[True] == ref
    assert outs[False] == ref
