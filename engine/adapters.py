"""LoRA adapters by id: read from ``--adapter-cache``, checked, kept in an LRU of slots.

An adapter id names a sub-directory of the adapter cache holding a PEFT LoRA adapter
(``adapter_config.json`` + ``adapter_model.safetensors``), as vllm-tgis-adapter finds them,
or a llama.cpp GGUF LoRA file (one ``*.gguf``: ``engine/gguf_adapter.py``). A directory
with both is read as the runner prefers (``prefers_gguf_adapters``): the GGUF on llama.cpp
(loaded with no conversion), the PEFT files on torch (which would read the GGUF back into
PEFT's layout).
The first request naming an id loads it (``AdapterRegistry.acquire``, called off the
engine thread): the files are read and checked here, then the runner copies the weights
into one of its ``max_loras`` adapter slots (``Runner.load_adapter``), which checks them
against the model. Concurrent first uses of one id wait for the one load. Every request
holds a lease on its adapter until it finishes, so a slot is only reused (least recently
used first) once no request runs on it; a load that fails leaves nothing cached. When
every slot is leased, a request for another adapter waits in line for a slot (first come
first served, at most ``wait_s``), as vLLM keeps a request whose LoRA cannot be scheduled
waiting; its files are read and checked before it waits (and read again once it has a
slot), so a broken adapter is refused at once rather than after the wait.

Anything wrong with an adapter is the caller's problem: ``AdapterError`` (a
``RequestError``, INVALID_ARGUMENT on the wire) names the id and the reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from engine.config import QueueFullError, RequestError

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_ID_LEN = 128
_SAFE_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
# PEFT saves "base_model.model.<module>.lora_A.weight" (the adapter name stripped)
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight")
# adapter_config.json settings that change the math beyond W + s * B A: refused if set
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)", "modules_to_save": "modules_to_save",
    "fan_in_fan_out": "fan_in_fan_out", "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "layer_replication", "lora_bias": "lora_bias",
    "use_qalora": "QA-LoRA (use_qalora)", "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters", "alora_invocation_tokens": "aLoRA",
    "use_bdlora": "use_bdlora",
}


class AdapterError(RequestError):
    """An adapter that cannot be served: unknown, unreadable, or not fitting the model."""

    def __init__(self, adapter_id: str, reason: str) -> None:
        super().__init__("adapter", f"adapter {adapter_id!r}: {reason}")
        self.adapter_id = adapter_id
        self.reason = reason


class AdapterSlotsFull(QueueFullError):
    """No adapter slot came free within the wait (every one held by running requests):
    retry later."""


@dataclass
class LoraWeights:
    """One target module's LoRA: ``y += x @ a.T @ b.T`` (``b`` already scaled)."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r], times alpha / r (alpha / sqrt(r) with rslora)


@dataclass(frozen=True)
class GgufLora:
    """An adapter given as a llama.cpp GGUF LoRA file, which the runner loads itself."""

    file: Path
    architecture: str  # general.architecture: must be the model's
    # base tensor ("blk.0.attn_q.weight") -> ggml shapes (ne order) of lora_a and lora_b,
    # for checking them against the model before a load
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)


@dataclass
class LoraAdapter:
    adapter_id: str
    path: Path  # the adapter's directory (a runner may read the files itself)
    rank: int  # the highest of its modules' ranks
    alpha: float
    scaling: float
    target_modules: list[str]  # as adapter_config.json names them (GGUF: "attn_q", ...)
    # by module name in the model, "model.layers.0.mlp.up_proj": the PEFT weights until a
    # runner has copied them (the registry then drops them); empty for a GGUF adapter
    weights: dict[str, LoraWeights]
    fingerprint: bytes  # of the files: prefix-cache blocks are keyed by it
    load_seconds: float = 0.0
    gguf: GgufLora | None = None  # set: a GGUF LoRA file, ``weights`` empty


def check_adapter_id(adapter_id: str) -> None:
    """An id names one sub-directory: no path separators, no '..', nothing hidden."""
    if not adapter_id or len(adapter_id) > MAX_ID_LEN or not _SAFE_ID.fullmatch(adapter_id) \
            or ".." in adapter_id:
        raise AdapterError(adapter_id[:MAX_ID_LEN], f"not a valid adapter id (letters, digits, "
                           f"'.', '_', '-'; at most {MAX_ID_LEN} characters; no '/' or '..')")


def read_adapter(root: Path, adapter_id: str, max_rank: int,
                 prefer_gguf: bool = False) -> LoraAdapter:
    """The adapter ``adapter_id`` under ``root``, checked in itself (not yet against a
    model): ``AdapterError`` naming what is wrong. Its GGUF file when it has one and
    ``prefer_gguf`` or it has no PEFT config, else its PEFT files."""
    check_adapter_id(adapter_id)
    start = time.perf_counter()
    path = root / adapter_id
    if not path.is_dir():
        raise AdapterError(adapter_id, f"unknown adapter (no directory {adapter_id!r} in the "
                           f"adapter cache)")
    ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if ggufs and (prefer_gguf or not (path / CONFIG_FILE).exists()):
        if len(ggufs) > 1:
            raise AdapterError(adapter_id, f"{len(ggufs)} GGUF files "
                               f"({', '.join(p.name for p in ggufs)}): an adapter directory "
                               f"holds one")
        from engine.gguf_adapter import read_gguf_adapter

        adapter = read_gguf_adapter(adapter_id, ggufs[0], max_rank)
    else:
        adapter = _read_peft(adapter_id, path, max_rank)
    adapter.load_seconds = time.perf_counter() - start
    return adapter


def _read_peft(adapter_id: str, path: Path, max_rank: int) -> LoraAdapter:
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    try:
        config_bytes = (path / CONFIG_FILE).read_bytes()
        weight_bytes = (path / WEIGHTS_FILE).read_bytes()
    except OSError as e:
        raise AdapterError(adapter_id, f"cannot read {Path(e.filename or '').name or 'its files'}"
                           f": {e.strerror or e}") from None
    try:
        config = json.loads(config_bytes)
    except ValueError as e:
        raise AdapterError(adapter_id, f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(adapter_id, f"{CONFIG_FILE} is not a JSON object")
    rank, alpha = _check_config(adapter_id, config, max_rank)
    try:
        tensors = load_safetensors(weight_bytes)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise AdapterError(adapter_id, f"{WEIGHTS_FILE} is not a readable safetensors file: "
                           f"{e}") from None
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = _lora_weights(adapter_id, tensors, rank, scaling)
    targets = config.get("target_modules") or []
    fingerprint = hashlib.blake2b(config_bytes + weight_bytes, digest_size=16).digest()
    return LoraAdapter(adapter_id, path, rank, alpha, scaling,
                       [targets] if isinstance(targets, str) else sorted(targets), weights,
                       fingerprint)


def _check_config(adapter_id: str, config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise AdapterError(adapter_id, f"unsupported PEFT type {peft_type!r} (only LORA)")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise AdapterError(adapter_id, f"{what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(adapter_id, f"bias={config['bias']!r} is not supported (only 'none')")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(adapter_id, f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(adapter_id, f"rank {rank} exceeds the server's limit "
                           f"{max_rank} (--max-lora-rank)")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(adapter_id, f"lora_alpha must be a number, got {alpha!r}")
    return rank, float(alpha)


def _lora_weights(adapter_id: str, tensors: dict[str, torch.Tensor], rank: int,
                  scaling: float) -> dict[str, LoraWeights]:
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise AdapterError(adapter_id, f"unsupported tensor {key!r} in {WEIGHTS_FILE} (only "
                               f"LoRA A/B weights of linear layers)")
        pairs.setdefault(m["module"], {})[m["ab"]] = t
    if not pairs:
        raise AdapterError(adapter_id, f"{WEIGHTS_FILE} holds no LoRA weights")
    out: dict[str, LoraWeights] = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(adapter_id, f"module {module!r} has lora_{set(ab).pop()} "
                               f"without its pair")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(adapter_id, f"module {module!r}: lora_A {list(a.shape)} and "
                               f"lora_B {list(b.shape)} do not have rank r={rank}")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterError(adapter_id, f"module {module!r}: weights are not floating point")
        out[module] = LoraWeights(a.float(), b.float() * scaling)
    return out


class AdapterRunner(Protocol):
    """What the registry needs of a runner (engine.runners.base.Runner has it)."""

    name: str
    max_loras: int  # adapter slots 1..max_loras (0: this runner serves no adapters)
    prefers_gguf_adapters: bool  # a GGUF LoRA file rather than PEFT files beside it

    def check_adapter(self, adapter: LoraAdapter) -> None: ...

    def load_adapter(self, slot: int, adapter: LoraAdapter) -> None: ...


@dataclass(eq=False)
class _Resident:
    adapter: LoraAdapter
    slot: int
    leases: int = 0


@dataclass
class AdapterStatus:
    """A resident adapter as GetModelInfo lists it."""

    adapter_id: str
    rank: int
    target_modules: list[str]
    slot: int
    load_seconds: float
    active_requests: int


@dataclass(eq=False)
class AdapterLease:
    """A request's hold on its resident adapter (its slot is not reused while held)."""

    registry: AdapterRegistry
    resident: _Resident
    released: bool = field(default=False)

    @property
    def adapter_id(self) -> str:
        return self.resident.adapter.adapter_id

    @property
    def slot(self) -> int:
        return self.resident.slot

    @property
    def fingerprint(self) -> bytes:
        return self.resident.adapter.fingerprint

    def release(self) -> None:
        """Idempotent: every path that ends a request may call it."""
        if not self.released:
            self.released = True
            self.registry._unlease(self.resident)


class AdapterRegistry:
    """The resident adapters (at most ``max_loras``, LRU) and their loads; thread-safe."""

    def __init__(self, root: str | Path, max_loras: int, max_rank: int,
                 runner: AdapterRunner, wait_s: float = 0.0) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise ValueError(f"--adapter-cache {root}: not a directory")
        if max_loras < 1 or max_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be >= 1")
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.runner = runner
        self.wait_s = wait_s  # longest wait in line for a slot (--max-lora-wait-s)
        self._lock = threading.Condition()  # notified when a slot may have come free
        self._resident: OrderedDict[str, _Resident] = OrderedDict()  # least recent first
        self._loading: dict[str, Future[None]] = {}
        self._free_slots = list(range(max_loras, 0, -1))
        # Requests waiting for a slot, first come first: only the first may take one, and
        # an adapter no request holds is the first's to evict while anyone waits, so a
        # request arriving for it just then cannot take the freed slot from the waiter.
        self._line: deque[object] = deque()
        self.loads = 0  # successful loads (reloads after eviction included)

    @property
    def waiting(self) -> int:
        """Requests waiting in line for an adapter slot."""
        return len(self._line)

    def acquire(self, adapter_id: str, cancel: threading.Event | None = None) -> AdapterLease:
        """A lease on ``adapter_id``, loading it first if it is not resident (blocking:
        call it off the engine thread). With every slot leased it waits in line for one,
        at most ``wait_s``. ``AdapterError`` for a bad adapter, ``AdapterSlotsFull`` when no
        slot came free in time, ``CancelledError`` once ``cancel`` is set (wake the wait
        with ``stop_waiting``): the caller gave up, and no lease is left behind."""
        check_adapter_id(adapter_id)
        if self.runner.max_loras < 1:
            raise AdapterError(adapter_id, f"the {self.runner.name} runner cannot serve LoRA "
                               f"adapters")
        deadline = time.monotonic() + self.wait_s
        checked = False  # its files read and checked, before it waits for a slot
        while True:
            with self._lock:
                got = self._claim(adapter_id, deadline, cancel, may_wait=checked)
            if got is None:  # no slot now: an adapter that is broken or does not fit
                # the model is refused before any wait (and read again once a slot frees:
                # a waiter holds no weights meanwhile, which for many waiters on a big
                # model would be gigabytes)
                self.runner.check_adapter(read_adapter(self.root, adapter_id, self.max_rank,
                                                       self.runner.prefers_gguf_adapters))
                checked = True
                continue
            if isinstance(got, AdapterLease):
                lease = got
            elif isinstance(got, Future):
                got.result()  # the first use's error is every waiter's error
                continue
            else:
                lease = self._load(adapter_id, *got)
            if cancel is not None and cancel.is_set():  # cancelled while it loaded
                lease.release()
                raise CancelledError(f"adapter {adapter_id!r}: the request was cancelled")
            return lease

    def stop_waiting(self, cancel: threading.Event) -> None:
        """Set ``cancel`` and wake every wait in ``acquire`` to see it."""
        cancel.set()
        with self._lock:
            self._lock.notify_all()

    def _claim(self, adapter_id: str, deadline: float, cancel: threading.Event | None,
               may_wait: bool) -> AdapterLease | Future[None] | tuple[int, Future[None]] | None:
        """Under the lock: a lease on the resident adapter, the load in progress to wait
        for, or a slot to load it into (with the load's future, registered); while none of
        these can be had, None unless ``may_wait`` (the caller reads the adapter's files
        first), else waits in line (the lock released)."""
        ticket: object | None = None  # this request's place in line, once it waits
        try:
            while True:
                if cancel is not None and cancel.is_set():
                    raise CancelledError(f"adapter {adapter_id!r}: the request was cancelled")
                first = not self._line or self._line[0] is ticket
                resident = self._resident.get(adapter_id)
                if resident is not None and (resident.leases or first):
                    return self._lease(adapter_id, resident)
                pending = self._loading.get(adapter_id)
                if pending is not None:
                    return pending
                slot = self._take_slot() if first else None
                if slot is not None:
                    mine: Future[None] = Future()
                    self._loading[adapter_id] = mine
                    return slot, mine
                if not may_wait:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AdapterSlotsFull(
                        f"adapter {adapter_id!r}: no adapter slot came free in "
                        f"{self.wait_s:g} s (--max-lora-wait-s): all {self.max_loras} slots "
                        f"(--max-loras) hold adapters of running requests; retry later")
                if ticket is None:
                    ticket = object()
                    self._line.append(ticket)
                self._lock.wait(left)
        finally:
            if ticket is not None:
                self._line.remove(ticket)
                self._lock.notify_all()  # the next in line may take a slot now

    def check_known(self, adapter_id: str) -> None:
        """``AdapterError`` unless ``adapter_id`` is a valid id with a directory in the
        cache (no files read: for calls that only tokenize)."""
        check_adapter_id(adapter_id)
        if adapter_id not in self._resident and not (self.root / adapter_id).is_dir():
            raise AdapterError(adapter_id, f"unknown adapter (no directory {adapter_id!r} in "
                               f"the adapter cache)")

    def lease_resident(self, adapter_id: str) -> AdapterLease | None:
        """A lease on ``adapter_id`` if it is resident and not spoken for (an adapter no
        request holds is evicted for the first in line), else None (never blocks)."""
        with self._lock:
            resident = self._resident.get(adapter_id)
            if resident is None or not (resident.leases or not self._line):
                return None
            return self._lease(adapter_id, resident)

    def _load(self, adapter_id: str, slot: int, done: Future[None]) -> AdapterLease:
        try:
            start = time.perf_counter()
            adapter = read_adapter(self.root, adapter_id, self.max_rank,
                                   self.runner.prefers_gguf_adapters)
            self.runner.load_adapter(slot, adapter)
            adapter.weights = {}  # the runner holds its own copy; keep no second one
            adapter.load_seconds = time.perf_counter() - start
        except BaseException as e:
            with self._lock:
                del self._loading[adapter_id]
                self._free_slots.append(slot)
                self._lock.notify_all()
            done.set_exception(e)
            raise
        with self._lock:
            del self._loading[adapter_id]
            resident = self._resident[adapter_id] = _Resident(adapter, slot)
            self.loads += 1
            lease = self._lease(adapter_id, resident)
        done.set_result(None)
        log.info("adapter %r loaded into slot %d in %.3fs (%s, rank %d, targets %s)",
                 adapter_id, slot, adapter.load_seconds,
                 adapter.gguf.file.name if adapter.gguf else "PEFT", adapter.rank,
                 ", ".join(adapter.target_modules))
        return lease

    def _lease(self, adapter_id: str, resident: _Resident) -> AdapterLease:
        resident.leases += 1
        self._resident.move_to_end(adapter_id)
        return AdapterLease(self, resident)

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used unleased adapter's (evicted), else
        None."""
        if self._free_slots:
            return self._free_slots.pop()
        for adapter_id, resident in self._resident.items():
            if resident.leases == 0:
                del self._resident[adapter_id]
                log.info("adapter %r evicted from slot %d (least recently used)", adapter_id,
                         resident.slot)
                return resident.slot
        return None

    def _unlease(self, resident: _Resident) -> None:
        with self._lock:
            resident.leases -= 1
            if resident.leases == 0 and self._line:
                self._lock.notify_all()

    def resident(self) -> list[AdapterStatus]:
        """The resident adapters, most recently used last."""
        with self._lock:
            return [AdapterStatus(r.adapter.adapter_id, r.adapter.rank,
                                  r.adapter.target_modules, r.slot, r.adapter.load_seconds,
                                  r.leases) for r in self._resident.values()]
