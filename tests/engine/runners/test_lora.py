"""Per-row LoRA on the torch runner: greedy output under an adapter equals transformers
with the LoRA merged into the weights, in eager steps and in the compiled decode step; a
batch mixing the base model and two adapters gives each request what it gets alone; the
prefix cache never hands one adapter's blocks to another (or to the base); speculative
verify rows run the request's adapter."""

from __future__ import annotations

import pytest
import torch

from engine.adapters import read_adapter
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.runners.select import torch_runner
from engine.runners.torch import stock_transformers
from engine.runners.torch.lora import LoraLayers
from engine.runners.torch.packed_linear import _LAYERS, packed_key
from engine.sampling_params import SamplingParams
from specdecode.config import SpeculativeConfig
from specdecode.worker import speculator_for
from tests.conftest import SLOW
from tests.lora_adapters import ADAPTERS, hf_greedy, merged_model

NEW = 8
PROMPT = [1, 2, 3, 40, 50, 60, 70, 80, 90, 100, 110]  # 11 tokens: 2 full blocks of 4


def merged_references(model_dir, cache) -> dict[str, list[int]]:
    """transformers' greedy tokens with each adapter merged, by id ('' = the base model)."""
    out = {}
    for name in ["", *ADAPTERS]:
        model = merged_model(model_dir, cache / name if name else None)
        out[name] = hf_greedy(model, PROMPT, NEW)
    assert len({tuple(v) for v in out.values()}) == 3  # each adapter changes the output
    return out


@pytest.fixture(scope="module")
def references(tiny_model_dir, lora_cache) -> dict[str, list[int]]:
    return merged_references(tiny_model_dir, lora_cache)


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


def test_compiled_hooks_read_each_rows_slot_from_the_static_mask(tiny_model_dir, lora_cache):
    """What the compiled decode step traces (the hooks' compiling branch), cheaply: dynamo
    over two adapted layers, rows of mixed slots, equal to the eager hooks."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    lora = LoraLayers(model, 2, 8, torch.device("cpu"), torch.float32)
    lora.load(1, read_adapter(lora_cache, "a1", 8))
    lora.load(2, read_adapter(lora_cache, "a2", 8))
    lora.reserve_static(8)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp

    def layers(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return attn.q_proj(x), mlp.gate_proj(x)  # adapted by a1 and by a2 only

    compiled = torch.compile(layers, backend="eager", fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    for slots in ([1, 0, 2], [2, 2, 0, 1, 1, 0]):
        x = torch.randn(1, len(slots), 64, generator=gen)
        with lora.step(slots):
            expected = layers(x)
        lora.fill_static(slots)
        for got, want in zip(compiled(x), expected, strict=True):
            torch.testing.assert_close(got, want)
        base = layers(x)  # no step: the base model
        changed = [not torch.allclose(a, b) for a, b in zip(expected[0][0], base[0][0],
                                                            strict=True)]
        assert changed == [s == 1 for s in slots]  # q_proj: only a1's rows change


@pytest.mark.skipif(not SLOW, reason="compiles for ~30 s; the "
                    "compiled hooks are checked above, set GENSERVE_SLOW=1 for the whole step")
@pytest.mark.parametrize("pack_weights", [False, True], ids=["F.linear", "packed"])
def test_compiled_decode_step_applies_each_rows_adapter(tiny_model_dir, lora_cache,
                                                        references, pack_weights):
    """Prefills eager, decodes compiled; the adapters load after the compile (packed: they
    would fold layers the graph has unfolded, ``freeze_folds``)."""
    eng = engine(tiny_model_dir, lora_cache, enforce_eager=False, pack_weights=pack_weights,
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


def test_folded_a_is_repacked_when_a_slot_is_overwritten(tiny_model_dir, lora_cache,
                                                          references):
    """One slot, two adapters taking turns: each write re-packs ``[W; A_catᵀ]`` into the
    packed layers, so each adapter gives its own merged-reference tokens; unpacking gives
    the layers back their plain weights."""
    eng = engine(tiny_model_dir, lora_cache, max_loras=1)
    runner = torch_runner(eng.runner)
    for a in ("a1", "a2", "a1", ""):
        assert run(eng, [a]) == [references[a]]
    lora = runner.lora
    assert lora is not None
    folded = [s for s in lora.stacks.values() if s.targeted]
    assert folded and all(s.module.__dict__["forward"] is s.folded for s in folded)
    base = merged_model(tiny_model_dir, None)
    with stock_transformers(runner.model) as model:
        plain = dict(model.named_parameters())
        for name, p in base.named_parameters():
            assert torch.equal(plain[name], p), name


def test_once_compiled_steps_are_built_an_adapter_write_keeps_each_layers_fold(
        tiny_model_dir, lora_cache, references):
    """A compiled graph bakes in each packed layer's forward and packed width, and runs
    without re-checking them: an adapter loaded after the compile folded new layers, and
    the graph failed its shape check (found by a soak). After ``freeze_folds`` (a build's
    first act) no write changes a layer's fold, and each adapter still gives its
    merged-reference tokens (folded layers it leaves add zero columns, unfolded layers it
    adapts run the hook)."""
    eng = engine(tiny_model_dir, lora_cache, max_loras=1)
    lora = torch_runner(eng.runner).lora
    assert lora is not None
    assert run(eng, ["a1"]) == [references["a1"]]  # folds the layers a1 adapts

    def layout() -> dict[str, tuple[object, torch.Size]]:
        return {name: (s.module.__dict__["forward"], _LAYERS[key].dense().shape)
                for name, s in lora.stacks.items()
                if (key := packed_key(s.module)) is not None}

    lora.freeze_folds()
    frozen = layout()
    folded = {n for n, s in lora.stacks.items() if n in frozen and s.folded is not None}
    assert folded and folded != set(frozen)  # both kinds of layer are exercised
    for a in ("a2", "a1", "", "a2"):
        assert run(eng, [a]) == [references[a]], a
        assert layout() == frozen, a


def test_eager_adapter_rows_are_right_while_a_compile_runs_on_another_thread(
        eager, references, monkeypatch):
    """``torch.compiler.is_compiling()`` is one process-wide flag, set while any thread
    compiles: the hooks read it, so while the decode step compiled in the background
    (~15 s after SERVING) eager steps ran the compiled path's static mask and adapter
    requests got the base model's tokens (found by a soak). Here the flag is set as a
    background compile sets it."""
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    assert torch.compiler.is_compiling()
    assert run(eager, ["a1", "", "a2"]) == [references["a1"], references[""],
                                              references["a2"]]
