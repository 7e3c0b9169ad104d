"""Backends built once per model, compilation off the engine thread, cached and bounded.

``factory(spec)`` returns the cached ``GrammarFactory`` for (backend, kind, spec), the
tokenizer being fixed per server. Compilation runs in a worker pool with a time limit; a
spec that is too big, invalid, unsupported by the chosen backend or too slow to compile is
a ``ValueError`` (INVALID_ARGUMENT for that request alone). AUTO tries xgrammar, then
lm-format-enforcer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from structured.grammar import StructuredBackend
from structured.lmfe_backend import LMFEBackend
from structured.processor import GrammarFactory
from structured.spec import AUTO, LM_FORMAT_ENFORCER, XGRAMMAR, StructuredSpec
from structured.xgrammar_backend import XGrammarBackend

log = logging.getLogger(__name__)


@dataclass
class StructuredConfig:
    max_spec_bytes: int = 64 * 1024
    compile_timeout_s: float = 10.0
    cache_size: int = 256
    max_consecutive_whitespace: int = 12
    compile_threads: int = 2


class CompileObserver(Protocol):
    """Told of every compile (from a worker thread) and cache lookup, e.g. for metrics."""

    def on_compile(self, backend: str, seconds: float, ok: bool) -> None: ...

    def on_cache_lookup(self, backend: str, hit: bool) -> None: ...


@dataclass
class CompileStats:
    compiles: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 config: StructuredConfig | None = None) -> None:
        self.config = config or StructuredConfig()
        self.vocab_size = vocab_size
        start = time.perf_counter()
        ws = self.config.max_consecutive_whitespace
        self.backends: dict[str, StructuredBackend] = {
            XGRAMMAR: XGrammarBackend(tokenizer, vocab_size, eos_token_ids, ws),
            LM_FORMAT_ENFORCER: LMFEBackend(tokenizer, vocab_size, eos_token_ids, ws),
        }
        log.info("structured-output backends ready in %.1fs: %s", time.perf_counter() - start,
                 ", ".join(self.backends))
        self._pool = ThreadPoolExecutor(self.config.compile_threads,
                                        thread_name_prefix="genserve-compile")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self.stats = CompileStats()
        self.observers: list[CompileObserver] = []

    def _notify(self, event: str, *args) -> None:
        for observer in list(self.observers):
            try:
                getattr(observer, event)(*args)
            except Exception:
                log.exception("structured-output observer failed")

    def kinds(self) -> dict[str, list[str]]:
        return {name: sorted(b.kinds) for name, b in self.backends.items()}

    def _candidates(self, spec: StructuredSpec) -> list[StructuredBackend]:
        if spec.backend == AUTO:
            found = [b for b in self.backends.values() if spec.kind in b.kinds]
            if not found:
                raise ValueError(f"structured_output.{spec.kind}: no backend supports it")
            return found
        backend = self.backends.get(spec.backend)
        if backend is None:
            raise ValueError(f"structured_output.backend: unknown backend {spec.backend!r}")
        if spec.kind not in backend.kinds:
            raise ValueError(f"structured_output: backend {backend.name} does not support "
                             f"kind {spec.kind!r} (it supports {sorted(backend.kinds)})")
        return [backend]

    def _compile(self, backend: StructuredBackend, spec: StructuredSpec) -> GrammarFactory:
        start = time.perf_counter()
        try:
            compiled = backend.compile(spec)
        except BaseException:
            self._notify("on_compile", backend.name, time.perf_counter() - start, False)
            raise
        elapsed = time.perf_counter() - start
        self.stats.compile_seconds += elapsed
        self._notify("on_compile", backend.name, elapsed, True)
        self.stats.compiles += 1
        return GrammarFactory(compiled, self.vocab_size, backend.name)

    def _cached(self, backend: StructuredBackend, spec: StructuredSpec) -> Future:
        key = (backend.name, spec.kind, spec.value)
        fut = self._cache.get(key)
        if fut is not None and not (fut.done() and fut.exception() is not None):
            self._cache.move_to_end(key)
            self.stats.cache_hits += 1
            self._notify("on_cache_lookup", backend.name, True)
            return fut
        self._notify("on_cache_lookup", backend.name, False)
        fut = self._pool.submit(self._compile, backend, spec)
        self._cache[key] = fut
        while len(self._cache) > self.config.cache_size:
            self._cache.popitem(last=False)
        return fut

    async def factory(self, spec: StructuredSpec) -> GrammarFactory:
        if spec.size > self.config.max_spec_bytes:
            raise ValueError(f"structured_output.{spec.kind} is {spec.size} bytes; the limit "
                             f"is {self.config.max_spec_bytes}")
        if spec.kind == "choice" and (not spec.value or not all(spec.value)):
            raise ValueError("structured_output.choice needs at least one non-empty choice")
        errors = []
        for backend in self._candidates(spec):
            fut = self._cached(backend, spec)
            try:
                # shield: one caller's timeout must not cancel a compile others await
                return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)),
                                              self.config.compile_timeout_s)
            except TimeoutError:
                errors.append(f"{backend.name}: compiling took longer than "
                              f"{self.config.compile_timeout_s:g}s")
                self._cache.pop((backend.name, spec.kind, spec.value), None)
            except ValueError as e:
                errors.append(f"{backend.name}: {e}")
        raise ValueError(f"structured_output.{spec.kind} is invalid: " + "; ".join(errors))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
