"""Which backend serves a spec, compiled off the engine thread, cached, and never waited on
for long.

``factory(spec)`` returns the cached ``GrammarFactory`` for (backend, kind, spec,
whitespace). AUTO, the default:

1. llguidance, in-process: its grammars build lazily in milliseconds under its own fuel
   limits, probed when the grammar is built (a spec past them goes to xgrammar at once,
   every time). A JSON schema it cannot enforce strictly is retried ``lenient`` (the
   engine then checks each finished output against the schema).
2. xgrammar, when llguidance cannot enforce the spec: compiled in a worker process that is
   killed at the time or memory limit (``compile_worker``).
3. A spec seen ``accelerate_after`` times is compiled with xgrammar in the background
   (its masks are ~4x cheaper); new sequences switch to it once it is ready.

A spec that is wrong in itself (bad syntax, a ``$ref`` to nothing, unsatisfiable, a
look-around regex, a grammar that admits no first token) is a ``ValueError`` whichever
backend is asked: INVALID_ARGUMENT for that request alone. lm-format-enforcer stays
selectable per request (its parsers are proven in a worker first, then built here).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Protocol

from structured.compile_worker import (
    READY_TIMEOUT_S,
    CompileAborted,
    CompileWorkers,
    WorkerSetup,
)
from structured.config import StructuredConfig
from structured.grammar import CompiledGrammar, StructuredBackend
from structured.llguidance_backend import LLGuidanceBackend, UnsupportedSpec
from structured.lmfe_backend import LMFEBackend
from structured.processor import GrammarFactory
from structured.spec import (
    AUTO,
    LLGUIDANCE,
    LM_FORMAT_ENFORCER,
    WHITESPACE_MODES,
    XGRAMMAR,
    StructuredSpec,
)
from structured.xgrammar_backend import XGrammarBackend

log = logging.getLogger(__name__)


class CompileObserver(Protocol):
    """Told of every compile (from a worker thread), cache lookup and served request."""

    def on_compile(self, backend: str, seconds: float, ok: bool) -> None: ...

    def on_cache_lookup(self, backend: str, hit: bool) -> None: ...

    def on_served(self, backend: str) -> None: ...


@dataclass
class BackendStats:
    """What GetModelInfo reports per backend."""
    requests: int = 0
    compiles: int = 0
    failures: int = 0
    compile_seconds: float = 0.0  # compile + first mask, summed over successful compiles
    max_compile_seconds: float = 0.0


@dataclass
class CompileStats:
    compiles: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0
    backends: dict[str, BackendStats] = field(default_factory=dict)


@dataclass
class _Entry:
    """One cached compile; for AUTO, also its background upgrade to xgrammar."""
    future: Future
    requests: int = 0
    accelerating: bool = False


# Beyond every bound the workers enforce: only a wedged compile thread meets it.
WEDGED_SLACK_S = 30.0


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 config: StructuredConfig | None = None) -> None:
        self.config = config or StructuredConfig()
        self.vocab_size = vocab_size
        start = time.perf_counter()
        ws = self.config.max_consecutive_whitespace
        self.llguidance = LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids, ws)
        self.xgrammar = XGrammarBackend(tokenizer, vocab_size, eos_token_ids, ws)
        self.lmfe = LMFEBackend(tokenizer, vocab_size, eos_token_ids, ws)
        self.backends: dict[str, StructuredBackend] = {
            LLGUIDANCE: self.llguidance, XGRAMMAR: self.xgrammar, LM_FORMAT_ENFORCER: self.lmfe}
        self._tokenizer_dir = tempfile.TemporaryDirectory(prefix="genserve-tokenizer-")
        tokenizer.save_pretrained(self._tokenizer_dir.name)
        setup = WorkerSetup(self._tokenizer_dir.name, vocab_size, tuple(eos_token_ids), ws)
        rss = self.config.compile_max_rss_mb << 20
        prestart = self.config.prestart_workers
        self.workers = CompileWorkers(setup, self.config.compile_workers, rss,
                                      prestart=prestart)
        self.accelerator = (CompileWorkers(replace(setup, nice=15), 1, rss,
                                           name="genserve-accelerate", prestart=prestart)
                            if self.config.accelerate_after else None)
        log.info("structured-output backends ready in %.1fs: %s", time.perf_counter() - start,
                 ", ".join(self.backends))
        self._pool = ThreadPoolExecutor(self.config.compile_threads,
                                        thread_name_prefix="genserve-compile")
        # Background upgrades wait on their one worker in a thread of their own: in the
        # compile pool, a queue of them held every thread and starved requests' compiles.
        self._upgrades = ThreadPoolExecutor(1, thread_name_prefix="genserve-accelerate")
        self._cache: OrderedDict[tuple, _Entry] = OrderedDict()
        self._lock = threading.Lock()  # stats, touched from compile threads
        self.stats = CompileStats(backends={name: BackendStats() for name in self.backends})
        self.observers: list[CompileObserver] = []

    def _notify(self, event: str, *args) -> None:
        for observer in list(self.observers):
            try:
                getattr(observer, event)(*args)
            except Exception:
                log.exception("structured-output observer failed")

    def kinds(self) -> dict[str, list[str]]:
        return {name: sorted(b.kinds) for name, b in self.backends.items()}

    # ---- the request's way in (event loop) ---------------------------------------------

    async def factory(self, spec: StructuredSpec, prefix: str = "structured_output."
                      ) -> GrammarFactory:
        """The spec's shared factory, compiled once. Errors are ValueErrors naming the
        request's field with the API's ``prefix``."""
        spec = self._checked(spec, prefix)
        fut = self._cached(spec)
        try:
            # shield: one caller's cancellation must not cancel a compile others await;
            # the workers enforce the time limit, this only bounds a wedged thread. A
            # worker that must start first may take READY_TIMEOUT_S (bounded there): its
            # start is not the compile's time (under heavy load it overran a bound of the
            # compile limit + 30 s and a valid spec was refused as too slow).
            factory = await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(fut)),
                READY_TIMEOUT_S + len(self.backends) * self.config.compile_timeout_s
                + WEDGED_SLACK_S)
        except TimeoutError:
            raise ValueError(f"{prefix}{spec.kind}: compiling took too long") from None
        except ValueError as e:
            where = "" if spec.backend == AUTO else f"{spec.backend}: "
            raise ValueError(f"{prefix}{spec.kind} is invalid: {where}{e}") from None
        with self._lock:
            self.stats.backends[factory.backend].requests += 1
        self._notify("on_served", factory.backend)
        return factory

    def _checked(self, spec: StructuredSpec, prefix: str) -> StructuredSpec:
        """The spec with the server's default whitespace, once within the server's limits
        and supported by the backend it names."""
        if not spec.whitespace:
            spec = replace(spec, whitespace=self.config.default_whitespace)
        if spec.whitespace not in WHITESPACE_MODES:
            raise ValueError(f"{prefix}whitespace: unknown mode {spec.whitespace!r} "
                             f"(one of {', '.join(WHITESPACE_MODES)})")
        if spec.size > self.config.max_spec_bytes:
            raise ValueError(f"{prefix}{spec.kind} is {spec.size} bytes; the limit is "
                             f"{self.config.max_spec_bytes}")
        if spec.backend == AUTO:
            return spec
        backend = self.backends.get(spec.backend)
        if backend is None:
            raise ValueError(f"{prefix}backend: unknown backend {spec.backend!r}")
        if spec.kind not in backend.kinds:
            raise ValueError(f"{prefix.rstrip('.') or 'guided'}: backend {backend.name} does "
                             f"not support kind {spec.kind!r} (it supports "
                             f"{sorted(backend.kinds)})")
        return spec

    def _cached(self, spec: StructuredSpec) -> Future:
        """The compile of (backend or AUTO, spec): started once, its verdict kept."""
        key = (spec.backend, spec.kind, spec.value, spec.whitespace)
        entry = self._cache.get(key)
        if entry is not None and entry.future.done() and isinstance(
                entry.future.exception(), CompileAborted):
            entry = None  # no verdict (shutdown, a dead worker): compile again
        self._notify("on_cache_lookup", spec.backend, entry is not None)
        if entry is None:
            entry = self._cache[key] = _Entry(self._pool.submit(self._build, spec))
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
        else:
            self.stats.cache_hits += 1
            self._cache.move_to_end(key)
        entry.requests += 1
        if spec.backend == AUTO:
            self._maybe_accelerate(entry, spec)
        return entry.future

    def _maybe_accelerate(self, entry: _Entry, spec: StructuredSpec) -> None:
        """A spec llguidance serves and clients keep sending: build it with xgrammar in the
        background (lowest priority, long time limit); once ready, it serves new
        sequences (the sequences already running keep their llguidance grammar)."""
        if (self.accelerator is None or entry.accelerating
                or entry.requests < self.config.accelerate_after
                or not entry.future.done() or entry.future.exception() is not None
                or entry.future.result().backend != LLGUIDANCE):
            return
        entry.accelerating = True
        self._upgrades.submit(self._accelerate, entry, spec)

    # ---- compiling (compile threads) --------------------------------------------------

    def _accelerate(self, entry: _Entry, spec: StructuredSpec) -> None:
        try:
            factory = self._compile(XGRAMMAR, spec, self.config.accelerate_timeout_s,
                                    self.accelerator)
        except ValueError as e:
            log.info("xgrammar could not accelerate a %s spec: %s", spec.kind, e)
            return
        done: Future = Future()
        done.set_result(factory)
        entry.future = done  # a plain swap: readers see the old or the new factory

    def _build(self, spec: StructuredSpec) -> GrammarFactory:
        """The named backend; AUTO: llguidance, else xgrammar in a worker, the first that
        can enforce the spec. A spec that llguidance finds wrong in itself is refused
        whichever backend is asked (except an EBNF grammar: ours is xgrammar's dialect)."""
        auto = spec.backend == AUTO
        why = ""
        for backend in (LLGUIDANCE, XGRAMMAR) if auto else (spec.backend,):
            try:
                return self._compile(backend, spec)
            except ValueError as e:
                if not auto:
                    raise
                failed = f"{why}; " if why else ""
                why = f"{failed}{backend}: {e}"
                wrong_in_itself = not isinstance(e, UnsupportedSpec) and spec.kind != "grammar"
                if backend == XGRAMMAR or wrong_in_itself:  # no other backend may serve it
                    kind = CompileAborted if isinstance(e, CompileAborted) else ValueError
                    raise kind(why) from None
        raise AssertionError("unreachable: the last backend raised or returned")

    def _compile(self, backend: str, spec: StructuredSpec, timeout_s: float | None = None,
                 workers: CompileWorkers | None = None) -> GrammarFactory:
        """Compile ``spec`` with ``backend`` (blocking), timed and counted."""
        compiled: CompiledGrammar
        lenient: list[str] = []
        with self._timed(backend):
            if backend == LLGUIDANCE:
                llg = self.llguidance.compile(spec)
                compiled, lenient = llg, llg.lenient_ignored
            else:
                self.llguidance.refuse_invalid(spec)
                payload = (workers or self.workers).run(
                    backend, spec, timeout_s or self.config.compile_timeout_s)
                compiled = (self.xgrammar.deserialize(payload) if backend == XGRAMMAR
                            else self.lmfe.compile(spec))  # lmfe: proven bounded in a worker
        return GrammarFactory.for_spec(compiled, self.vocab_size, backend, spec, lenient)

    @contextmanager
    def _timed(self, backend: str) -> Iterator[None]:
        start = time.perf_counter()
        ok = False
        try:
            yield
            ok = True
        finally:
            self._record(backend, time.perf_counter() - start, ok)

    def _record(self, backend: str, seconds: float, ok: bool) -> None:
        with self._lock:
            s = self.stats.backends[backend]
            if ok:
                s.compiles += 1
                s.compile_seconds += seconds
                s.max_compile_seconds = max(s.max_compile_seconds, seconds)
                self.stats.compiles += 1
                self.stats.compile_seconds += seconds
            else:
                s.failures += 1
        self._notify("on_compile", backend, seconds, ok)

    def prestart(self) -> None:
        """Spawn the compile workers now (e.g. once the server is SERVING), so the first
        xgrammar request does not wait for one to import its libraries."""
        self.workers.prestart()
        if self.accelerator is not None:
            self.accelerator.prestart()

    def close(self) -> None:
        """Kill every compile now: shutdown never waits on one."""
        self.workers.close()
        if self.accelerator is not None:
            self.accelerator.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._upgrades.shutdown(wait=False, cancel_futures=True)
        self._tokenizer_dir.cleanup()
