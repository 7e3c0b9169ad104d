"""The adapter registry: PEFT LoRA adapters by id, checked against the model, loaded once
on first use (also under concurrent first uses), leased per request, LRU-evicted only when
unleased; with every slot leased a request waits in line for one (first come first served,
bounded, cancellable); every bad adapter is an ``AdapterError`` naming the id and the
reason, and a failed load leaves nothing behind."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from concurrent.futures import CancelledError
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.adapters import (
    AdapterError,
    AdapterLease,
    AdapterRegistry,
    AdapterSlotsFull,
    LoraAdapter,
    check_adapter_id,
)
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, EngineDeadError, QueueFullError
from engine.runners.torch.lora import LoraLayers
from tests.lora_adapters import gguf_lora_of, tiny_llama_base, write_gguf_lora


class FitRunner:
    """A runner's adapter side over the tiny model's real LoRA layers, counting loads."""

    name = "torch"
    prefers_gguf_adapters = False

    def __init__(self, model_dir: Path, max_loras: int, delay_s: float = 0.0) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.max_loras = max_loras
        self.lora = LoraLayers(model, max_loras, 8, torch.device("cpu"), torch.float32)
        self.delay_s = delay_s
        self.loads: list[tuple[int, str]] = []

    def check_adapter(self, adapter: LoraAdapter) -> None:
        self.lora.check(1, adapter)

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
             delay_s: float = 0.0, wait_s: float = 0.0) -> AdapterRegistry:
    return AdapterRegistry(cache, max_loras, max_rank, FitRunner(model_dir, max_loras, delay_s),
                           wait_s)


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
        reg.acquire("a1")  # a2 is leased: not evicted under a running request (no wait)
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


def test_once_the_runner_holds_an_adapter_the_registry_keeps_no_copy_of_its_weights(
        cache, tiny_model_dir):
    from engine.adapters import read_adapter

    reg = registry(cache, tiny_model_dir)
    lease = reg.acquire("a1")
    assert lease.resident.adapter.weights == {}
    assert lease.fingerprint == read_adapter(cache, "a1", 8).fingerprint  # prefix-cache key
    q = reg.runner.lora.stacks["model.layers.0.self_attn.q_proj"]  # type: ignore[attr-defined]
    assert q.b[:4].abs().sum() > 0  # slot 1 holds a1's q_proj


@pytest.mark.parametrize("src", ["a1", "a2"])
def test_the_torch_runner_reads_a_gguf_adapter_into_the_weights_of_its_peft_files(
        cache, tiny_model_dir, src):
    """a1 adapts q_proj and a2 k_proj (lora_b rows permuted in the GGUF, un-permuted on
    reading), a2 with rsLoRA (its scaling as the GGUF's alpha); a directory with both
    formats is read from its PEFT files."""
    from engine.adapters import read_adapter

    gguf_lora_of(cache, src, tiny_llama_base(), cache / "gguf" / f"{src}.gguf")
    shutil.copytree(cache / "a1", cache / "both")
    write_gguf_lora(cache / "both" / "x.gguf", {})  # not even read
    reg = registry(cache, tiny_model_dir)
    peft, gguf = reg.acquire(src), reg.acquire("gguf")
    assert (peft.slot, gguf.slot) == (1, 2)
    for name, stack in reg.runner.lora.stacks.items():  # type: ignore[attr-defined]
        torch.testing.assert_close(stack.a[:, 8:], stack.a[:, :8], msg=name)
        torch.testing.assert_close(stack.b[8:], stack.b[:8], msg=name)
    assert any(stack.b[8:].abs().sum() > 0 for stack in reg.runner.lora.stacks.values())  # type: ignore[attr-defined]
    peft.release()
    lease = reg.acquire("both")
    assert lease.resident.adapter.gguf is None
    assert lease.fingerprint == read_adapter(cache, "a1", 8).fingerprint


@pytest.mark.parametrize(("base", "arch", "reason"), [
    ("blk.0.attn_q.weight", "qwen2",
     "x.gguf is an adapter of a qwen2 model, not of this llama model (general.architecture)"),
    ("output.weight", "llama", "x.gguf: tensor 'output.weight' is no linear layer of this "
                               "model (the torch runner adapts no LM head or embeddings)"),
])
def test_a_gguf_adapter_the_torch_runner_cannot_run_is_refused_naming_why(
        cache, tiny_model_dir, base, arch, reason):
    write_gguf_lora(cache / "x" / "x.gguf", {f"{base}.lora_a": np.ones((4, 64), np.float32),
                                             f"{base}.lora_b": np.ones((64, 4), np.float32)},
                    arch=arch)
    reg = registry(cache, tiny_model_dir)
    with pytest.raises(AdapterError) as e:
        reg.acquire("x")
    assert str(e.value) == f"adapter 'x': {reason}"
    assert reg.resident() == []


@pytest.mark.parametrize(("arch", "permuted"), [("llama", True), ("qwen2", False)])
def test_reading_a_gguf_adapter_back_gives_its_peft_weights_with_or_without_rope_permutation(
        cache, arch, permuted):
    from engine.adapters import read_adapter
    from engine.runners.llamacpp_lora import BaseModel
    from engine.runners.torch.gguf_lora import gguf_as_peft

    config = SimpleNamespace(model_type=arch, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2)
    base = BaseModel(arch, 2, 4, 2, permuted)
    for src in ("a1", "a2"):  # q_proj, k_proj
        peft = read_adapter(cache, src, 8)
        gguf_lora_of(cache, src, base, cache / f"{src}-{arch}" / "x.gguf")
        back = gguf_as_peft(read_adapter(cache, f"{src}-{arch}", 8), config, peft.weights)
        assert sorted(back.weights) == sorted(peft.weights)
        for module, w in peft.weights.items():
            torch.testing.assert_close(back.weights[module].a, w.a, msg=module)
            torch.testing.assert_close(back.weights[module].b, w.b, msg=module)


def test_gguf_adapters_of_architectures_whose_layout_is_not_known_are_refused_on_torch(
        cache, tiny_model_dir):
    from engine.adapters import read_adapter
    from engine.runners.torch.gguf_lora import gguf_as_peft

    gguf_lora_of(cache, "a1", tiny_llama_base(), cache / "g" / "a1.gguf")
    config = SimpleNamespace(model_type="gemma", num_hidden_layers=2)
    with pytest.raises(AdapterError, match=r"GGUF LoRA adapters are read on the torch runner "
                                           r"for llama, qwen2 models only, not 'gemma'"):
        gguf_as_peft(read_adapter(cache, "g", 8), config, ["model.layers.0.self_attn.q_proj"])


def wait_until(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


class Acquiring(threading.Thread):
    """``reg.acquire(adapter_id, cancel)`` in a thread; its lease or error kept."""

    def __init__(self, reg: AdapterRegistry, adapter_id: str,
                 cancel: threading.Event | None = None) -> None:
        super().__init__(daemon=True)
        self.reg, self.adapter_id, self.cancel = reg, adapter_id, cancel
        self.result: AdapterLease | BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.reg.acquire(self.adapter_id, self.cancel)
        except BaseException as e:
            self.result = e


def holders(reg: AdapterRegistry) -> list[tuple[str, int]]:
    return [(a.adapter_id, a.active_requests) for a in reg.resident()]


def test_a_request_for_another_adapter_waits_for_a_slot_and_gets_the_first_one_freed(
        cache, tiny_model_dir):
    reg = registry(cache, tiny_model_dir, max_loras=1, wait_s=30)
    held = reg.acquire("a1")
    waiter = Acquiring(reg, "a2")
    assert wait_until(lambda: reg.waiting == 1)
    time.sleep(0.1)
    assert waiter.is_alive() and holders(reg) == [("a1", 1)]  # a1 is not evicted under it
    released = time.monotonic()
    held.release()
    waiter.join(10)
    assert isinstance(waiter.result, AdapterLease) and waiter.result.slot == 1
    assert time.monotonic() - released < 5
    assert holders(reg) == [("a2", 1)] and reg.waiting == 0


def test_waiters_for_different_adapters_get_slots_first_come_first_served(cache,
                                                                           tiny_model_dir):
    shutil.copytree(cache / "a1", cache / "a3")
    reg = registry(cache, tiny_model_dir, max_loras=1, wait_s=30)
    held = reg.acquire("a1")
    first = Acquiring(reg, "a2")
    assert wait_until(lambda: reg.waiting == 1)
    second = Acquiring(reg, "a3")
    assert wait_until(lambda: reg.waiting == 2)
    held.release()
    # a1, now held by no one, is the first waiter's to evict: not leased again meanwhile
    assert reg.lease_resident("a1") is None
    first.join(10)
    assert isinstance(first.result, AdapterLease) and first.result.adapter_id == "a2"
    time.sleep(0.1)
    assert second.is_alive() and reg.waiting == 1  # a2 is held: the second still waits
    first.result.release()
    second.join(10)
    assert isinstance(second.result, AdapterLease) and second.result.adapter_id == "a3"
    assert reg.runner.loads == [(1, "a1"), (1, "a2"), (1, "a3")]  # type: ignore[attr-defined]


def test_a_newcomer_queues_behind_a_waiter_rather_than_taking_the_slot_freed_for_it(
        cache, tiny_model_dir):
    shutil.copytree(cache / "a1", cache / "a3")
    reg = registry(cache, tiny_model_dir, max_loras=1, wait_s=1.5)
    held = reg.acquire("a1")
    first = Acquiring(reg, "a2")
    assert wait_until(lambda: reg.waiting == 1)
    held.release()
    with pytest.raises(AdapterSlotsFull, match="adapter 'a3'"):
        reg.acquire("a3")  # here at once, but second in line: the slot goes to a2
    first.join(5)
    assert isinstance(first.result, AdapterLease) and holders(reg) == [("a2", 1)]


def test_a_wait_that_runs_out_is_slots_full_naming_the_adapter_and_the_wait(cache,
                                                                          tiny_model_dir):
    reg = registry(cache, tiny_model_dir, max_loras=1, wait_s=0.3)
    held = reg.acquire("a1")
    start = time.monotonic()
    with pytest.raises(AdapterSlotsFull) as e:
        reg.acquire("a2")
    assert time.monotonic() - start >= 0.3
    assert "adapter 'a2'" in str(e.value) and "0.3 s (--max-lora-wait-s)" in str(e.value)
    assert "--max-loras" in str(e.value)
    assert reg.waiting == 0 and holders(reg) == [("a1", 1)]
    held.release()
    assert reg.acquire("a2").slot == 1  # the slot is free for the next request


def test_a_cancelled_wait_ends_at_once_and_holds_no_slot(cache, tiny_model_dir):
    reg = registry(cache, tiny_model_dir, max_loras=1, wait_s=30)
    held = reg.acquire("a1")
    cancel = threading.Event()
    waiter = Acquiring(reg, "a2", cancel)
    assert wait_until(lambda: reg.waiting == 1)
    reg.stop_waiting(cancel)
    waiter.join(5)
    assert not waiter.is_alive() and isinstance(waiter.result, CancelledError)
    assert reg.waiting == 0
    held.release()
    assert holders(reg) == [("a1", 0)]  # a2 never loaded, nothing leased
    assert reg.runner.loads == [(1, "a1")]  # type: ignore[attr-defined]


def test_a_load_finishing_after_its_caller_cancelled_releases_its_lease(cache,
                                                                       tiny_model_dir):
    reg = registry(cache, tiny_model_dir, delay_s=0.3)
    cancel = threading.Event()
    loader = Acquiring(reg, "a1", cancel)
    assert wait_until(lambda: "a1" in reg._loading)
    reg.stop_waiting(cancel)
    loader.join(5)
    assert isinstance(loader.result, CancelledError)
    assert holders(reg) == [("a1", 0)]  # loaded (the work is kept), but not leased


def async_engine_over(reg: AdapterRegistry, **config_kw) -> AsyncEngine:
    """An AsyncEngine whose engine is only the registry (lease_adapter needs no more)."""
    stand_in = SimpleNamespace(adapters=reg, tokenizer=None, info=None,
                               config=EngineConfig(model="unused", **config_kw))
    return AsyncEngine(stand_in)  # type: ignore[arg-type]


async def waiters(reg, n: int) -> None:
    """Until ``n`` requests wait in line for a slot (at most 5 s)."""
    for _ in range(500):
        if reg.waiting >= n:
            return
        await asyncio.sleep(0.01)


def test_a_cancelled_lease_adapter_call_leaves_no_lease_and_no_waiting_thread(
        cache, tiny_model_dir):
    reg = registry(cache, tiny_model_dir, max_loras=1, wait_s=30)
    engine = async_engine_over(reg)

    def acquiring_threads() -> int:
        return sum(t.name == "genserve-acquire" for t in threading.enumerate())

    async def main() -> None:
        held = await engine.lease_adapter("a1")
        assert held is not None
        task = asyncio.create_task(engine.lease_adapter("a2"))
        await waiters(reg, 1)
        assert reg.waiting == 1 and engine._leasing == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine._leasing == 0
        held.release()

    asyncio.run(main())
    assert wait_until(lambda: acquiring_threads() == 0, 5)
    assert reg.waiting == 0 and holders(reg) == [("a1", 0)]


def test_abort_all_ends_waits_for_a_slot_as_shutting_down_leaving_nothing_held(
        cache, tiny_model_dir):
    reg = registry(cache, tiny_model_dir, max_loras=1, wait_s=30)
    engine = async_engine_over(reg)

    async def main() -> None:
        held = await engine.lease_adapter("a1")
        assert held is not None
        task = asyncio.create_task(engine.lease_adapter("a2"))
        await waiters(reg, 1)
        engine.abort_all()  # a drain's grace runs out
        with pytest.raises(EngineDeadError, match="shutting down.*'a2'"):
            await asyncio.wait_for(task, 5)
        held.release()

    asyncio.run(main())
    assert reg.waiting == 0 and holders(reg) == [("a1", 0)]


FAULTS = [b for b in BAD if callable(b[0])]  # in its files, or not fitting the model


@pytest.mark.parametrize(("make", "reason"), FAULTS, ids=[r for _, r in FAULTS])
def test_a_broken_or_misfit_adapter_arriving_while_every_slot_is_held_is_refused_at_once(
        cache, tiny_model_dir, make, reason):
    reg = registry(cache, tiny_model_dir, max_loras=1, wait_s=30)
    held = reg.acquire("a1")
    start = time.monotonic()
    with pytest.raises(AdapterError) as e:
        reg.acquire(make(cache))
    assert reason in str(e.value)
    assert time.monotonic() - start < 5  # not after the 30 s wait for a slot
    assert reg.waiting == 0 and holders(reg) == [("a1", 1)]
    held.release()


def test_an_adapter_checked_before_its_wait_holds_no_weights_while_it_waits(
        cache, tiny_model_dir, monkeypatch):
    """Its files are read to check them, then dropped (many waiters holding a big model's
    adapters would hold gigabytes), and read again once a slot frees."""
    import engine.adapters as adapters

    reads: list[str] = []
    read = adapters.read_adapter
    monkeypatch.setattr(adapters, "read_adapter",
                        lambda root, aid, *a: reads.append(aid) or read(root, aid, *a))
    reg = registry(cache, tiny_model_dir, max_loras=1, wait_s=30)
    held = reg.acquire("a1")
    waiter = Acquiring(reg, "a2")
    assert wait_until(lambda: reg.waiting == 1)
    assert reads == ["a1", "a2"]  # a2 checked before it waits
    held.release()
    waiter.join(10)
    assert isinstance(waiter.result, AdapterLease) and waiter.result.adapter_id == "a2"
    assert reads == ["a1", "a2", "a2"]
    assert reg.runner.loads == [(1, "a1"), (1, "a2")]  # type: ignore[attr-defined]


def test_an_engine_loop_crash_ends_waits_for_a_slot_as_engine_stopped(cache, tiny_model_dir):
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), adapter_cache=str(cache),
                                    max_loras=1, max_lora_wait_s=60))
    step = engine.step
    crash = threading.Event()

    def stepping():
        if crash.is_set():
            raise RuntimeError("boom")
        return step()

    engine.step = stepping  # type: ignore[method-assign]

    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        running = asyncio.create_task(ae.complete(
            "held", [5, 6, 7], SamplingParams(max_new_tokens=400, min_new_tokens=400),
            adapter_id="a1"))
        reg = engine.adapters
        assert reg is not None
        for _ in range(500):
            if holders(reg) == [("a1", 1)]:
                break
            await asyncio.sleep(0.01)
        waiting = asyncio.create_task(ae.lease_adapter("a2"))
        await waiters(reg, 1)
        start = time.monotonic()
        crash.set()
        with pytest.raises(EngineDeadError, match="engine stopped.*boom.*'a2'"):
            await asyncio.wait_for(waiting, 10)
        assert time.monotonic() - start < 5  # not the 60 s slot wait
        with pytest.raises(EngineDeadError):
            await running
        with pytest.raises(EngineDeadError, match="engine stopped"):  # no new load either
            await ae.lease_adapter("a2")
        assert reg.waiting == 0 and reg.runner.max_loras == 1
        await ae.shutdown()

    asyncio.run(main())


def test_requests_waiting_for_a_slot_count_against_the_waiting_queue_bound(cache,
                                                                          tiny_model_dir):
    reg = registry(cache, tiny_model_dir, max_loras=1, wait_s=30)
    engine = async_engine_over(reg, max_num_seqs=1, max_waiting=1)  # one seat, one waiting

    async def main() -> None:
        held = await engine.lease_adapter("a1")
        assert held is not None
        engine.check_queue()
        waits = [asyncio.create_task(engine.lease_adapter("a2")) for _ in range(2)]
        await waiters(reg, 2)
        with pytest.raises(QueueFullError):  # a seat and the one waiting place are spoken for
            engine.check_queue()
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        engine.check_queue()
        held.release()

    asyncio.run(main())
