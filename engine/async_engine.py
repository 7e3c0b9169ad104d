"""Runs the engine's step loop in its own thread and bridges its outputs to asyncio.

Requests and aborts are posted to an inbox the loop drains between steps (so the engine
itself stays single-threaded). Each step's outputs go to the event loop in **one**
``call_soon_threadsafe`` callback, however many requests it touched: every callback wakes
the event loop thread, and on a CPU whose cores the forward keeps busy that thread's time
comes out of the step's (the GIL, and a core taken from torch's threads). A stream
(``generate()``) gets each step's output through its own ``asyncio.Queue``; a unary request
(``complete()``) is merged on the engine thread and its caller woken once, when it
finishes. Closing or cancelling either aborts the request (its KV cache is freed). With
``stream_interval`` n > 1 a stream's outputs are held on the engine thread until they carry
n tokens (its first token and its end go at once): fewer wake-ups and messages.

Torch work off the event loop runs in threads that end with it (``in_own_thread``), never
on the event loop or in asyncio's executor: see there why.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.adapters import AdapterError, AdapterLease, AdapterRegistry, AdapterStatus
from engine.config import EngineConfig, EngineDeadError, QueueFullError, WorkerLostError
from engine.llm_engine import LLMEngine
from engine.output_collector import OutputCollector
from engine.outputs import EngineStats, RequestOutput, Usage
from engine.runners.base import WarmupReport
from engine.sampling_params import SamplingParams
from engine.speculation import SpeculatorFactory

log = logging.getLogger(__name__)


async def in_own_thread(fn: Callable[..., Any], *args: Any,
                        on_abandon: Callable[[Any], None] | None = None) -> Any:
    """``fn(*args)`` in a new thread that ends when ``fn`` returns.

    Why not ``asyncio.to_thread``: every thread that runs a parallel torch op keeps an
    OpenMP team (libgomp) for as long as the thread lives, and once more OpenMP threads are
    alive than the process has cores, libgomp stops spin-waiting between parallel regions
    for all of them. On 2 cores that made the engine thread's oneDNN linears 1.5x slower
    and a one-client server 27% slower than the same engine on one thread. So model
    loading and compiling run in threads that exit (freeing their team), and the engine
    thread is the only long-lived one that runs torch.

    The thread wakes the caller itself: no executor thread waits on it, so long waits
    (requests in line for an adapter slot) cannot use up asyncio's few executor threads.
    A cancelled caller leaves the thread to finish; what ``fn`` returns then goes to
    ``on_abandon`` (a lease to release), never nowhere.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def abandon(result: Any) -> None:
        if on_abandon is not None:
            on_abandon(result)

    def settle(result: Any, error: BaseException | None) -> None:  # on the event loop
        if done.cancelled():
            if error is None:
                abandon(result)
        elif error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as e:  # re-raised on the caller's side
            error = e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the event loop is closed: nobody will take the result
            if error is None:
                abandon(result)

    threading.Thread(target=run, name=f"genserve-{getattr(fn, '__name__', 'work')}",
                     daemon=True).start()
    try:
        return await done
    except asyncio.CancelledError:  # cancelled after the result came, before it was taken
        if done.done() and not done.cancelled() and done.exception() is None:
            abandon(done.result())
        raise

# Where a request's results go on the event loop: a stream's queue, or a unary call's future.
Waiter = asyncio.Queue | asyncio.Future
Ready = list[tuple[str, Any]]  # (request id, output / finished collector / exception)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.info = engine.info
        self.config = engine.config
        self._inbox: deque[tuple[str, Any]] = deque()
        self._wakeup = threading.Event()
        self._waiters: dict[str, Waiter] = {}  # event-loop side, by request id
        # called on the engine thread after each step with the tokens it computed, its
        # duration in seconds and whether it computed prompt tokens (a prefill)
        self.on_step: Callable[[int, float, bool], None] | None = None
        self._collectors: dict[str, OutputCollector] = {}  # engine-thread side: unary requests
        # engine-thread side, streams under stream_interval > 1: outputs held back until
        # they carry that many tokens
        self._held: dict[str, RequestOutput] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self.died: asyncio.Event | None = None  # set (on the event loop) if the loop crashes
        # Read by the asyncio thread, written by the loop thread: plain ints behind a lock,
        # never the scheduler's own containers (iterating those mid-step would race).
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._leasing = 0  # requests loading their adapter or waiting for its slot
        self._adapter_waits: set[threading.Event] = set()  # their cancel events (event loop)
        self._waiting_snapshot = -engine.config.max_num_seqs  # LLMEngine.backlog(): seats

    @classmethod
    def from_config(cls, config: EngineConfig,
                    speculator: SpeculatorFactory | None = None) -> AsyncEngine:
        return cls(LLMEngine(config, speculator=speculator))

    # ---- lifecycle ------------------------------------------------------------------

    def compile(self) -> WarmupReport:
        """Build the compiled decode step (``ModelRunner.warmup``). Safe while the step
        loop runs: the graphs are built on padding rows in the scratch block, and the
        runner switches to them in one assignment once every graph is ready, so steps run
        eagerly until then (a server turns SERVING first and compiles in the background)."""
        return self.engine.runner.warmup()

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
        await asyncio.to_thread(self.engine.runner.close)  # tensor-parallel workers stop

    @property
    def lost_worker(self) -> bool:
        """The loop died because the runner lost a tensor-parallel worker: nothing can be
        served again in this process (a server exits non-zero to be restarted)."""
        return isinstance(self._dead, WorkerLostError)

    @property
    def device_type(self) -> str:
        """"cpu" or "cuda": where the model runs."""
        return self.engine.runner.device.type

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def idle(self) -> bool:
        """No request in flight (read on the event loop, where requests register)."""
        return not self._waiters

    # ---- requests -------------------------------------------------------------------

    def check_queue(self) -> None:
        """``QueueFullError`` when the waiting queue is full: the one place its bound
        (``max_waiting``) is decided, on the event loop from counts the engine thread
        publishes (never on the engine thread, which may be inside a seconds-long step).
        Cheap, so a server asks before any costly work (tokenizing, compiling a grammar)
        for a call that cannot run; ``_admit`` asks too, for callers of this API."""
        with self._lock:
            full = (self._waiting_snapshot + self._pending_adds + self._leasing
                    >= self.config.max_waiting)
        if full:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")

    async def lease_adapter(self, adapter_id: str) -> AdapterLease | None:
        """A lease on the LoRA adapter ``adapter_id`` ('' = the base model: None), loaded
        on first use in a thread of its own (never on the event loop or the engine thread),
        after waiting in line for a slot while every slot is held (``--max-lora-wait-s``;
        such a request counts against ``max_waiting``). ``AdapterError``
        (INVALID_ARGUMENT) for a bad or unknown adapter, ``AdapterSlotsFull``
        (RESOURCE_EXHAUSTED) when the wait ran out. A cancelled caller (its client gone,
        its deadline passed) stops the wait, and a lease that came anyway is released."""
        if not adapter_id:
            return None
        registry = self._adapters(adapter_id)
        if self._dead is not None:  # no load or wait for an engine that cannot run it
            raise EngineDeadError(f"engine stopped: {self._dead}")
        lease = registry.lease_resident(adapter_id)
        if lease is not None:
            return lease
        cancel = threading.Event()
        self._adapter_waits.add(cancel)
        with self._lock:
            self._leasing += 1
        try:
            return await in_own_thread(registry.acquire, adapter_id, cancel,
                                       on_abandon=AdapterLease.release)
        except asyncio.CancelledError:
            registry.stop_waiting(cancel)
            raise
        except concurrent.futures.CancelledError:  # abort_all, or the engine loop died
            why = (f"engine stopped: {self._dead}" if self._dead is not None
                   else "server is shutting down")
            raise EngineDeadError(f"{why} (the request was waiting for adapter "
                                  f"{adapter_id!r})") from None
        finally:
            self._adapter_waits.discard(cancel)
            with self._lock:
                self._leasing -= 1

    def _adapters(self, adapter_id: str) -> AdapterRegistry:
        if self.engine.adapters is None:
            raise AdapterError(adapter_id, "adapters are not enabled on this server "
                               "(--adapter-cache)")
        return self.engine.adapters

    def check_adapter(self, adapter_id: str) -> None:
        """``AdapterError`` unless ``adapter_id`` ('' = the base model) could be used:
        adapters on, a valid id, a directory in the cache (nothing is loaded)."""
        if adapter_id:
            self._adapters(adapter_id).check_known(adapter_id)

    async def _admit_with_adapter(self, request_id: str | None, prompt_token_ids: list[int],
                                  params: SamplingParams, adapter_id: str
                                  ) -> tuple[str, SamplingParams, AdapterLease | None]:
        """``_admit``, holding the request's adapter (given back if admission fails)."""
        if adapter_id:
            self.check_queue()  # before a load the request could not use
        lease = await self.lease_adapter(adapter_id)
        try:
            request_id, params = self._admit(request_id, prompt_token_ids, params)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        return request_id, params, lease

    def _admit(self, request_id: str | None, prompt_token_ids: list[int],
               params: SamplingParams) -> tuple[str, SamplingParams]:
        """Checks shared by both entry points: the request id and its params as the engine
        runs them (``LLMEngine.admit``); the request counts as pending (against the queue
        bound) until the engine thread takes it."""
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead}")
        if self._loop is None:
            raise EngineDeadError("engine not started")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._waiters:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.check_queue()
        admitted = self.engine.admit(prompt_token_ids, params)
        with self._lock:
            self._pending_adds += 1
        return request_id, admitted

    async def generate(self, request_id: str | None, prompt_token_ids: list[int],
                       params: SamplingParams,
                       adapter_id: str = "") -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last one has ``finished=True``. ``adapter_id``:
        the LoRA adapter it runs with ('' = the base model)."""
        request_id, params, lease = await self._admit_with_adapter(
            request_id, prompt_token_ids, params, adapter_id)
        queue: asyncio.Queue = asyncio.Queue()
        self._waiters[request_id] = queue
        self._post(("add", (request_id, list(prompt_token_ids), params, None, lease)))
        finished = False
        later: RequestOutput | BaseException | None = None
        try:
            while True:
                item = later if later is not None else await queue.get()
                later = None
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                # a consumer behind the engine gets what piled up as one output
                while not item.finished and not queue.empty():
                    nxt = queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        later = nxt
                        break
                    item.add(nxt)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._waiters.pop(request_id, None)
            if not finished:
                self._post(("abort", request_id))

    async def complete(self, request_id: str | None, prompt_token_ids: list[int],
                       params: SamplingParams,
                       collector: OutputCollector | None = None,
                       adapter_id: str = "") -> OutputCollector:
        """Run a request to its end and return its whole output, waking the caller once.

        ``collector``: one made by the caller, who can then read its ``usage`` even when
        the call is cancelled (the engine thread fills it as steps come out).
        ``adapter_id``: the LoRA adapter it runs with ('' = the base model).
        """
        request_id, params, lease = await self._admit_with_adapter(
            request_id, prompt_token_ids, params, adapter_id)
        if collector is None:
            collector = OutputCollector(request_id, params.n,
                                        Usage(prompt_tokens=len(prompt_token_ids)))
        assert self._loop is not None
        done: asyncio.Future = self._loop.create_future()
        self._waiters[request_id] = done
        self._post(("add", (request_id, list(prompt_token_ids), params, collector, lease)))
        try:
            return await done
        finally:
            self._waiters.pop(request_id, None)
            if not done.done() or done.cancelled():  # the caller gave up: free its KV now
                self._post(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def abort_all(self) -> None:
        """End every request now (finish reason ABORTED): a drain's grace is running out.
        Requests still waiting for an adapter slot end too (UNAVAILABLE), rather than take
        the slots the aborted ones free."""
        for request_id in list(self._waiters):
            self.abort(request_id)
        self._stop_adapter_waits()

    def _stop_adapter_waits(self) -> None:
        """End every wait for an adapter slot (its caller gets EngineDeadError)."""
        if self.engine.adapters is not None:
            for cancel in list(self._adapter_waits):
                self.engine.adapters.stop_waiting(cancel)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def adapter_status(self) -> list[AdapterStatus]:
        """The resident LoRA adapters (none when adapters are off)."""
        return self.engine.adapters.resident() if self.engine.adapters is not None else []

    # ---- the loop thread ------------------------------------------------------------

    def _post(self, item: tuple[str, Any]) -> None:
        self._inbox.append(item)
        self._wakeup.set()

    def _deliver(self, ready: Ready) -> None:
        """On the event loop: one call per engine step, for every request it touched."""
        for request_id, item in ready:
            waiter = self._waiters.get(request_id)
            if waiter is None:  # the caller is gone (cancelled, closed)
                continue
            if isinstance(waiter, asyncio.Queue):
                waiter.put_nowait(item)
            elif not waiter.done():
                if isinstance(item, BaseException):
                    waiter.set_exception(item)
                else:
                    waiter.set_result(item)

    def _drain_inbox(self, ready: Ready) -> None:
        while self._inbox:
            kind, arg = self._inbox.popleft()
            if kind == "abort":
                if arg in self.engine.requests:  # its final (ABORTED) output reaches its
                    self.engine.abort(arg)  # collector with the next step, as any other
                else:
                    self._collectors.pop(arg, None)
                continue
            request_id, prompt, params, collector, lease = arg
            added = False
            if request_id in self._waiters:  # else cancelled before it reached the engine
                try:
                    self.engine.add_admitted(request_id, prompt, params, lease)
                    added = True
                    if collector is not None:
                        self._collectors[request_id] = collector
                except ValueError as e:
                    ready.append((request_id, e))
            if not added and lease is not None:  # the engine never took it
                lease.release()
            with self._lock:
                self._pending_adds -= 1
                self._waiting_snapshot = self.engine.backlog()

    def _route(self, outputs: list[RequestOutput], ready: Ready) -> None:
        """A stream gets every output; a unary request's are merged here and handed over
        once, finished."""
        now = time.perf_counter()
        collectors = self._collectors
        interval = self.config.stream_interval
        for out in outputs:
            collector = collectors.get(out.request_id)
            if collector is None:
                sent = self._hold(out, interval) if interval > 1 else out
                if sent is not None:
                    ready.append((sent.request_id, sent))
                continue
            collector.add(out, now)
            if out.finished:
                del collectors[out.request_id]
                ready.append((out.request_id, collector))

    def _hold(self, out: RequestOutput, interval: int) -> RequestOutput | None:
        """``out`` merged into what its stream holds; None while that stays held: until
        some sequence has ``interval`` new tokens. Never held: the first token (time to
        first token is what a user waits on; an output is the first with tokens when it
        carries all the request has), a finish, prompt logprobs."""
        held = self._held.pop(out.request_id, None)
        if held is not None:
            held.add(out)
            out = held
        tokens = sum(len(d.token_ids) for d in out.deltas)
        if out.finished or out.prompt_logprobs is not None \
                or tokens == out.usage.completion_tokens > 0 \
                or any(len(d.token_ids) >= interval or d.finish_reason is not None
                       for d in out.deltas):
            return out
        self._held[out.request_id] = out
        return None

    def _run(self) -> None:
        assert self._loop is not None
        loop = self._loop
        try:
            runner = self.engine.runner
            while not self._stopping:
                if runner.failure is not None:  # noticed between steps (e.g. while idle)
                    raise WorkerLostError(runner.failure)
                ready: Ready = []
                self._drain_inbox(ready)
                if self.engine.has_work:
                    self._route(self.engine.step(), ready)
                    if self.on_step is not None and self.engine.last_step_tokens:
                        self.on_step(self.engine.last_step_tokens,
                                     self.engine.last_step_seconds,
                                     self.engine.last_step_prefill)
                    with self._lock:
                        self._waiting_snapshot = self.engine.backlog()
                if ready:
                    loop.call_soon_threadsafe(self._deliver, ready)
                elif not self.engine.has_work:
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
        except BaseException as e:  # a bug in the engine: fail every caller loudly
            log.exception("engine loop crashed")
            self._dead = e
            err = EngineDeadError(f"engine loop crashed: {type(e).__name__}: {e}")
            loop.call_soon_threadsafe(self._fail_all, err)

    def _fail_all(self, err: EngineDeadError) -> None:
        """On the event loop, so no caller registers unseen: every waiting caller fails,
        those still waiting for an adapter slot too (UNAVAILABLE, not the slot wait's
        RESOURCE_EXHAUSTED minutes later)."""
        self._stop_adapter_waits()
        self._deliver([(request_id, err) for request_id in list(self._waiters)])
        assert self.died is not None
        self.died.set()
