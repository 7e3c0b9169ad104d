"""The adapter registry: PEFT LoRA adapters by id, checked against the model, loaded once
on first use (also under concurrent first uses), leased per request, LRU-evicted only when
unleased; every bad adapter is an ``AdapterError`` naming the id and the reason, and a
failed load leaves nothing behind."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.adapters import (
    AdapterError,
    AdapterRegistry,
    AdapterSlotsFull,
    LoraAdapter,
    check_adapter_id,
)
from engine.runners.torch.lora import LoraLayers


class FitRunner:
    """A runner's adapter side over the tiny model's real LoRA layers, counting loads."""

    name = "torch"

    def __init__(self, model_dir: Path, max_loras: int, delay_s: float = 0.0) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.max_loras = max_loras
        self.lora = LoraLayers(model, max_loras, 8, torch.device("cpu"), torch.float32)
        self.delay_s = delay_s
        self.loads: list[tuple[int, str]] = []

    def load_adapter(self, slot: int, adapter: LoraAdapter) -> None:
        time.sleep(self.delay_s)
        self.lora.load(slot, adapter)
        self.loads.append((slot, adapter.adapter_id))


@pytest.fixture
def cache(tmp_path, lora_cache) -> Path:
    """A private copy of the adapter cache, for tests that add broken adapters to it."""
    root = tmp_path / "cache"
    shutil.copytree(lora_cache, root)
    return root


def registry(cache: Path, model_dir: Path, max_loras: int = 2, max_rank: int = 8,
             delay_s: float = 0.0) -> AdapterRegistry:
    return AdapterRegistry(cache, max_loras, max_rank, FitRunner(model_dir, max_loras, delay_s))


def broken(cache: Path, name: str, *, config: dict | None = None,
           tensors=None) -> str:
    """A copy of a1 named ``name`` with its config updated by ``config`` and its tensors
    replaced by ``tensors(old) -> new``."""
    d = cache / name
    shutil.copytree(cache / "a1", d)
    if config is not None:
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg.update(config)
        (d / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        path = str(d / "adapter_model.safetensors")
        save_file(tensors(load_file(path)), path)
    return name


def _rename(old: str, new: str):
    return lambda ts: {k.replace(old, new): v for k, v in ts.items()}


def _widen_first_a(ts):
    key = next(k for k in sorted(ts) if k.endswith("lora_A.weight"))
    ts[key] = torch.zeros(ts[key].shape[0], ts[key].shape[1] + 1)
    return ts


BAD = [  # (id or how to make it, what the reason says)
    ("nope", "unknown adapter"),
    ("../a1", "not a valid adapter id"),
    ("/etc", "not a valid adapter id"),
    (".hidden", "not a valid adapter id"),
    (lambda c: (c / "no-weights").mkdir() or "no-weights", "cannot read adapter_config.json"),
    (lambda c: (shutil.copytree(c / "a1", c / "junk"),
                (c / "junk" / "adapter_model.safetensors").write_bytes(b"junk"))
     and "junk", "not a readable safetensors file"),
    (lambda c: broken(c, "prefix", config={"peft_type": "PREFIX_TUNING"}),
     "unsupported PEFT type 'PREFIX_TUNING'"),
    (lambda c: broken(c, "dora", config={"use_dora": True}), "DoRA (use_dora) is not supported"),
    (lambda c: broken(c, "big-rank", config={"r": 64}), "rank 64 exceeds the server's limit 8"),
    (lambda c: broken(c, "no-module", config={"target_modules": ["c_attn"]},
                      tensors=_rename("q_proj", "c_attn")),
     "target module 'c_attn': the model has no linear layer of that name"),
    (lambda c: broken(c, "misfit", tensors=_widen_first_a), "do not fit the layer (128 -> 64)"),
]


@pytest.mark.parametrize(("make", "reason"), BAD, ids=[r for _, r in BAD])
def test_a_bad_adapter_is_refused_naming_it_and_nothing_stays_cached(cache, tiny_model_dir,
                                                                     make, reason):
    reg = registry(cache, tiny_model_dir)
    adapter_id = make(cache) if callable(make) else make
    with pytest.raises(AdapterError) as e:
        reg.acquire(adapter_id)
    assert reason in str(e.value) and e.value.limit == "adapter"
    assert f"adapter {adapter_id!r}" in str(e.value)
    assert reg.resident() == []
    good = reg.acquire("a1")  # every slot is still free for a good adapter
    assert good.slot == 1 and [a.adapter_id for a in reg.resident()] == ["a1"]


def test_adapter_ids_are_single_safe_path_components():
    for bad in ("", "a/b", "a\\b", "..", "x" * 200, "a\x00"):
        with pytest.raises(AdapterError, match="not a valid adapter id"):
            check_adapter_id(bad)
    check_adapter_id("org_model-v1.2")


def test_least_recently_used_unleased_adapter_is_evicted_and_reloads(cache, tiny_model_dir):
    reg = registry(cache, tiny_model_dir, max_loras=1)
    loads = reg.runner.loads  # type: ignore[attr-defined]
    reg.acquire("a1").release()
    again = reg.acquire("a1")  # resident: no second load
    again.release()
    again.release()  # idempotent
    assert loads == [(1, "a1")]
    lease = reg.acquire("a2")  # the one slot is reused: a1 evicted
    assert [a.adapter_id for a in reg.resident()] == ["a2"] and lease.slot == 1
    with pytest.raises(AdapterSlotsFull, match="--max-loras"):
        reg.acquire("a1")  # a2 is leased: it is not evicted under a running request
    lease.release()
    reg.acquire("a1")
    assert loads == [(1, "a1"), (1, "a2"), (1, "a1")]
    assert [(a.adapter_id, a.active_requests) for a in reg.resident()] == [("a1", 1)]


def test_concurrent_first_uses_load_once(cache, tiny_model_dir):
    reg = registry(cache, tiny_model_dir, delay_s=0.3)
    results: list = []

    def use(adapter_id: str) -> None:
        try:
            results.append(reg.acquire(adapter_id))
        except AdapterError as e:
            results.append(e)

    threads = [threading.Thread(target=use, args=(a,)) for a in ["a1"] * 4 + ["nope"] * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    leases = [r for r in results if not isinstance(r, AdapterError)]
    assert reg.runner.loads == [(1, "a1")]  # type: ignore[attr-defined]
    assert len(leases) == 4 and {lease.slot for lease in leases} == {1}
    assert [(a.adapter_id, a.active_requests) for a in reg.resident()] == [("a1", 4)]
    assert sum(isinstance(r, AdapterError) for r in results) == 2


def test_adapter_config_scaling_is_folded_into_b(cache, tiny_model_dir):
    from engine.adapters import read_adapter

    a1, a2 = read_adapter(cache, "a1", 8), read_adapter(cache, "a2", 8)
    assert a1.scaling == 2.0  # lora_alpha / r
    assert a2.scaling == pytest.approx(16 / 8 ** 0.5)  # rslora: lora_alpha / sqrt(r)
    raw = load_file(str(cache / "a1" / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert torch.equal(a1.weights["model.layers.0.self_attn.q_proj"].b, raw[key] * 2.0)
