"""The synchronous engine: add requests, run steps, collect per-step outputs.

One ``step()``: schedule, propose, execute, process, verify, emit. Every sampled sequence
owns ``1 + m`` logits rows (``m`` speculative proposals, usually 0); one verifier turns
them into emitted tokens, sampling as usual where ``m = 0``. The KV of accepted proposals
is already in the cache after the forward, so the sequence's computed count moves past
them and its next step is a plain decode that may speculate again. Not thread-safe:
``AsyncEngine`` drives it from one thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch

from engine.adapters import AdapterLease, AdapterRegistry
from engine.config import EngineConfig, ModelInfo
from engine.counter_rng import random_key, stream_key
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import root_hash
from engine.logits_process import RequestSpecError, bind
from engine.outputs import EngineStats, FinishReason, RequestOutput, SpecStats, TokenLogprob, Usage
from engine.processors import ProcessorRunner, overlap_pays
from engine.request_limits import admit, past_time_limit
from engine.runners.base import Runner
from engine.runners.select import create_runner
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.sampling_rows import greedy_rows, sampling_rows
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import Request, SeqStatus, Sequence
from engine.speculation import SpeculatorFactory
from engine.step_layout import Entry, RowView, StepLayout
from engine.stop_checker import OutputState

log = logging.getLogger(__name__)


def long_prefill_threshold(config: EngineConfig, runner: Runner) -> int:
    """``config.long_prefill_token_threshold``, None chosen for the runner (measured on a
    2-core CPU, see EngineConfig): short steps where a prefill token is dear."""
    if config.long_prefill_token_threshold is not None:
        return config.long_prefill_token_threshold
    if runner.device.type != "cpu":
        return 0
    if runner.name == "llamacpp" and getattr(runner, "handoff", None) is None:
        return 128
    # the torch runner, and llama.cpp's long prompts prefilled in torch (128-token chunks
    # cost torch ~25% of its prefill speed there, 256 ~10%)
    return 256


class LLMEngine:
    def __init__(self, config: EngineConfig, share_weights: LLMEngine | None = None,
                 speculator: SpeculatorFactory | None = None) -> None:
        """``share_weights``: reuse another engine's loaded model; ``speculator``: builds
        the speculative decoder from the target's runner (``specdecode.speculator_for``)."""
        if not config.max_num_batched_tokens:
            config = dataclasses.replace(config,
                                         max_num_batched_tokens=config.step_token_budget())
        self.config = config
        self.runner: Runner = create_runner(
            config, share_weights.runner if share_weights else None)
        # a runner may hold fewer sequences than asked (llama.cpp's KV streams under
        # --batch-invariant: what the KV budget holds); the scheduler runs that many
        held = getattr(self.runner, "max_num_seqs", config.max_num_seqs)
        if held < config.max_num_seqs:
            self.config = config = dataclasses.replace(config, max_num_seqs=held)
        self.tokenizer = self.runner.tokenizer
        self.info = ModelInfo(model_id=self.runner.model_id,
                              max_model_len=self.runner.max_model_len,
                              vocab_size=self.runner.vocab_size,
                              eos_token_ids=self.runner.eos_token_ids(),
                              runner=self.runner.name,
                              quantization=self.runner.quantization)
        self._eos = set(self.info.eos_token_ids)
        caching = config.enable_prefix_caching and self.runner.supports_prefix_caching
        if config.enable_prefix_caching and not caching:
            log.info("prefix caching: not supported by the %s runner; off", self.runner.name)
        self.scheduler = Scheduler(self.runner.num_blocks, config.block_size,
                                   config.max_num_seqs, config.max_num_batched_tokens,
                                   on_free=lambda seq: self.runner.release(seq.seq_id),
                                   long_prefill_token_threshold=long_prefill_threshold(
                                       config, self.runner),
                                   max_long_partial_prefills=config.max_long_partial_prefills,
                                   prefix_caching=caching,
                                   keeper=self.runner.block_keeper,
                                   mixed_adapters=self.runner.supports_mixed_adapters
                                   or not config.adapter_cache)
        self.info.prefix_caching = caching
        self.sampler = Sampler()
        self.processor_runner = ProcessorRunner(
            config.overlap_prepare if config.overlap_prepare is not None
            else overlap_pays(self.runner.device))
        self.speculator = speculator(self.runner) if speculator is not None else None
        if self.speculator is not None:
            self.info.spec_method, self.info.spec_k = self.speculator.method, self.speculator.k
            self.runner.max_rows_per_seq = self.speculator.k + 1  # batch expansion's rows
        # LoRA adapters by id (--adapter-cache); None = adapters off
        self.adapters = (AdapterRegistry(config.adapter_cache, config.max_loras,
                                         config.max_lora_rank, self.runner,
                                         config.max_lora_wait_s)
                         if config.adapter_cache else None)
        self.info.max_loras = config.max_loras if self.adapters is not None else 0
        if self.adapters is not None and self.runner.max_loras < 1:
            log.warning("--adapter-cache: the %s runner cannot serve LoRA adapters; requests "
                        "naming one are refused", self.runner.name)
        self.requests: dict[str, Request] = {}
        self.last_step_tokens = 0  # tokens the last step computed (iteration-tokens metric)
        self.last_step_seconds = 0.0  # how long it took (TGIS's batch inference duration)
        self.last_step_prefill = False  # it computed prompt tokens (not decodes only)
        self._seq_ids = itertools.count()
        self._touched: dict[str, Request] = {}  # requests with output to collect

    # ---- requests -------------------------------------------------------------------

    def admit(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """What only the engine knows (vocabulary, context, KV capacity): ``params`` as the
        engine runs them (``request_limits.admit``), or ``RequestError``."""
        return admit(prompt_token_ids, params, self.info, self.scheduler.capacity)

    def num_waiting_requests(self) -> int:
        return len({s.request.request_id for s in self.scheduler.waiting})

    def backlog(self) -> int:
        """Waiting requests beyond the running seats free now (negative: seats to spare).
        Requests the next step takes at once (a burst arriving between two steps) do not
        count against ``max_waiting`` (``AsyncEngine`` bounds the queue by this)."""
        free = max(0, self.config.max_num_seqs - len(self.scheduler.running))
        return self.num_waiting_requests() - free

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, adapter: AdapterLease | None = None) -> Request:
        """Admit (``admit``) and queue a request."""
        return self.add_admitted(request_id, prompt_token_ids,
                                 self.admit(prompt_token_ids, params), adapter)

    def add_admitted(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, adapter: AdapterLease | None = None) -> Request:
        """Queue a request whose ``params`` came from ``admit`` (checked once, on the
        caller's side, so a bad request never reaches the engine thread). ``adapter``:
        its LoRA adapter's lease (``self.adapters.acquire``), released when it finishes;
        the caller's to release if this raises."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        req = Request(request_id, list(prompt_token_ids), params,
                      usage=Usage(prompt_tokens=len(prompt_token_ids)), adapter=adapter,
                      cache_root=root_hash(adapter.fingerprint if adapter else None))
        if params.time_limit_s is not None:
            req.deadline = req.arrival_time + params.time_limit_s
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = []
        self.requests[request_id] = req
        for i in range(params.n):
            detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                           params.skip_special_tokens)
            key = stream_key(params.seed, i) if params.seed is not None else random_key()
            seq = Sequence(next(self._seq_ids), req, i, req.prompt_token_ids,
                           OutputState(params, detok, self._eos), sampling_key=key)
            req.sequences.append(seq)
            try:
                for p in params.logits_processors:  # one by one: _close releases what exists
                    seq.processors.append(bind(p))
            except Exception as e:  # a failing factory fails only this sequence
                self._fail(seq, e)
                continue
            if any(b.check is not None for b in seq.processors):
                seq.checked_text = []
            self.scheduler.add(seq)
        return req

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)  # out of the request count at once
        if req is None:
            return
        for seq in req.sequences:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORTED)

    # ---- finishing ------------------------------------------------------------------

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """End a sequence for an external reason: flush text, free blocks, release state."""
        seq.delta().text += seq.output.finish(reason).text
        self._close(seq, reason, None, error)

    def _close(self, seq: Sequence, reason: FinishReason, stop: str | None,
               error: str | None) -> None:
        delta = seq.delta()
        delta.finish_reason, delta.stop_sequence, delta.error = reason, stop, error
        seq.finish_reason = reason
        seq.status = SeqStatus.FINISHED
        self.scheduler.remove(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        owned, seq.processors = seq.processors, []
        for bound in owned:
            if bound.factory is None:
                continue
            try:
                bound.factory.release(bound.processor)
            except Exception:
                log.exception("request %s: releasing a processor failed", seq.request.request_id)
        self._touched[seq.request.request_id] = seq.request

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        if isinstance(exc, RequestSpecError):  # the request's fault: no traceback
            log.warning("request %s seq %d: %s%s", seq.request.request_id, seq.index,
                        f"{exc.field}: " if exc.field else "", exc)
            seq.delta().invalid_field = exc.field
            self._finish(seq, FinishReason.ERROR, str(exc))
            return
        msg = f"logits processor failed: {type(exc).__name__}: {exc}"
        log.error("request %s seq %d: %s", seq.request.request_id, seq.index, msg,
                  exc_info=exc)
        self._finish(seq, FinishReason.ERROR, msg)

    # ---- stepping -------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.requests or self._touched)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        for seq in past_time_limit(self.requests.values(), time.monotonic()):
            self._finish(seq, FinishReason.TIME_LIMIT)
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        self.last_step_tokens = sum(s.num_tokens for s in scheduled)
        self.last_step_prefill = any(s.num_tokens > 1 or not s.samples for s in scheduled)
        if scheduled:
            now = time.monotonic()
            for s in scheduled:
                if s.seq.request.times.first_scheduled is None:
                    s.seq.request.times.first_scheduled = now
            layout = StepLayout.build(scheduled, self._propose(scheduled), self.speculator)
            prepared = (self.processor_runner.prepare(layout.views)
                        if any(v.seq.processors for v in layout.views) else None)
            logits = self.runner.execute(layout.decodes, layout.prefills)
            if layout.prompt_rows:
                layout.record_prompt_logprobs(logits[len(layout.views):])
                logits = logits[:len(layout.views)]
            failed = self.processor_runner.apply(prepared, logits) if prepared else {}
            empty = (self.processor_runner.empty_rows(prepared, logits, failed)
                     if prepared else {})
            for entry in layout.entries:
                entry.seq.num_computed_tokens += entry.num_tokens
                if any(r in failed for r in entry.rows) and not entry.seq.is_finished:
                    self._fail(entry.seq, next(failed[r] for r in entry.rows if r in failed))
            live = [e for e in layout.sampled if not e.seq.is_finished]
            emitted = self._verify(live, layout.views, logits)
            logprobs = layout.logprobs(live, emitted, logits)
            for entry, tokens, lps in zip(live, emitted, logprobs, strict=True):
                # a token drawn from an empty row (nothing allowed) ends the sequence there
                cut = next((k for k, r in enumerate(entry.rows[:len(tokens)]) if r in empty),
                           None)
                if cut is not None:
                    tokens, lps = tokens[:cut], lps[:cut] if lps else lps
                if tokens:
                    # accepted proposals are in the cache already: never computed again
                    entry.seq.num_computed_tokens += len(tokens) - 1
                    self._emit(entry.seq, tokens, lps)
                if cut is not None and not entry.seq.is_finished:
                    self._fail(entry.seq, empty[entry.rows[cut]])
            for entry in layout.entries:
                if not entry.seq.is_finished:
                    self.scheduler.cache_blocks(entry.seq)
        self.last_step_seconds = time.perf_counter() - start
        return self._collect()

    def _propose(self, scheduled: list[ScheduledSeq]) -> dict[int, list[int]]:
        """Proposals by sequence id for this step's decodes, with KV blocks reserved and
        trimmed to what each sequence may accept."""
        spec = self.speculator
        seqs = [s.seq for s in scheduled if s.samples and s.num_tokens == 1]
        if spec is None or not seqs:
            return {}
        budgets = spec.budgets(seqs, len(self.scheduler.running))
        budgets = [b if b and self.scheduler.reserve(s, s.num_tokens + b) else 0
                   for s, b in zip(seqs, budgets, strict=True)]
        if not any(budgets):
            return {}
        proposed = spec.propose(seqs, budgets)
        return {s.seq_id: p for s, p in zip(seqs, map(self._allowed, seqs, proposed),
                                            strict=True) if p}

    def _allowed(self, seq: Sequence, proposals: list[int]) -> list[int]:
        """The leading proposals that can follow: none at or past an end token (the rows
        after it would score an ended sequence) and none a grammar refuses."""
        ends = self._eos.union(seq.request.params.stop_token_ids)
        n = next((j for j, t in enumerate(proposals) if t in ends), len(proposals))
        for bound in seq.processors:
            if bound.validator is not None and n:
                try:
                    n = min(n, bound.validator.validate_proposals(seq.output_token_ids,
                                                                  proposals[:n]))
                except Exception:  # the step's processing will surface a broken processor
                    n = 0
        return proposals[:n]

    def _verify(self, entries: list[Entry], views: list[RowView],
                logits: torch.Tensor) -> list[list[int]]:
        """Each entry's emitted tokens: a sample from its one row, or (with proposals) the
        speculator's verdict over its ``1 + m`` rows."""
        emitted: list[list[int]] = [[] for _ in entries]
        plain = [i for i, e in enumerate(entries) if not e.proposals]
        spec = [i for i, e in enumerate(entries) if e.proposals]
        if plain:
            rows = [entries[i].rows.start for i in plain]
            if all(p.greedy and not p.penalized
                   for p in (entries[i].seq.request.params for i in plain)):
                tokens = greedy_rows(rows, views, logits, self._eos)
            else:
                meta, sub = sampling_rows(rows, views, logits, self._eos)
                tokens = self.sampler(sub, meta, logprobs=False).token_ids.tolist()
            for i, t in zip(plain, tokens, strict=True):
                emitted[i] = [t]
        if spec:
            assert self.speculator is not None
            rows = [r for i in spec for r in entries[i].rows]
            meta, sub = sampling_rows(rows, views, logits, self._eos)
            verdict = self.speculator.verify([entries[i].seq for i in spec],
                                             [entries[i].proposals for i in spec], sub, meta)
            for i, tokens in zip(spec, verdict, strict=True):
                emitted[i] = tokens
        return emitted

    def _emit(self, seq: Sequence, token_ids: list[int],
              logprobs: list[TokenLogprob] | None) -> None:
        res = seq.output.append(token_ids)
        if seq.request.times.first_token is None:
            seq.request.times.first_token = time.monotonic()
        seq.output_token_ids.extend(res.token_ids)
        seq.request.usage.completion_tokens += len(res.token_ids)
        delta = seq.delta()
        delta.text += res.text
        delta.token_ids.extend(res.token_ids)
        if logprobs:
            delta.logprobs.extend(logprobs[:len(res.token_ids)])
        self._touched[seq.request.request_id] = seq.request
        if seq.checked_text is not None:
            seq.checked_text.append(res.text)
        if res.finish_reason is FinishReason.EOS and seq.checked_text is not None:
            problem = self._check_output(seq, "".join(seq.checked_text))
            if problem is not None:
                delta.rejected = True
                self._close(seq, FinishReason.ERROR, None, problem)
                return
        if res.finish_reason is not None:
            self._close(seq, res.finish_reason, res.stop_sequence, None)

    @staticmethod
    def _check_output(seq: Sequence, text: str) -> str | None:
        """The first problem a processor's finished-output check finds in ``text``."""
        for bound in seq.processors:
            if bound.check is None:
                continue
            try:
                problem = bound.check(text)
            except Exception as e:  # a broken check: say so rather than pass the output
                log.exception("request %s: an output check failed", seq.request.request_id)
                problem = f"the output check failed: {type(e).__name__}: {e}"
            if problem:
                return problem
        return None

    def _collect(self) -> list[RequestOutput]:
        outputs = []
        for req in self._touched.values():
            deltas = [s.pending for s in req.sequences if s.pending is not None]
            for s in req.sequences:
                s.pending = None
            if req.is_finished:
                self.requests.pop(req.request_id, None)
                req.times.finished = time.monotonic()
                if req.adapter is not None:
                    req.adapter.release()
            out = RequestOutput(req.request_id, req.prompt_token_ids, deltas, req.is_finished,
                                dataclasses.replace(req.usage))
            if req.prompt_logprobs_ready:
                out.prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
            if req.is_finished:
                out.times = req.times
            outputs.append(out)
        self._touched.clear()
        return outputs

    def stats(self) -> EngineStats:
        alloc = self.scheduler.allocator
        spec = self.speculator.stats if self.speculator is not None else SpecStats()
        running = {s.request.request_id for s in list(self.scheduler.running)}
        waiting = {s.request.request_id for s in list(self.scheduler.waiting)} - running
        return EngineStats(num_running=len(self.scheduler.running),
                           num_waiting=len(self.scheduler.waiting),
                           num_requests_running=len(running), num_requests_waiting=len(waiting),
                           num_requests=len(self.requests), kv_blocks_total=alloc.num_blocks,
                           kv_blocks_used=alloc.num_used,
                           num_preemptions=self.scheduler.num_preemptions,
                           spec=dataclasses.replace(spec),
                           prefix_cache_queries=alloc.stats.queries,
                           prefix_cache_hits=alloc.stats.hits,
                           prefix_cache_blocks=alloc.num_cached,
                           prefix_cache_host_bytes=(self.scheduler.keeper.host_bytes
                                                    if self.scheduler.keeper else 0),
                           num_adapter_waiting=(self.adapters.waiting
                                                if self.adapters is not None else 0))
