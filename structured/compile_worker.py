"""Grammar compiles that can be killed: each runs in a worker process with a time and a
memory limit, and a worker past either is killed and replaced.

A compile inside the server's own process cannot be stopped once started (xgrammar's C++
and lm-format-enforcer's regex FSMs ignore signals and hold their thread for minutes on a
hostile spec), so the backends that can run away compile here. Workers are spawned (not
forked: the server's torch threads make fork unsafe), load the tokenizer once from a
directory, and keep their backends (xgrammar's compile cache among them) between jobs.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from structured.spec import LM_FORMAT_ENFORCER, XGRAMMAR, StructuredSpec

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 180.0  # a spawned worker imports torch: slow on a busy machine
POLL_S = 0.05


class CompileKilled(ValueError):
    """The compile passed its time or memory limit; its worker was killed."""


class CompileAborted(ValueError):
    """No verdict on the spec: the server is shutting down or the worker died."""


@dataclass(frozen=True)
class WorkerSetup:
    tokenizer_dir: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_whitespace: int
    xgrammar_cache_bytes: int = 512 * 1024 * 1024
    nice: int = 5  # compiles yield the CPU to the engine's step
    # Priority of the imports and backend tables (seconds of CPU); None = ``nice``. After
    # them the worker returns to ``nice`` where it may (raising priority needs
    # CAP_SYS_NICE; without it the worker stays at this one).
    import_nice: int | None = None


# Workers spawned in the background (``CompileWorkers.prestart``, a server once idle)
# import at the lowest priority: a server's requests must not wait on them. On a CPU other
# work saturates, a request that then needs such a worker waits for its import.
BACKGROUND_IMPORT_NICE = 19


def _worker_main(conn: Connection, setup: WorkerSetup) -> None:
    """The worker's loop: one (backend, spec) job at a time, answered ("ok", payload) or
    ("error", message)."""
    inherited = os.getpriority(os.PRIO_PROCESS, 0)  # nice values are relative to it
    first = setup.nice if setup.import_nice is None else max(setup.nice, setup.import_nice)
    os.setpriority(os.PRIO_PROCESS, 0, min(19, inherited + first))
    import torch
    torch.set_num_threads(1)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(setup.tokenizer_dir)
    from structured.lmfe_backend import LMFEBackend
    from structured.xgrammar_backend import XGrammarBackend

    # Built before "ready", so a job's time limit counts only its own compile.
    args = (tokenizer, setup.vocab_size, list(setup.eos_token_ids), setup.max_whitespace)
    backends: dict[str, Any] = {
        XGRAMMAR: XGrammarBackend(*args, cache_bytes=setup.xgrammar_cache_bytes),
        LM_FORMAT_ENFORCER: LMFEBackend(*args),
    }
    _renice_threads(min(19, inherited + setup.nice))
    conn.send(("ready", None))
    while True:
        try:
            name, spec = conn.recv()
        except (EOFError, OSError):  # the server closed the pipe: its end, ours too
            return
        try:
            compiled = backends[name].compile(spec)
            # xgrammar's result crosses back serialised; lm-format-enforcer's parsers are
            # rebuilt by the server once this run proved they finish within the limits.
            payload = compiled.compiled.serialize_json() if name == XGRAMMAR else None
            conn.send(("ok", payload))
        except ValueError as e:
            conn.send(("error", str(e)))
        except Exception as e:  # a backend bug: report it, keep the worker
            conn.send(("error", f"{type(e).__name__}: {e}"))


def _renice_threads(nice: int) -> None:
    """Every thread of this process to ``nice`` (Linux keeps a nice value per thread, and
    the backends' pools were started at the import priority); where raising priority is
    not allowed, they keep theirs."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        with contextlib.suppress(PermissionError, ProcessLookupError):
            os.setpriority(os.PRIO_PROCESS, tid, nice)


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class _Worker:
    def __init__(self, setup: WorkerSetup, name: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, setup), name=name,
                                daemon=True)
        self.proc.start()
        child.close()
        self.ready = False

    def wait_ready(self, closing: threading.Event) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.ready:
            if closing.is_set():
                raise CompileAborted("compile aborted: the server is shutting down")
            if self.conn.poll(POLL_S):
                self.conn.recv()  # ("ready", None)
                self.ready = True
            elif not self.proc.is_alive() or time.monotonic() > deadline:
                raise CompileAborted("the grammar compile worker failed to start")

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class CompileWorkers:
    """``size`` workers; ``run`` blocks its (non-event-loop) thread until a worker answers,
    or kills the worker at ``timeout_s`` or ``max_rss_bytes`` and raises CompileKilled."""

    def __init__(self, setup: WorkerSetup, size: int, max_rss_bytes: int,
                 name: str = "genserve-compile", prestart: bool = True) -> None:
        self.setup = setup
        self.max_rss_bytes = max_rss_bytes
        self.name = name
        self._closing = threading.Event()
        # None: a worker not spawned yet (spawned on first use unless ``prestart``)
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        self.killed = 0
        for _ in range(size):
            self._idle.put(_Worker(setup, name) if prestart else None)

    def prestart(self) -> None:
        """Spawn the workers not spawned yet (their imports then run in the background)."""
        idle = []
        while True:
            try:
                idle.append(self._idle.get_nowait())
            except queue.Empty:
                break
        background = replace(self.setup, import_nice=BACKGROUND_IMPORT_NICE)
        for worker in idle:
            self._idle.put(worker if worker is not None else _Worker(background, self.name))

    def run(self, backend: str, spec: StructuredSpec, timeout_s: float) -> Any:
        worker = self._take()
        healthy = False
        try:
            worker.wait_ready(self._closing)
            worker.conn.send((backend, spec))
            status, payload = self._answer(worker, timeout_s)
            healthy = True
        except (OSError, EOFError):
            raise CompileAborted("compile aborted: the server is shutting down" if
                             self._closing.is_set() else "the grammar compile worker died"
                             ) from None
        finally:
            self._give_back(worker, healthy)
        if status == "error":
            raise ValueError(payload)
        return payload

    def _take(self) -> _Worker:
        while True:
            if self._closing.is_set():
                raise CompileAborted("compile aborted: the server is shutting down")
            try:
                worker = self._idle.get(timeout=0.5)
            except queue.Empty:
                continue
            return worker if worker is not None else _Worker(self.setup, self.name)

    def _answer(self, worker: _Worker, timeout_s: float) -> tuple[str, Any]:
        start = time.monotonic()
        while not worker.conn.poll(POLL_S):
            if self._closing.is_set():
                raise EOFError
            elapsed = time.monotonic() - start
            rss = rss_bytes(worker.proc.pid or 0)
            if elapsed > timeout_s or rss > self.max_rss_bytes:
                self.killed += 1
                worker.kill()
                why = (f"compiling took longer than {timeout_s:g}s" if elapsed > timeout_s
                       else f"compiling used more than {self.max_rss_bytes >> 20} MiB")
                log.warning("grammar compile killed: %s", why)
                raise CompileKilled(why)
            if not worker.proc.is_alive():
                raise EOFError
        return worker.conn.recv()

    def _give_back(self, worker: _Worker, healthy: bool) -> None:
        if self._closing.is_set():
            worker.kill()
            return
        if not healthy:
            worker.kill()
            worker = _Worker(self.setup, self.name)  # its imports run while we go on
        self._idle.put(worker)

    def close(self) -> None:
        """Kill every worker now: shutdown never waits on a compile."""
        self._closing.set()
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                break
            if worker is not None:
                worker.kill()
