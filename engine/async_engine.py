"""Runs the engine's step loop in its own thread and bridges its outputs to asyncio.

Requests and aborts are posted to an inbox the loop drains between steps (so the engine
itself stays single-threaded); each request's outputs flow back through its own
``asyncio.Queue``. Closing or cancelling a ``generate()`` stream aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from engine.config import EngineConfig, EngineDeadError, QueueFullError
from engine.llm_engine import LLMEngine
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams
from engine.speculation import SpeculatorFactory

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.info = engine.info
        self.config = engine.config
        self._inbox: deque[tuple[str, Any]] = deque()
        self._wakeup = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self.died: asyncio.Event | None = None  # set (on the event loop) if the loop crashes
        # Read by the asyncio thread, written by the loop thread: plain ints behind a lock,
        # never the scheduler's own containers (iterating those mid-step would race).
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._waiting_snapshot = 0

    @classmethod
    def from_config(cls, config: EngineConfig,
                    speculator: SpeculatorFactory | None = None) -> AsyncEngine:
        return cls(LLMEngine(config, speculator=speculator))

    # ---- lifecycle ------------------------------------------------------------------

    def compile(self) -> None:
        """Build the compiled decode step (``ModelRunner.warmup``); before ``start()``,
        since the runner is not shared with a running step loop."""
        assert self._thread is None, "compile before start()"
        self.engine.runner.warmup()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.died = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="genserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    # ---- requests -------------------------------------------------------------------

    async def generate(self, request_id: str | None, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last one has ``finished=True``."""
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead}")
        if self._loop is None:
            raise EngineDeadError("engine not started")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        max_new = self.engine.check_request(prompt_token_ids, params)
        with self._lock:
            if self._waiting_snapshot + self._pending_adds >= self.config.max_waiting:
                raise QueueFullError(
                    f"waiting queue is full ({self.config.max_waiting} requests)")
            self._pending_adds += 1
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        self._post(("add", (request_id, list(prompt_token_ids), params, max_new)))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._post(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # ---- the loop thread ------------------------------------------------------------

    def _post(self, item: tuple[str, Any]) -> None:
        self._inbox.append(item)
        self._wakeup.set()

    def _deliver(self, request_id: str, item: Any) -> None:
        queue = self._streams.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    def _send(self, request_id: str, item: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver, request_id, item)

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, arg = self._inbox.popleft()
            if kind == "abort":
                self.engine.abort(arg)
                continue
            request_id, prompt, params, max_new = arg
            if request_id in self._streams:  # else cancelled before it reached the engine
                try:
                    self.engine.add_request(request_id, prompt, params, max_new)
                except (ValueError, QueueFullError) as e:
                    self._send(request_id, e)
            with self._lock:
                self._pending_adds -= 1
                self._waiting_snapshot = self.engine.num_waiting_requests()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.engine.has_work:
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                for out in self.engine.step():
                    self._send(out.request_id, out)
                with self._lock:
                    self._waiting_snapshot = self.engine.num_waiting_requests()
        except BaseException as e:  # a bug in the engine: fail every stream loudly
            log.exception("engine loop crashed")
            self._dead = e
            err = EngineDeadError(f"engine loop crashed: {type(e).__name__}: {e}")
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._fail_all, err)

    def _fail_all(self, err: EngineDeadError) -> None:
        """On the event loop, so no stream registers unseen: every waiting caller fails."""
        for queue in self._streams.values():
            queue.put_nowait(err)
        assert self.died is not None
        self.died.set()
