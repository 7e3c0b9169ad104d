"""Tensor parallelism on the CPU (gloo): the model sharded over two processes gives the
same greedy tokens as one process, eagerly, compiled and with speculation on; what cannot
be sharded is refused before any worker starts; closing leaves no worker behind.

Each TP=2 engine spawns a worker process (seconds): one llama engine serves the module's
llama tests; two more architectures (q/k norms; soft-capping + sliding windows) run first,
eagerly. The compiled test runs last: a process that compiled the step with one group
could not connect a second group afterwards (gloo), which a server never needs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.runners.select import choose_runner
from engine.runners.torch.attention import UnsupportedModelFeature
from engine.sampling_params import SamplingParams
from specdecode.config import SpeculativeConfig
from specdecode.worker import speculator_for
from tests.engine.runners.architectures import build_architecture
from tests.engine.test_engine import run_to_completion

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"]
NEW = 10


def _config(model_dir: Path, tp: int, **kw) -> EngineConfig:
    return EngineConfig(model=str(model_dir), tensor_parallel_size=tp, block_size=4,
                        kv_cache_memory=1 << 21, max_num_batched_tokens=16,  # chunked prefill
                        max_num_seqs=4, decode_buckets=[1], **kw)


def _greedy(engine: LLMEngine, prompt_ids: list[list[int]],
            speculative: bool | None = None) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, speculative=speculative)
    res = run_to_completion(engine, {0: [(f"r{i}", ids, params)
                                         for i, ids in enumerate(prompt_ids)]})
    return [res[f"r{i}"][0].token_ids for i in range(len(prompt_ids))]


def _draft(model_dir: Path) -> SpeculativeConfig:
    """The model drafting for itself, unsharded on rank 0: every proposal is accepted, so
    each step verifies k + 1 rows per sequence on the sharded target (a random model gives
    n-gram lookup nothing to find)."""
    return SpeculativeConfig(method="draft", draft_model=str(model_dir), num_spec_tokens=3,
                             disable_batch_size=64)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.mark.parametrize("name", ["qwen3", "gemma2"])
def test_greedy_with_tp2_equals_tp1_on_other_architectures(name, tmp_path, tokenizer_dir,
                                                           prompt_ids):
    """q/k norms per head (qwen3); attention + final soft-capping with alternating sliding
    windows (gemma2). Before the llama tests: a process joins one group at a time, and
    these run first, with their own engines, closed before the shared one starts."""
    model_dir = build_architecture(name, tmp_path / name, tokenizer_dir)
    reference = _greedy(LLMEngine(_config(model_dir, 1, enforce_eager=True)), prompt_ids)
    engine = LLMEngine(_config(model_dir, 2, enforce_eager=True))
    try:
        assert _greedy(engine, prompt_ids) == reference
    finally:
        engine.runner.close()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return build_architecture("llama", tmp_path_factory.mktemp("tp_llama"), tokenizer_dir)


@pytest.fixture(scope="module")
def llama_tp2(llama_dir):
    """One TP=2 engine (speculation on) for the module's llama tests; on teardown, closing
    it must leave no worker process."""
    engine = LLMEngine(_config(llama_dir, 2), speculator=speculator_for(_draft(llama_dir)))
    workers = list(engine.runner.tp.workers)  # type: ignore[attr-defined]
    assert len(workers) == 1 and workers[0].poll() is None
    yield engine
    engine.runner.close()
    assert all(p.poll() is not None for p in workers), "a worker outlived close()"
    assert workers[0].returncode == 0  # it stopped on the leader's message, not a kill


def test_greedy_with_tp2_equals_tp1_with_speculation(llama_tp2, llama_dir, prompt_ids):
    reference = _greedy(LLMEngine(_config(llama_dir, 1)), prompt_ids)
    assert _greedy(llama_tp2, prompt_ids) == reference
    assert llama_tp2.stats().spec.accepted > 0  # verify steps of k + 1 rows ran sharded
    # Each rank holds half the KV heads, so the same memory holds twice the blocks.
    one = LLMEngine(_config(llama_dir, 1), speculator=None).runner.num_blocks
    assert llama_tp2.runner.num_blocks == 2 * one


def test_heads_that_do_not_divide_are_refused_before_any_worker_starts(tmp_path,
                                                                        tokenizer_dir):
    model_dir = build_architecture("llama", tmp_path / "m", tokenizer_dir)  # 4 heads, 2 KV
    with pytest.raises(UnsupportedModelFeature,
                       match=r"num_attention_heads=4 does not divide by 3.*"
                             r"num_key_value_heads=2 does not divide by 3"):
        LLMEngine(EngineConfig(model=str(model_dir), tensor_parallel_size=3))
    with pytest.raises(UnsupportedModelFeature, match="num_key_value_heads=2 does not "
                                                      "divide by 4"):
        LLMEngine(EngineConfig(model=str(model_dir), tensor_parallel_size=4))


def test_mixture_of_experts_and_norms_over_all_heads_are_refused(tmp_path, tokenizer_dir):
    moe = build_architecture("mixtral", tmp_path / "moe", tokenizer_dir)
    with pytest.raises(UnsupportedModelFeature, match="mixture-of-experts"):
        LLMEngine(EngineConfig(model=str(moe), tensor_parallel_size=2))
    olmo2 = build_architecture("olmo2", tmp_path / "olmo2", tokenizer_dir)
    with pytest.raises(UnsupportedModelFeature, match=r"self_attn\.q_norm spans all heads"):
        LLMEngine(EngineConfig(model=str(olmo2), tensor_parallel_size=2))


def test_tensor_parallel_with_the_llamacpp_runner_is_refused():
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 needs --runner torch"):
        choose_runner(EngineConfig(runner="llamacpp", tensor_parallel_size=2))
    assert choose_runner(EngineConfig(runner="auto", tensor_parallel_size=2)) == "torch"


def test_adapters_with_tensor_parallelism_are_refused_before_any_worker_starts(tmp_path):
    with pytest.raises(ValueError, match="LoRA adapters are not sharded"):
        LLMEngine(EngineConfig(model="default", runner="torch", tensor_parallel_size=2,
                               adapter_cache=str(tmp_path)))


def test_a_self_draft_is_refused_with_tensor_parallelism(llama_tp2):
    spec = SpeculativeConfig(method="draft", draft_model="self:1", num_spec_tokens=2)
    with pytest.raises(ValueError, match="self-draft would run the target's sharded"):
        speculator_for(spec)(llama_tp2.runner)


def test_compiled_decode_with_tp2_equals_tp1(llama_tp2, llama_dir, prompt_ids):
    """Rank 0 and the worker compile in lockstep; the compiled graph keeps the all-reduces
    (a worker's graph, whose logits nobody reads, must not drop its last layer's)."""
    report = llama_tp2.runner.warmup()
    assert report.ready == ["1"], report
    graphs = llama_tp2.runner.decode_graphs
    calls = []
    real_run = graphs.run
    graphs.run = lambda decodes: calls.append(len(decodes)) or real_run(decodes)
    reference = _greedy(LLMEngine(_config(llama_dir, 1)), prompt_ids[:1])
    # One sequence, no speculation: every decode step is the one-row compiled graph.
    assert _greedy(llama_tp2, prompt_ids[:1], speculative=False) == reference
    assert calls and set(calls) == {1}
