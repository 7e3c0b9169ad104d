"""Per-row LoRA on the torch runner: greedy output under an adapter equals transformers
with the LoRA merged into the weights, in eager steps and in the compiled decode step; a
batch mixing the base model and two adapters gives each request what it gets alone; the
prefix cache never hands one adapter's blocks to another (or to the base); speculative
verify rows run the request's adapter."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from specdecode.config import SpeculativeConfig
from specdecode.worker import speculator_for
from tests.lora_adapters import ADAPTERS, hf_greedy, merged_model

NEW = 8
PROMPT = [1, 2, 3, 40, 50, 60, 70, 80, 90, 100, 110]  # 11 tokens: 2 full blocks of 4


@pytest.fixture(scope="module")
def references(tiny_model_dir, lora_cache) -> dict[str, list[int]]:
    """transformers' greedy tokens, by adapter id ('' = the base model)."""
    out = {}
    for name in ["", *ADAPTERS]:
        model = merged_model(tiny_model_dir, lora_cache / name if name else None)
        out[name] = hf_greedy(model, PROMPT, NEW)
    assert len({tuple(v) for v in out.values()}) == 3  # each adapter changes the output
    return out


def engine(model_dir, cache, speculative: SpeculativeConfig | None = None,
           **kw) -> LLMEngine:
    """Eager, with oneDNN-packed linears (the CPU default) unless ``kw`` says otherwise."""
    kw.setdefault("enforce_eager", True)
    return LLMEngine(EngineConfig(model=str(model_dir), adapter_cache=str(cache),
                                  block_size=4, kv_cache_memory=2 << 20, max_model_len=128,
                                  max_num_seqs=8, **kw),
                     speculator=speculator_for(speculative) if speculative else None)


@pytest.fixture(scope="module")
def eager(tiny_model_dir, lora_cache) -> LLMEngine:
    return engine(tiny_model_dir, lora_cache)


def run(eng: LLMEngine, adapter_ids: list[str], prompt: list[int] = PROMPT,
        params: SamplingParams | None = None) -> list[list[int]]:
    """Every request added before the first step (so they share each step); tokens each."""
    params = params or SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW)
    tokens: dict[str, list[int]] = {}
    for i, a in enumerate(adapter_ids):
        lease = eng.adapters.acquire(a) if a else None
        eng.add_request(f"r{i}", prompt, params, lease)
        tokens[f"r{i}"] = []
    while eng.has_work:
        for out in eng.step():
            for d in out.deltas:
                tokens[out.request_id].extend(d.token_ids)
    return [tokens[f"r{i}"] for i in range(len(adapter_ids))]


def test_mixed_batch_equals_each_alone_and_transformers_merged(eager, references):
    alone = {a: run(eager, [a])[0] for a in ("a1", "", "a2")}
    assert alone == references
    mixed = run(eager, ["a1", "", "a2", "a1"])
    assert mixed == [references["a1"], references[""], references["a2"], references["a1"]]
    assert all(a.active_requests == 0 for a in eager.adapters.resident())  # leases given back


def test_compiled_decode_step_applies_each_rows_adapter(tiny_model_dir, lora_cache,
                                                        references):
    """Plain F.linear (a packed model is never compiled): prefills eager, decodes compiled."""
    eng = engine(tiny_model_dir, lora_cache, enforce_eager=False, pack_weights=False,
                 decode_buckets=[3])
    report = eng.runner.warmup()
    assert report.ready == ["2-3"], report
    graphs = eng.runner.decode_graphs
    assert graphs is not None
    ran = []
    real_step = graphs._cpu_step
    graphs._cpu_step = lambda inputs: ran.append(inputs.num_rows) or real_step(inputs)
    assert run(eng, ["a1", "", "a2"]) == [references["a1"], references[""], references["a2"]]
    assert ran and set(ran) == {3} and graphs.covers(3)  # decodes ran compiled, none fell back


def test_prefix_cache_blocks_are_never_shared_across_adapters(tiny_model_dir, lora_cache,
                                                              references):
    eng = engine(tiny_model_dir, lora_cache)  # an empty prefix cache

    def cached(adapter_id: str) -> tuple[list[int], int]:
        lease = eng.adapters.acquire(adapter_id) if adapter_id else None
        req = eng.add_request(f"p-{adapter_id}-{eng.scheduler.allocator.stats.queries}",
                              PROMPT, SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW),
                              lease)
        tokens = []
        while eng.has_work:
            for out in eng.step():
                for d in out.deltas:
                    tokens.extend(d.token_ids)
        return tokens, req.usage.cached_prompt_tokens

    assert cached("") == (references[""], 0)
    assert cached("a1") == (references["a1"], 0)  # the base's blocks are not a1's
    assert cached("a2") == (references["a2"], 0)
    assert cached("a1") == (references["a1"], 8)  # a1's own blocks are found again
    assert cached("") == (references[""], 8)


def test_speculative_verify_rows_run_the_requests_adapter(tiny_model_dir, lora_cache, eager):
    """n-gram speculation on a copy-heavy prompt: the same tokens as without it."""
    prompt = [5, 6, 7, 8, 9] * 4
    params = SamplingParams(max_new_tokens=12, min_new_tokens=12)
    plain = run(eager, ["a1", "a2", ""], prompt, params)
    eng = engine(tiny_model_dir, lora_cache, SpeculativeConfig(
        method="ngram", num_spec_tokens=3, ngram_min=1, ngram_max=3))
    assert run(eng, ["a1", "a2", ""], prompt, params) == plain
    assert eng.speculator is not None and eng.speculator.stats.proposed > 0
