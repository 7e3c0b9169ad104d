"""Tensor parallelism on the CPU (gloo): the model sharded over two processes gives the
same greedy tokens as one process, eagerly, compiled and with speculation on, with LoRA
adapters mixed in a batch, loaded mid-run and reusing an evicted slot; what cannot be
sharded is refused before any worker starts; closing leaves no worker behind.

Each TP=2 engine spawns a worker process (seconds): one llama engine (adapters on) serves
the module's llama tests; three more architectures (q/k norms; soft-capping + sliding
windows; Phi-3's fused projections, with an adapter) run first, eagerly. The compiled test
runs last: a process that compiled the step with one group could not connect a second
group afterwards (gloo), which a server never needs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.adapters import AdapterError
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.runners.select import choose_runner
from engine.runners.torch.attention import UnsupportedModelFeature
from engine.sampling_params import SamplingParams
from specdecode.config import SpeculativeConfig
from specdecode.worker import speculator_for
from tests.engine.runners.architectures import build_architecture
from tests.engine.test_engine import run_to_completion
from tests.lora_adapters import save_lora

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


def _generate(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int]]]],
              speculative: bool | None = None) -> list[list[int]]:
    """Greedy tokens of each (adapter id or '' for the base model, prompt), in arrival
    order; a request joins at its step and leases its adapter then (a first use loads
    it between steps, on every rank)."""
    params = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, speculative=speculative)
    tokens: dict[str, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_work:
        for adapter_id, ids in arrivals.get(step, []):
            rid = f"r{len(tokens)}"
            lease = None
            if adapter_id:
                assert engine.adapters is not None
                lease = engine.adapters.acquire(adapter_id)
            engine.add_request(rid, ids, params, lease)
            tokens[rid] = []
        for out in engine.step():
            for d in out.deltas:
                tokens[out.request_id].extend(d.token_ids)
        step += 1
    return list(tokens.values())


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


def test_fused_projections_with_an_adapter_tp2_equal_tp1(tmp_path, tokenizer_dir, prompt_ids):
    """Phi-3's fused qkv_proj and gate_up_proj: the adapter's B is cut part by part (its
    q, k and v rows; gate and up), as the weight is."""
    model_dir = build_architecture("phi3", tmp_path / "phi3", tokenizer_dir)
    save_lora(model_dir, tmp_path / "cache" / "p1", seed=1, rank=4,
              targets=["qkv_proj", "gate_up_proj", "o_proj", "down_proj"])
    kw = dict(enforce_eager=True, adapter_cache=str(tmp_path / "cache"), max_lora_rank=4)
    jobs = {0: [("p1", prompt_ids[0]), ("", prompt_ids[0]), ("p1", prompt_ids[1])]}
    reference = _generate(LLMEngine(_config(model_dir, 1, **kw)), jobs)
    assert reference[0] != reference[1]  # the adapter changes the output
    engine = LLMEngine(_config(model_dir, 2, **kw))
    try:
        assert _generate(engine, jobs) == reference
    finally:
        engine.runner.close()


@pytest.fixture(scope="module")
def adapter_cache(tmp_path_factory, tiny_model_dir, lora_cache) -> Path:
    """a1 and a2 of tests.lora_adapters, a3 (every projection, rank 8), and 'shard_sized':
    q_proj's lora_B sized like one rank's share of the layer (32 rows of 64)."""
    root = tmp_path_factory.mktemp("tp_adapters")
    for name in ("a1", "a2"):
        (root / name).symlink_to(lora_cache / name)
    save_lora(tiny_model_dir, root / "a3", seed=3, rank=8,
              targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"])
    from safetensors.torch import save_file

    bad = root / "shard_sized"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{key}.lora_A.weight": torch.ones(4, 64),
               f"{key}.lora_B.weight": torch.ones(32, 4)},
              str(bad / "adapter_model.safetensors"))
    return root


def _adapters(cache: Path) -> dict:
    return dict(adapter_cache=str(cache), max_loras=2, max_lora_rank=8, max_lora_wait_s=5.0)


@pytest.fixture(scope="module")
def llama_tp1(tiny_model_dir, adapter_cache) -> LLMEngine:
    """The references: one process, the same adapters (eager)."""
    return LLMEngine(_config(tiny_model_dir, 1, enforce_eager=True, **_adapters(adapter_cache)))


@pytest.fixture(scope="module")
def llama_tp2(tiny_model_dir, adapter_cache):
    """One TP=2 engine (speculation and adapters on) for the module's llama tests; on
    teardown, closing it must leave no worker process."""
    engine = LLMEngine(_config(tiny_model_dir, 2, **_adapters(adapter_cache)),
                       speculator=speculator_for(_draft(tiny_model_dir)))
    workers = list(engine.runner.tp.workers)  # type: ignore[attr-defined]
    assert len(workers) == 1 and workers[0].poll() is None
    yield engine
    engine.runner.close()
    assert all(p.poll() is not None for p in workers), "a worker outlived close()"
    assert workers[0].returncode == 0  # it stopped on the leader's message, not a kill


def test_greedy_with_tp2_equals_tp1_with_speculation(llama_tp2, tiny_model_dir, prompt_ids):
    reference = _greedy(LLMEngine(_config(tiny_model_dir, 1)), prompt_ids)
    assert _greedy(llama_tp2, prompt_ids) == reference
    assert llama_tp2.stats().spec.accepted > 0  # verify steps of k + 1 rows ran sharded
    # Each rank holds half the KV heads, so the same memory holds twice the blocks.
    one = LLMEngine(_config(tiny_model_dir, 1), speculator=None).runner.num_blocks
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


def test_a_mixed_batch_of_base_and_two_adapters_with_tp2_equals_tp1(llama_tp2, llama_tp1,
                                                                      prompt_ids):
    """Column-parallel layers run B's rows of their outputs, row-parallel ones A's columns
    of their inputs with the partial LoRA term inside the all-reduce; verify rows of the
    draft's proposals run each request's adapter."""
    p0, p1 = prompt_ids
    jobs = {0: [("a1", p0), ("", p0), ("a2", p0), ("a1", p1)]}
    reference = _generate(llama_tp1, jobs)
    assert len({tuple(r) for r in reference[:3]}) == 3  # each adapter changes the output
    accepted = llama_tp2.stats().spec.accepted
    assert _generate(llama_tp2, jobs) == reference
    assert llama_tp2.stats().spec.accepted > accepted


def test_an_adapter_loaded_mid_run_into_an_evicted_slot_with_tp2_equals_tp1(
        llama_tp2, llama_tp1, prompt_ids):
    """a3 arrives after three steps, while a2's request runs: it evicts a1 (least recently
    used, held by no request) and every rank overwrites that slot."""
    p0, p1 = prompt_ids
    jobs = {0: [("", p0), ("a2", p1)], 3: [("a3", p0)]}
    reference = _generate(llama_tp1, jobs)
    assert reference[2] != reference[0]
    lease = llama_tp2.adapters.acquire("a1")  # resident, least recently used from here
    a1_slot = lease.slot
    lease.release()
    assert _generate(llama_tp2, jobs) == reference
    slots = {a.adapter_id: a.slot for a in llama_tp2.adapters.resident()}
    assert slots.keys() == {"a2", "a3"} and slots["a3"] == a1_slot


def test_an_adapter_sized_for_one_ranks_share_is_refused_before_any_rank_loads_it(
        llama_tp2):
    """Checked against the full layer on rank 0: nothing reaches the workers, and the
    group goes on serving."""
    with pytest.raises(AdapterError, match=r"shard_sized.*q_proj.*do not fit the layer "
                                           r"\(64 -> 64\)"):
        llama_tp2.adapters.acquire("shard_sized")
    assert llama_tp2.runner.failure is None
    assert len(_generate(llama_tp2, {0: [("a2", [1, 2, 3])]})[0]) == NEW


def test_a_self_draft_is_refused_with_tensor_parallelism(llama_tp2):
    spec = SpeculativeConfig(method="draft", draft_model="self:1", num_spec_tokens=2)
    with pytest.raises(ValueError, match="self-draft would run the target's sharded"):
        speculator_for(spec)(llama_tp2.runner)


def test_compiled_decode_with_tp2_equals_tp1(llama_tp2, llama_tp1, prompt_ids):
    """Rank 0 and the worker compile in lockstep; the compiled graph keeps the all-reduces
    (a worker's graph, whose logits nobody reads, must not drop its last layer's) and
    applies each row's adapter from the static mask every rank fills."""
    report = llama_tp2.runner.warmup()
    assert report.ready == ["1"], report
    graphs = llama_tp2.runner.decode_graphs
    calls = []
    real_run = graphs.run
    graphs.run = lambda decodes: calls.append(len(decodes)) or real_run(decodes)
    # One sequence, no speculation: every decode step is the one-row compiled graph.
    for adapter_id in ("", "a2"):
        jobs = {0: [(adapter_id, prompt_ids[0])]}
        assert _generate(llama_tp2, jobs, speculative=False) == _generate(llama_tp1, jobs)
    assert calls and set(calls) == {1}
