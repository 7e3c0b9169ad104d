"""The tensor-parallel process group: rendezvous, the per-step broadcast, the all-reduce.

Rank 0 is the serving process (scheduler, sampler, gRPC); ranks 1..N-1 are workers that
run the same forward on their shard. Every message goes from rank 0 to all workers as one
``broadcast_object_list`` on a gloo group (control messages stay on the CPU even when the
weights live on CUDA); the activations' all-reduce runs on the device group (NCCL on
CUDA, the same gloo group on the CPU).

Never hang: every collective has the group's timeout (``GENSERVE_TP_TIMEOUT_S``, default
600 s: it also covers the ranks loading and compiling at different speeds); a worker that
dies closes its sockets, which fails the next collective at once; rank 0 watches its local
workers' processes and, while idle, pings the workers so a lost remote one is noticed
and the workers' own wait for the next step never times out.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.config import WorkerLostError

log = logging.getLogger(__name__)

TIMEOUT_ENV = "GENSERVE_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
PING_EVERY_S = 5.0  # rank 0 idle for this long: one ping keeps the workers' wait alive
WATCH_EVERY_S = 0.2  # how often rank 0 looks at its local workers' processes


def timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


@dataclass
class Rendezvous:
    """torch.distributed's env:// rendezvous: where rank 0's store listens and who this
    process is (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``)."""

    master_addr: str
    master_port: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    def env(self) -> dict[str, str]:
        return {"MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
                "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size)}

    @classmethod
    def from_env(cls) -> Rendezvous:
        e = os.environ
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
                   if k not in e]
        if missing:
            raise ValueError(f"tensor-parallel worker: environment {', '.join(missing)} "
                             f"not set (torch.distributed env:// rendezvous)")
        world = int(e["WORLD_SIZE"])
        return cls(e["MASTER_ADDR"], int(e["MASTER_PORT"]), int(e["RANK"]), world,
                   int(e.get("LOCAL_RANK", e["RANK"])),
                   int(e.get("LOCAL_WORLD_SIZE", world)))


def tp_device(device: str, local_rank: int) -> torch.device:
    """Each rank's device: ``cuda:<local rank>`` when the config runs on CUDA, else the CPU."""
    from engine.loading.model_loader import resolve_device

    if resolve_device(device).type == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


# ---- the all-reduce of row-parallel layers ---------------------------------------------

_DEVICE_GROUP: Any = None  # this process's device group, set by TPGroup


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, group=_DEVICE_GROUP)
    return out


# An opaque op, so the compiled decode step (compiled_step.py) keeps the collective as one
# call in its graph (as it does packed_linear) instead of tracing torch.distributed.
tp_all_reduce = torch.library.custom_op("genserve::tp_all_reduce", mutates_args=())(
    _all_reduce)


@tp_all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


# Never dead code: a worker's graph computes no logits, so without this the compiler drops
# its last layer (whose output nothing reads) and with it collectives rank 0 waits in.
torch.fx.node.has_side_effect(torch.ops.genserve.tp_all_reduce.default)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks (a row-parallel layer's partial outputs)."""
    if torch.compiler.is_compiling():
        return torch.ops.genserve.tp_all_reduce(x)
    # A fresh layer output: reduced in place, once contiguous (a layer with LoRA's A folded
    # in returns a view of a wider output: lora.py)
    x = x.contiguous()
    dist.all_reduce(x, group=_DEVICE_GROUP)
    return x


# ---- the group ---------------------------------------------------------------------------


@dataclass
class TPGroup:
    """This process's membership of the group; rank 0 also owns its local workers."""

    rendezvous: Rendezvous
    device: torch.device
    cpu_group: Any
    workers: list[subprocess.Popen] = field(default_factory=list)
    failure: str | None = None  # set once the group cannot run a step again
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _last_message: float = field(default_factory=time.monotonic)
    _closed: bool = False

    @property
    def rank(self) -> int:
        return self.rendezvous.rank

    @property
    def world_size(self) -> int:
        return self.rendezvous.world_size

    @classmethod
    def join(cls, rendezvous: Rendezvous, device: torch.device,
             workers: list[subprocess.Popen] | None = None) -> TPGroup:
        """``init_process_group`` over env:// (blocks until every rank arrived)."""
        global _DEVICE_GROUP
        os.environ.update(rendezvous.env())
        timeout = timedelta(seconds=timeout_s())
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method="env://", rank=rendezvous.rank,
                                world_size=rendezvous.world_size, timeout=timeout)
        cpu_group = (dist.new_group(backend="gloo", timeout=timeout)
                     if device.type == "cuda" else dist.group.WORLD)
        _DEVICE_GROUP = dist.group.WORLD
        if device.type == "cpu":  # the ranks share this node's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1)
                                      // rendezvous.local_world_size))
        log.info("tensor parallel: rank %d of %d joined (%s, %s)", rendezvous.rank,
                 rendezvous.world_size, backend, device)
        group = cls(rendezvous, device, cpu_group, list(workers or []))
        if group.rank == 0:
            threading.Thread(target=group._watch, name="genserve-tp-watch",
                             daemon=True).start()
        return group

    # ---- messages (rank 0 -> workers) ----------------------------------------------

    def broadcast(self, message: Any = None) -> Any:
        """Rank 0 sends ``message``; a worker returns what rank 0 sent."""
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    @contextmanager
    def leading(self, message: Any) -> Iterator[None]:
        """Rank 0: send ``message`` and run the body (its collectives) with no ping in
        between. Anything raised inside leaves the ranks out of step: the group fails."""
        if self.failure is not None:
            raise WorkerLostError(self.failure)
        with self._lock:
            try:
                self.broadcast(message)
                yield
            except Exception as e:
                self._fail(f"tensor-parallel step failed: {type(e).__name__}: {e}")
                raise WorkerLostError(self.failure or str(e)) from e
            finally:
                self._last_message = time.monotonic()

    # ---- rank 0's watch ----------------------------------------------------------------

    def _fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why
            log.error("%s", why)

    def _watch(self) -> None:
        """Local workers' processes, and an idle ping through every rank."""
        while not self._closed and self.failure is None:
            for proc in self.workers:
                code = proc.poll()
                if code is not None:
                    self._fail(f"tensor-parallel worker (pid {proc.pid}) exited with "
                               f"{code}")
            idle = time.monotonic() - self._last_message
            if self.failure is None and idle > PING_EVERY_S and self._lock.acquire(
                    blocking=False):
                try:
                    if not self._closed:
                        self.broadcast(("ping",))
                except Exception as e:
                    self._fail(f"tensor-parallel worker unreachable: {e}")
                finally:
                    self._last_message = time.monotonic()
                    self._lock.release()
            time.sleep(WATCH_EVERY_S)

    def close(self, wait_s: float = 10.0) -> None:
        """Rank 0: stop the workers (a ``stop`` message, then SIGKILL for any left after
        ``wait_s``) and leave the group. Idempotent."""
        if self._closed:
            return
        if self.rank == 0 and self.failure is None and self._lock.acquire(timeout=wait_s):
            try:
                self.broadcast(("stop",))
            except Exception as e:  # the workers are gone already: kill what is left
                log.warning("tensor parallel: stop message failed: %s", e)
            finally:
                self._lock.release()
        self._closed = True
        deadline = time.monotonic() + wait_s
        for proc in self.workers:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel worker %d did not stop: killing it", proc.pid)
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group: nothing left to tear down cleanly
                log.debug("destroy_process_group failed", exc_info=True)
