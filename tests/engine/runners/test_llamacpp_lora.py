"""LoRA adapters on the llama.cpp runner, on the tiny random Llama written as an F32 GGUF
(tests/engine/runners/gguf_builder.py) and tiny random PEFT adapters (lora_B non-zero):

- greedy output with an adapter equals transformers' with the LoRA merged into the weights
  (peft's merge_and_unload), for two adapters (one rsLoRA, different target modules), on
  Llama (interleaved RoPE in llama.cpp: q/k rows permuted) and Qwen2 (NEOX RoPE: not);
- base and adapter requests running together each give their solo output, the scheduler
  giving every step one adapter's rows (llama.cpp sets adapters per context);
- an adapter that does not fit the model (a module it lacks, shapes of another model) is
  an ``AdapterError`` naming it and why, nothing stays loaded, and the engine goes on;
- a slot reused after LRU eviction runs the adapter loaded into it;
- a GGUF LoRA file (llama.cpp's own format) is loaded as it is, preferred to PEFT files
  beside it, and gives the greedy tokens of the same adapter as PEFT files; a GGUF that is
  no LoRA adapter of this model, or that breaks the format, is refused naming why.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.adapters import AdapterError
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loading import weights_cache
from engine.runners import llamacpp_lora
from engine.runners.select import llama_cpp_available
from engine.sampling_params import SamplingParams
from tests.engine.runners.gguf_builder import write_gguf
from tests.lora_adapters import (
    ADAPTERS,
    gguf_lora_of,
    hf_greedy,
    merged_model,
    save_lora,
    write_gguf_lora,
)

pytestmark = pytest.mark.skipif(not llama_cpp_available(),
                                reason="llama-cpp-python is not installed")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def cache(tmp_path_factory, lora_cache) -> Path:
    """A copy of the session's adapter cache (``tests.lora_adapters.ADAPTERS``: a1, a2 with
    rsLoRA, over different modules), which these tests add adapters to."""
    root = tmp_path_factory.mktemp("llamacpp-adapters") / "cache"
    shutil.copytree(lora_cache, root)
    return root


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory, tiny_model_dir) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return write_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture(scope="module")
def engine(gguf_path, cache, tiny_model_dir) -> Iterator[LLMEngine]:
    """The engine on llama.cpp; its tokenizer and configs are read from the HF model the
    GGUF was written from, which is what the weights cache would convert the GGUF back to
    (tens of seconds for its vocabulary: not what these tests are about). torch's thread
    count is restored after (the runner limits torch to one thread)."""
    n = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(weights_cache, "cached_model_dir", lambda gguf, *a, **k: tiny_model_dir)
        yield LLMEngine(EngineConfig(
            model=str(gguf_path), runner="llamacpp", max_model_len=256,
            kv_cache_memory=4 << 20, max_num_seqs=8, threads=1, adapter_cache=str(cache),
            max_loras=2, max_lora_rank=8))
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ids(engine) -> list[list[int]]:
    return [engine.tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def merged_greedy(tiny_model_dir, cache, ids) -> dict[str, list[list[int]]]:
    """transformers' greedy output of each prompt, the LoRA merged into the weights
    ("" = the base model)."""
    out = {}
    for name in ("", *ADAPTERS):
        model = merged_model(tiny_model_dir, cache / name if name else None)
        with torch.inference_mode():
            out[name] = [hf_greedy(model, p, MAX_NEW) for p in ids]
    return out


def greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)


def run(engine: LLMEngine, requests: list[tuple[str, list[int], str]]) -> dict[str, list[int]]:
    """Every request added at once (``(request id, prompt, adapter id)``), run to the end."""
    assert engine.adapters is not None
    step, done = 0, dict[str, list[int]]()
    for rid, p, adapter in requests:
        lease = engine.adapters.acquire(adapter) if adapter else None
        engine.add_request(rid, p, greedy(), adapter=lease)
        done[rid] = []
    while engine.has_work:
        for out in engine.step():
            for d in out.deltas:
                done[out.request_id] += d.token_ids
        step += 1
        assert step < 1000
    assert engine.scheduler.allocator.num_used == 0
    return done


def test_greedy_with_an_adapter_equals_transformers_with_the_lora_merged(
        engine, ids, merged_greedy):
    for name in ("", *ADAPTERS):
        out = run(engine, [(f"{name}-{i}", p, name) for i, p in enumerate(ids)])
        assert [out[f"{name}-{i}"] for i in range(len(ids))] == merged_greedy[name], name
    assert merged_greedy["a1"] != merged_greedy[""] != merged_greedy["a2"]  # adapters matter


def test_base_and_adapter_requests_together_each_give_their_solo_output(
        engine, ids, merged_greedy):
    """Nine requests over three slots (base, a1, a2) and eight seats: the scheduler gives
    each step one slot's rows (the runner refuses a mixed step), the slots take turns of
    four steps while all have work, and every request still ends with its solo output."""
    requests = [(f"m{i}-{name}", ids[i], name) for i in range(len(ids))
                for name in ("", *ADAPTERS)]
    order: list[int] = []  # the adapter slot of each step
    execute = engine.runner.execute

    def recording(decodes, prefills):
        order.extend({r.adapter_slot for r in decodes} | {w.adapter_slot for w in prefills})
        return execute(decodes, prefills)

    engine.runner.execute = recording  # type: ignore[method-assign]
    try:
        out = run(engine, requests)
    finally:
        del engine.runner.execute
    for rid, p, name in requests:
        assert out[rid] == merged_greedy[name][ids.index(p)], rid
    runs: list[list[int]] = []  # [slot, steps] of each turn
    for slot in order:
        if runs and runs[-1][0] == slot:
            runs[-1][1] += 1
        else:
            runs.append([slot, 1])
    # each slot's first three requests need 12 steps: three turns of 4 each, in rotation
    assert [n for _, n in runs[:8]] == [4] * 8 and runs[8][1] >= 4
    assert all(len({s for s, _ in runs[i:i + 3]}) == 3 for i in (0, 3, 6))
    assert [s for s, _ in runs[:3]] * 3 == [s for s, _ in runs[:9]]


def test_a_mixed_step_is_refused_by_the_runner(engine, ids):
    from engine.runners.base import PrefillWork

    with pytest.raises(RuntimeError, match=r"cannot run adapter slots \[0, 1\]"):
        engine.runner.execute([], [PrefillWork(ids[0], 0, [], True, seq_id=10_001),
                                   PrefillWork(ids[1], 0, [], True, seq_id=10_002,
                                               adapter_slot=1)])
    engine.runner.release(10_001)
    engine.runner.release(10_002)


def write_adapter(directory: Path, tensors: dict[str, torch.Tensor], rank: int) -> None:
    from safetensors.torch import save_file

    directory.mkdir()
    save_file(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank,
         "target_modules": sorted({k.split(".")[-3] for k in tensors})}))


@pytest.mark.parametrize("name, module, a_shape, b_shape, reason", [
    ("wrong-shape", "model.layers.0.self_attn.q_proj", (4, 32), (64, 4),
     r"tensor 'blk.0.attn_q.weight' \(module 'model.layers.0.self_attn.q_proj'\): "
     r"lora_a \[32, 4\] / lora_b \[4, 64\] do not fit the model's \[64, 64\]"),
    ("no-such-layer", "model.layers.7.self_attn.q_proj", (4, 64), (64, 4),
     r"target module 'model.layers.7.self_attn.q_proj' is not in this llama model "
     r"\(2 layers\)"),
    ("no-such-module", "model.layers.0.self_attn.rotary", (4, 64), (64, 4),
     r"target module 'model.layers.0.self_attn.rotary' is not in this llama model"),
])
def test_an_adapter_that_does_not_fit_is_refused_naming_it_and_nothing_stays_loaded(
        engine, cache, ids, merged_greedy, name, module, a_shape, b_shape, reason):
    prefix = f"base_model.model.{module}"
    write_adapter(cache / name, {f"{prefix}.lora_A.weight": torch.ones(a_shape),
                                 f"{prefix}.lora_B.weight": torch.ones(b_shape)}, 4)
    assert engine.adapters is not None
    with pytest.raises(AdapterError, match=f"adapter '{name}': {reason}"):
        engine.adapters.acquire(name)
    assert name not in [a.adapter_id for a in engine.adapters.resident()]
    assert run(engine, [("after", ids[0], "a1")])["after"] == merged_greedy["a1"][0]


def test_what_llama_cpp_itself_refuses_comes_back_with_its_reason(engine, cache, ids,
                                                                   merged_greedy, monkeypatch):
    """Shapes are checked against the model file first; where that file cannot be read,
    llama.cpp's own refusal (its log line) is the reason."""
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    write_adapter(cache / "unchecked", {f"{module}.lora_A.weight": torch.ones(4, 32),
                                        f"{module}.lora_B.weight": torch.ones(64, 4)}, 4)
    monkeypatch.setattr(engine.runner.adapters, "_base_shapes", lambda: None)
    assert engine.adapters is not None
    with pytest.raises(AdapterError, match=r"llama.cpp refused it: tensor 'blk.0.attn_q.weight' "
                       r"\(module 'model.layers.0.self_attn.q_proj'\) has incorrect shape"):
        engine.adapters.acquire("unchecked")
    assert run(engine, [("after", ids[0], "a1")])["after"] == merged_greedy["a1"][0]


def test_tensor_shapes_read_from_the_gguf_header_are_gguf_pys(gguf_path):
    want = {t.name: tuple(int(n) for n in t.shape) for t in gguf.GGUFReader(gguf_path).tensors}
    assert llamacpp_lora.gguf_tensor_shapes(gguf_path) == want
    assert want["blk.0.attn_q.weight"] == (64, 64) and want["blk.1.ffn_down.weight"] == (128, 64)


def test_a_file_that_is_not_gguf_has_no_tensor_shapes(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        llamacpp_lora.gguf_tensor_shapes(tmp_path / "x.gguf")


@pytest.mark.parametrize("fault", ["peft", "gguf"])
def test_a_misfit_adapter_arriving_while_every_slot_is_held_is_refused_not_kept_waiting(
        engine, cache, fault):
    """Its fit to the model is checked before it would wait for a slot: INVALID_ARGUMENT
    at once, not RESOURCE_EXHAUSTED after the wait, and nothing is loaded."""
    name = f"misfit-{fault}"
    if fault == "peft":
        module = "base_model.model.model.layers.1.mlp.down_proj"
        write_adapter(cache / name, {f"{module}.lora_A.weight": torch.ones(4, 64),
                                     f"{module}.lora_B.weight": torch.ones(64, 4)}, 4)
        reason = "tensor 'blk.1.ffn_down.weight' (module 'model.layers.1.mlp.down_proj'): "
    else:
        write_gguf_lora(cache / name / "x.gguf", pair("blk.9.attn_q.weight"))
        reason = "tensor 'blk.9.attn_q.weight' is not in this llama model (2 layers)"
    registry = engine.adapters
    assert registry is not None and registry.max_loras == 2
    held = [registry.acquire("a1"), registry.acquire("a2")]
    try:
        loads = registry.loads
        with pytest.raises(AdapterError) as e:
            registry.acquire(name)
        assert reason in str(e.value)
        assert registry.loads == loads and registry.waiting == 0
        assert {a.adapter_id for a in registry.resident()} == {"a1", "a2"}
    finally:
        for lease in held:
            lease.release()


def test_a_slot_reused_after_eviction_runs_the_adapter_loaded_into_it(
        engine, cache, tiny_model_dir, ids, merged_greedy):
    """Two slots, a third adapter: it evicts the least recently used one, here the adapter
    still set on llama.cpp's context (freed only once the context no longer has it), and
    runs its own LoRA in that slot; the evicted adapter, reloaded, gives its output again."""
    registry = engine.adapters
    assert registry is not None
    save_lora(tiny_model_dir, cache / "a3", seed=3, targets=["q_proj", "up_proj"], rank=2)
    with torch.inference_mode():
        want = hf_greedy(merged_model(tiny_model_dir, cache / "a3"), ids[1], MAX_NEW)

    def slot(name: str) -> int:
        return next(a.slot for a in registry.resident() if a.adapter_id == name)

    assert run(engine, [("ev-a1", ids[1], "a1")])["ev-a1"] == merged_greedy["a1"][1]
    a1_slot = slot("a1")
    hold = registry.acquire("a2")  # a2 most recently used: a1 is the one to evict
    try:
        assert run(engine, [("ev-a3", ids[1], "a3")])["ev-a3"] == want
        assert slot("a3") == a1_slot and "a1" not in [a.adapter_id for a in registry.resident()]
    finally:
        hold.release()
    loads = registry.loads
    assert run(engine, [("ev-a1b", ids[1], "a1")])["ev-a1b"] == merged_greedy["a1"][1]
    assert run(engine, [("ev-a2", ids[1], "a2")])["ev-a2"] == merged_greedy["a2"][1]
    assert registry.loads == loads + 2  # a1 reloaded, a2 reloaded after a1 evicted it


def test_on_a_neox_rope_model_q_and_k_are_not_permuted(tmp_path, tokenizer_dir, ids):
    """Qwen2 runs with NEOX RoPE in llama.cpp: its q/k weights, and so lora_B of q/k, keep
    HF's row order (the Llama model above had them permuted); greedy output with a q/k/v
    adapter equals transformers with it merged."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(0)
    model_dir = tmp_path / "qwen2"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    path = write_gguf(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                      tmp_path / "tiny-qwen2.gguf")
    save_lora(model_dir, tmp_path / "adapters" / "qk", seed=4,
              targets=["q_proj", "k_proj", "v_proj"], rank=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(weights_cache, "cached_model_dir", lambda gguf, *a, **k: model_dir)
        qwen = LLMEngine(EngineConfig(
            model=str(path), runner="llamacpp", max_model_len=256, kv_cache_memory=4 << 20,
            max_num_seqs=4, threads=1, adapter_cache=str(tmp_path / "adapters"),
            max_loras=1, max_lora_rank=8))
    with torch.inference_mode():
        merged = merged_model(model_dir, tmp_path / "adapters" / "qk")
        want = [hf_greedy(merged, p, MAX_NEW) for p in ids[:2]]
    out = run(qwen, [(f"q{i}", p, "qk") for i, p in enumerate(ids[:2])])
    assert [out["q0"], out["q1"]] == want


def gguf_of(cache: Path, src: str, engine: LLMEngine, path: Path,
            dtype: type = np.float32) -> Path:
    return gguf_lora_of(cache, src, engine.runner.adapters.base, path, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_a_gguf_adapter_is_loaded_as_it_is_and_gives_the_tokens_of_its_peft_files(
        engine, cache, ids, merged_greedy, dtype):
    registry = engine.adapters
    assert registry is not None
    name = f"a1-gguf-{np.dtype(dtype).name}"
    gguf_of(cache, "a1", engine, cache / name / "ggml-lora.gguf", dtype)

    def no_conversion(*args, **kwargs):
        raise AssertionError("a GGUF adapter was converted")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llamacpp_lora, "adapter_tensors", no_conversion)
        registry.acquire(name).release()
    out = run(engine, [(f"g{i}", p, name) for i, p in enumerate(ids)])
    assert [out[f"g{i}"] for i in range(len(ids))] == merged_greedy["a1"]
    listed = next(a for a in registry.resident() if a.adapter_id == name)
    assert (listed.rank, listed.target_modules) == (4, ["attn_q", "attn_v", "ffn_down"])


def test_a_directory_with_peft_files_and_a_gguf_runs_the_gguf_on_llama_cpp(
        engine, cache, ids, merged_greedy):
    shutil.copytree(cache / "a2", cache / "both")  # PEFT files of a2, the GGUF of a1
    gguf_of(cache, "a1", engine, cache / "both" / "a1.gguf")
    assert run(engine, [("both", ids[0], "both")])["both"] == merged_greedy["a1"][0]


def pair(base: str = "blk.0.attn_q.weight", rank: int = 4, n_in: int = 64, n_out: int = 64,
         rank_b: int | None = None) -> dict[str, np.ndarray]:
    """One LoRA pair in numpy order (lora_a [r, in], lora_b [out, r])."""
    return {f"{base}.lora_a": np.full((rank, n_in), 0.01, np.float32),
            f"{base}.lora_b": np.full((n_out, rank_b or rank), 0.01, np.float32)}


def _gguf_two(d: Path) -> None:
    write_gguf_lora(d / "x.gguf", pair())
    write_gguf_lora(d / "y.gguf", pair())


def _junk(d: Path) -> None:
    d.mkdir()
    (d / "x.gguf").write_bytes(b"GGUF junk")


def _write(**kw):
    tensors = kw.pop("tensors", None)
    return lambda d: write_gguf_lora(d / "x.gguf", pair() if tensors is None else tensors, **kw)


GGUF_BAD = [  # (how to write the adapter's directory, what the reason says)
    (_write(general_type="model"),
     "x.gguf is not a LoRA adapter GGUF (general.type is 'model', not 'adapter')"),
    (_write(adapter_type="control_vector"),
     "x.gguf: adapter.type 'control_vector' is not supported (only 'lora')"),
    (_write(arch="qwen2"),
     "x.gguf is an adapter of a qwen2 model, not of this llama model (general.architecture)"),
    (_write(tensors=pair(n_in=32)), "tensor 'blk.0.attn_q.weight': lora_a [32, 4] / lora_b "
     "[4, 64] do not fit the model's [64, 64] (ggml order)"),
    (_write(tensors=pair("blk.7.attn_q.weight")),
     "tensor 'blk.7.attn_q.weight' is not in this llama model (2 layers)"),
    (_write(tensors=pair(rank=16)),
     "rank 16 (blk.0.attn_q.weight) exceeds the server's limit 8 (--max-lora-rank)"),
    (_write(tensors={"blk.0.attn_q.weight.lora_a": np.ones((4, 64), np.float32)}),
     "x.gguf: blk.0.attn_q.weight.lora_a has no pair"),
    (_write(tensors=pair(rank_b=2)), "lora_a [64, 4] and lora_b [2, 64] do not share a rank"),
    (_write(tensors={"blk.0.attn_q.weight": np.ones((64, 64), np.float32)}),
     "x.gguf: tensor 'blk.0.attn_q.weight' is not a LoRA tensor"),
    (_write(alpha=None, extra={"adapter.lora.alpha": (8, gguf.GGUFValueType.UINT32, None)}),
     "x.gguf: metadata adapter.lora.alpha is not a float32"),
    (_write(extra={"adapter.alora.invocation_tokens": ([1, 2], gguf.GGUFValueType.ARRAY,
                                                     gguf.GGUFValueType.UINT32)}),
     "x.gguf: aLoRA (adapter.alora.invocation_tokens) is not supported"),
    (_write(tensors={**pair(), "blk.0.attn_q.weight.lora_a": np.ones((4, 64), np.int32)}),
     "x.gguf: tensor 'blk.0.attn_q.weight.lora_a' is of type I32 (LoRA tensors are F32, F16, "
     "BF16, Q8_0)"),
    (_junk, "x.gguf is not a readable GGUF file"),
    (_gguf_two, "2 GGUF files (x.gguf, y.gguf): an adapter directory holds one"),
]


@pytest.mark.parametrize(("make", "reason"), GGUF_BAD, ids=[r for _, r in GGUF_BAD])
def test_a_gguf_adapter_that_is_not_a_lora_of_this_model_is_refused_naming_why(
        engine, cache, ids, merged_greedy, make, reason):
    name = f"bad-gguf-{GGUF_BAD.index((make, reason))}"
    make(cache / name)
    assert engine.adapters is not None
    with pytest.raises(AdapterError) as e:
        engine.adapters.acquire(name)
    assert str(e.value).startswith(f"adapter {name!r}: ") and reason in str(e.value)
    assert name not in [a.adapter_id for a in engine.adapters.resident()]
    assert run(engine, [("after", ids[0], "a1")])["after"] == merged_greedy["a1"][0]
