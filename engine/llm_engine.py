"""The synchronous engine: add requests, run steps, collect per-step outputs.

One ``step()`` = schedule, one packed forward, per-sequence processors, one vectorised
sample, output processing. Not thread-safe: ``AsyncEngine`` drives it from one thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from dataclasses import dataclass

import torch

from engine.config import EngineConfig, ModelInfo, QueueFullError
from engine.detokenizer import IncrementalDetokenizer
from engine.logits_process import is_factory
from engine.model_runner import DecodeRow, ModelRunner, PrefillWork
from engine.outputs import FinishReason, RequestOutput, TokenLogprob, Usage
from engine.processors import ProcessorRunner
from engine.sampler import Sampler, SamplingMetadata
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import Request, SeqStatus, Sequence
from engine.stop_checker import OutputState

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_requests: int
    kv_blocks_total: int
    kv_blocks_used: int
    num_preemptions: int

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / max(1, self.kv_blocks_total)


class LLMEngine:
    def __init__(self, config: EngineConfig, share_weights: LLMEngine | None = None) -> None:
        self.config = config
        self.runner: ModelRunner = ModelRunner(
            config, share_weights.runner if share_weights else None)
        self.tokenizer = self.runner.tokenizer
        self.info = ModelInfo(
            model_id=self.runner.model_id,
            max_model_len=self.runner.max_model_len,
            vocab_size=self.runner.vocab_size,
            eos_token_ids=self.runner.eos_token_ids(),
        )
        self._eos = set(self.info.eos_token_ids)
        self.scheduler = Scheduler(self.runner.allocator, config.block_size,
                                   config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler()
        self.processor_runner = ProcessorRunner(self._overlap_prepare())
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._touched: dict[str, Request] = {}

    def _overlap_prepare(self) -> bool:
        if self.config.overlap_prepare is not None:
            return self.config.overlap_prepare
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        return self.runner.device.type == "cuda" or cores > torch.get_num_threads()

    # ---- requests -------------------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Validate what the engine itself must guarantee; return the max new tokens."""
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.info.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: id {bad[0]} is outside the vocabulary "
                             f"[0, {self.info.vocab_size})")
        room = self.info.max_model_len - len(prompt_token_ids)
        if room < 1:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; the context is "
                             f"{self.info.max_model_len} tokens")
        max_new = min(params.max_new_tokens, room)
        capacity = self.runner.allocator.num_blocks * self.config.block_size
        if len(prompt_token_ids) + max_new > capacity:
            raise ValueError(
                f"prompt + max_new_tokens ({len(prompt_token_ids) + max_new} tokens) "
                f"exceeds the KV cache ({capacity} tokens)"
            )
        return max_new

    def num_waiting_requests(self) -> int:
        return len({s.request.request_id for s in self.scheduler.waiting})

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        max_new = self.check_request(prompt_token_ids, params)
        if self.num_waiting_requests() >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        req = Request(request_id, list(prompt_token_ids), params)
        if params.time_limit_s is not None:
            req.deadline = req.arrival_time + params.time_limit_s
        req.usage = Usage(prompt_tokens=len(prompt_token_ids))
        self.requests[request_id] = req
        for i in range(params.n):
            seq = self._new_sequence(req, i, max_new)
            req.sequences.append(seq)
            if not seq.is_finished:
                self.scheduler.add(seq)
        return req

    def _new_sequence(self, req: Request, index: int, max_new: int) -> Sequence:
        params = req.params
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                       params.skip_special_tokens)
        seq = Sequence(next(self._seq_ids), req, index, req.prompt_token_ids,
                       OutputState(params, detok, self._eos, max_new))
        if params.seed is not None:
            seq.generator = torch.Generator(self.runner.device).manual_seed(params.seed + index)
        try:
            for p in params.logits_processors:
                if is_factory(p):
                    seq.processors.append((p.create(), p))
                else:
                    seq.processors.append((p, None))
        except Exception as e:  # a failing factory fails only this sequence
            self._fail(seq, e)
        return seq

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        for seq in req.sequences:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORTED)

    # ---- finishing ------------------------------------------------------------------

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """End a sequence for an external reason: flush text, free blocks, release state."""
        res = seq.output.finish(reason)
        delta = seq.delta()
        delta.text += res.text
        self._close(seq, reason, None, error)

    def _close(self, seq: Sequence, reason: FinishReason, stop: str | None,
               error: str | None) -> None:
        delta = seq.delta()
        delta.finish_reason = reason
        delta.stop_sequence = stop
        delta.error = error
        seq.finish_reason = reason
        seq.status = SeqStatus.FINISHED
        self.scheduler.remove(seq)
        owned, seq.processors = seq.processors, []
        for product, factory in owned:
            if factory is None:
                continue
            try:
                factory.release(product)
            except Exception:
                log.exception("request %s: releasing a processor failed", seq.request.request_id)
        self._touched[seq.request.request_id] = seq.request

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        msg = f"logits processor failed: {type(exc).__name__}: {exc}"
        log.error("request %s seq %d: %s", seq.request.request_id, seq.index, msg,
                  exc_info=exc)
        self._finish(seq, FinishReason.ERROR, msg)

    def _check_time_limits(self) -> None:
        now = time.monotonic()
        for req in self.requests.values():
            if req.deadline is not None and now >= req.deadline:
                for seq in req.sequences:
                    if not seq.is_finished:
                        self._finish(seq, FinishReason.TIME_LIMIT)

    # ---- stepping -------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        self._check_time_limits()
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            self._run(sched.scheduled)
        return self._collect()

    def _run(self, scheduled: list[ScheduledSeq]) -> None:
        decodes: list[DecodeRow] = []
        prefills: list[PrefillWork] = []
        decode_seqs: list[Sequence] = []
        prefill_seqs: list[Sequence] = []
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            if s.num_tokens == 1 and s.samples:
                decodes.append(DecodeRow(seq.token_at(start), start, seq.block_table))
                decode_seqs.append(seq)
            else:
                prefills.append(PrefillWork(seq.tokens(start, start + s.num_tokens), start,
                                            seq.block_table, s.samples))
                if s.samples:
                    prefill_seqs.append(seq)
        seqs = decode_seqs + prefill_seqs
        # Batched processors prepare (e.g. grammar bitmasks) while the forward runs.
        prepared = (self.processor_runner.prepare(seqs)
                    if any(s.processors for s in seqs) else None)
        logits = self.runner.execute(decodes, prefills)
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_tokens
        alive = torch.ones(len(seqs), dtype=torch.bool)
        if prepared is not None:
            for i, exc in self.processor_runner.apply(prepared, logits).items():
                self._fail(seqs[i], exc)
                alive[i] = False
        self._sample(seqs, logits, alive)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, alive: torch.Tensor) -> None:
        if not alive.all():
            keep = alive.nonzero().squeeze(1)
            seqs = [s for s, a in zip(seqs, alive.tolist(), strict=True) if a]
            logits = logits[keep.to(logits.device)]
        if not seqs:
            return
        banned = [self._banned(s) for s in seqs]
        for i, seq in enumerate(seqs):
            # min_new_tokens bans EOS/stop ids, but never every token a processor left open
            # (a grammar that can only end): the processor's end wins over the minimum.
            if banned[i] and seq.processors:
                finite = torch.isfinite(logits[i])
                if int(finite.sum()) <= int(finite[banned[i]].sum()):
                    banned[i] = []
                    seq.output.min_new_tokens = 0
        meta = SamplingMetadata.build(
            [s.request.params for s in seqs],
            [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            [s.generator for s in seqs],
            banned,
            logits.device,
        )
        out = self.sampler(logits, meta)
        token_ids = out.token_ids.tolist()
        for i, seq in enumerate(seqs):
            self._emit(seq, [token_ids[i]], out, i)

    def _banned(self, seq: Sequence) -> list[int]:
        params = seq.request.params
        if len(seq.output_token_ids) >= seq.output.min_new_tokens:
            return []
        banned = list(params.stop_token_ids)
        if not params.ignore_eos:
            banned.extend(self._eos)
        return banned

    def _emit(self, seq: Sequence, token_ids: list[int], out, row: int) -> None:
        res = seq.output.append(token_ids)
        seq.output_token_ids.extend(res.token_ids)
        seq.request.usage.completion_tokens += len(res.token_ids)
        delta = seq.delta()
        delta.text += res.text
        delta.token_ids.extend(res.token_ids)
        params = seq.request.params
        if res.token_ids and (params.logprobs or params.top_logprobs):
            k = params.top_logprobs
            top = []
            if k:
                ids = out.top_token_ids[row, :k].tolist()
                lps = out.top_logprobs[row, :k].tolist()
                top = list(zip(ids, lps, strict=True))
            delta.logprobs.append(TokenLogprob(res.token_ids[0], float(out.logprobs[row]), top))
        self._touched[seq.request.request_id] = seq.request
        if res.finish_reason is not None:
            self._close(seq, res.finish_reason, res.stop_sequence, None)

    def _collect(self) -> list[RequestOutput]:
        outputs = []
        for req in self._touched.values():
            deltas = [s.pending for s in req.sequences if s.pending is not None]
            for s in req.sequences:
                s.pending = None
            finished = req.is_finished
            if finished:
                self.requests.pop(req.request_id, None)
            outputs.append(RequestOutput(req.request_id, req.prompt_token_ids, deltas,
                                         finished, dataclasses.replace(req.usage)))
        self._touched.clear()
        return outputs

    def stats(self) -> EngineStats:
        alloc = self.runner.allocator
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_requests=len(self.requests),
            kv_blocks_total=alloc.num_blocks,
            kv_blocks_used=alloc.num_used,
            num_preemptions=self.scheduler.num_preemptions,
        )
