"""A fast, deterministic stand-in for ``engine.async_engine.AsyncEngine`` (same API).

It lets the service tests run the gRPC layer without a model: sequence ``j`` of a request
emits the prompt's tokens again from offset ``j`` (an echo), one token per step, unless a
logits processor masks that token (processors run on a one-hot logits row, so plugins and
grammars constrain the fake just as they constrain the real engine). It honours
``max_new_tokens``, ``min_new_tokens``, EOS, stop ids, stop strings, time limits, the
``max_num_seqs`` seats, the ``max_waiting`` bound (QueueFullError) and abort on close; KV
blocks are counted as ``ceil(tokens / block_size)`` per running sequence, so tests can
check they are freed. A processor that raises finishes its sequence with
``FinishReason.ERROR``, as in the real engine.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.adapters import AdapterError
from engine.config import EngineConfig, EngineDeadError, ModelInfo, QueueFullError, RequestError
from engine.logits_process import is_factory
from engine.output_collector import OutputCollector, collect
from engine.outputs import (
    CompletionDelta,
    EngineStats,
    FinishReason,
    RequestOutput,
    SpecStats,
    TokenLogprob,
    Usage,
)
from engine.request_limits import context_room
from engine.runners.base import WarmupReport
from engine.sampling_params import SamplingParams

KV_BLOCKS_TOTAL = 4096


@dataclass
class _Seq:
    index: int
    processors: list[tuple[Any, Any]]  # (processor, factory that made it, or None)
    output: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of text already sent
    finish: FinishReason | None = None
    stop_sequence: str | None = None
    error: str | None = None


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seqs: list[_Seq]
    queue: asyncio.Queue
    started: float = field(default_factory=time.monotonic)

    @property
    def live(self) -> list[_Seq]:
        return [s for s in self.seqs if s.finish is None]


class FakeEngine:
    def __init__(self, tokenizer, config: EngineConfig, step_delay_s: float = 0.005) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.info = ModelInfo(model_id="fake-echo", max_model_len=config.max_model_len or 256,
                              vocab_size=len(tokenizer),
                              eos_token_ids=[tokenizer.eos_token_id],
                              quantization="float32")
        self.step_delay_s = step_delay_s
        self._requests: dict[str, _Request] = {}
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.died: asyncio.Event | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, speculator=None) -> FakeEngine:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(config.model), config)

    # ---- lifecycle ------------------------------------------------------------------

    device_type = "cpu"

    def compile(self) -> WarmupReport:
        """Nothing to compile: the fake has no model."""
        return WarmupReport()

    def start(self) -> None:
        self._wakeup = asyncio.Event()
        self.died = asyncio.Event()  # never set: the fake loop does not crash
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    # ---- requests -------------------------------------------------------------------

    def check_queue(self) -> None:
        """QueueFullError when ``max_waiting`` requests wait (AsyncEngine.check_queue)."""
        if len(self._waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams,
                       adapter_id: str = "") -> AsyncIterator[RequestOutput]:
        if not self.is_running:
            raise EngineDeadError("engine not started")
        if adapter_id:  # the fake has no model to adapt (AsyncEngine without --adapter-cache)
            raise AdapterError(adapter_id, "adapters are not enabled on this server "
                               "(--adapter-cache)")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise RequestError("prompt", "the prompt is empty")
        if any(not 0 <= t < self.info.vocab_size for t in prompt_token_ids):
            raise RequestError("vocabulary", "a token id is outside the vocabulary")
        if context_room(len(prompt_token_ids), self.info) < 1:
            raise RequestError("context", f"the prompt has {len(prompt_token_ids)} tokens; "
                               f"the context is {self.info.max_model_len} tokens")
        self.check_queue()
        seqs = [_Seq(j, [(p.create(), p) if is_factory(p) else (p, None)
                         for p in params.logits_processors]) for j in range(params.n)]
        req = _Request(request_id, list(prompt_token_ids), params, seqs, asyncio.Queue())
        self._requests[request_id] = req
        self._waiting.append(req)
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                out = await req.queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._remove(req)

    async def complete(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams,
                       collector: OutputCollector | None = None,
                       adapter_id: str = "") -> OutputCollector:
        """The whole output at once, merged from ``generate`` (AsyncEngine.complete)."""
        if collector is None:
            collector = OutputCollector(request_id, params.n,
                                        Usage(prompt_tokens=len(prompt_token_ids)))
        return await collect(self.generate(request_id, prompt_token_ids, params, adapter_id),
                             collector)

    def adapter_status(self) -> list:
        return []

    def check_adapter(self, adapter_id: str) -> None:
        if adapter_id:
            raise AdapterError(adapter_id, "adapters are not enabled on this server "
                               "(--adapter-cache)")

    def abort_all(self) -> None:
        for request_id in list(self._requests):
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is None:
            return
        deltas = []
        for seq in req.live:
            seq.finish = FinishReason.ABORTED
            deltas.append(CompletionDelta(seq.index, finish_reason=FinishReason.ABORTED))
        req.queue.put_nowait(self._output(req, deltas, finished=True))
        self._remove(req)

    def stats(self) -> EngineStats:
        running = [s for r in self._running for s in r.live]
        used = sum(math.ceil((len(r.prompt) + len(s.output)) / self.config.block_size)
                   for r in self._running for s in r.live)
        return EngineStats(num_running=len(running),
                           num_waiting=sum(len(r.seqs) for r in self._waiting),
                           num_requests=len(self._requests), kv_blocks_total=KV_BLOCKS_TOTAL,
                           kv_blocks_used=used, num_preemptions=0, spec=SpecStats())

    # ---- the step loop --------------------------------------------------------------

    def _remove(self, req: _Request) -> None:
        """Free the request's seat and blocks; hand each processor back exactly once."""
        if self._requests.pop(req.request_id, None) is None:
            return
        for queue in (self._waiting, self._running):
            if req in queue:
                queue.remove(req)
        for seq in req.seqs:
            self._release(seq)

    @staticmethod
    def _release(seq: _Seq) -> None:
        for proc, factory in seq.processors:
            if factory is not None:
                factory.release(proc)
        seq.processors = []

    async def _loop(self) -> None:
        while True:
            if not self._running and not self._waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
            self._admit()
            for req in list(self._running):
                deltas = [self._step(req, seq) for seq in req.live]
                finished = not req.live
                req.queue.put_nowait(self._output(req, deltas, finished))
                if finished:
                    self._remove(req)
            await asyncio.sleep(self.step_delay_s)

    def _admit(self) -> None:
        seats = self.config.max_num_seqs - sum(len(r.live) for r in self._running)
        while self._waiting and (len(self._waiting[0].seqs) <= seats or not self._running):
            req = self._waiting.pop(0)
            self._running.append(req)
            seats -= len(req.seqs)

    def _step(self, req: _Request, seq: _Seq) -> CompletionDelta:
        p = req.params
        token = req.prompt[(len(seq.output) + seq.index) % len(req.prompt)]
        try:
            token = self._process(req, seq, token)
        except Exception as e:
            seq.finish, seq.error = FinishReason.ERROR, f"{type(e).__name__}: {e}"
            self._release(seq)
            return CompletionDelta(seq.index, finish_reason=seq.finish, error=seq.error)
        seq.output.append(token)
        n_out = len(seq.output)
        text = self.tokenizer.decode(seq.output, skip_special_tokens=p.skip_special_tokens)
        if token in p.stop_token_ids and n_out > p.min_new_tokens:
            seq.finish = FinishReason.STOP_TOKEN
        elif token in self.info.eos_token_ids and not p.ignore_eos and n_out > p.min_new_tokens:
            seq.finish = FinishReason.EOS
        elif n_out > p.min_new_tokens and (hit := self._find_stop(text, p)) is not None:
            seq.finish, seq.stop_sequence = FinishReason.STOP_SEQUENCE, hit[1]
            text = text[:hit[0] + (len(hit[1]) if p.include_stop_sequence else 0)]
        elif n_out >= p.max_new_tokens:
            seq.finish = FinishReason.LENGTH
        elif p.time_limit_s is not None and time.monotonic() - req.started >= p.time_limit_s:
            seq.finish = FinishReason.TIME_LIMIT
        rejected = False
        if seq.finish is FinishReason.EOS:  # the engine's finished-output check
            problem = next(filter(None, (f.check_output(text) for _, f in seq.processors
                                         if getattr(f, "check_output", None))), None)
            if problem:
                seq.finish, seq.error, rejected = FinishReason.ERROR, problem, True
        if seq.finish is None:  # hold back what might start a stop string or a UTF-8 char
            text = text[:max(seq.emitted, len(text) - max(0, p.max_stop_len - 1))]
            text = text.rstrip("\ufffd") if len(text) > seq.emitted else text
        else:
            self._release(seq)
        delta = CompletionDelta(seq.index, text=text[seq.emitted:], token_ids=[token],
                                finish_reason=seq.finish, stop_sequence=seq.stop_sequence,
                                error=seq.error, rejected=rejected)
        if p.logprobs:
            delta.logprobs = [TokenLogprob(token, 0.0, [((token + i) % self.info.vocab_size,
                                                         -float(i))
                                                        for i in range(p.top_logprobs)])]
        seq.emitted = max(seq.emitted, len(text))
        return delta

    def _process(self, req: _Request, seq: _Seq, echo: int) -> int:
        """Greedy over a one-hot row favouring ``echo``, after the sequence's processors."""
        if not seq.processors:
            return echo
        # numpy-backed: torch.zeros of a vocab row fans out to (contended) threads
        logits = torch.from_numpy(np.zeros(self.info.vocab_size, dtype=np.float32))
        logits[echo] = 1.0
        for proc, _ in seq.processors:
            logits = proc(req.prompt, seq.output, logits)
        return int(logits.argmax())

    @staticmethod
    def _find_stop(text: str, p: SamplingParams) -> tuple[int, str] | None:
        hits = [(i, s) for s in p.stop if (i := text.find(s)) >= 0]
        return min(hits) if hits else None

    @staticmethod
    def _output(req: _Request, deltas: list[CompletionDelta], finished: bool) -> RequestOutput:
        usage = Usage(prompt_tokens=len(req.prompt),
                      completion_tokens=sum(len(s.output) for s in req.seqs))
        return RequestOutput(req.request_id, req.prompt, deltas, finished, usage)
