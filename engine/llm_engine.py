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
from engine.sampler import Sampler, SamplingMetadata, apply_penalties, compute_probs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import Request, SeqStatus, Sequence
from engine.stop_checker import OutputState
from specdecode.batch_expansion import contract, expand, multi_token, row_views
from specdecode.proposals import Proposals
from specdecode.rejection import rejection_sample, verify_greedy

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_requests: int
    kv_blocks_total: int
    kv_blocks_used: int
    num_preemptions: int
    # Speculative decoding, cumulative since start: steps that speculated, tokens proposed,
    # proposals accepted, tokens emitted by those steps (accepted + one bonus per sequence).
    spec_steps: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / max(1, self.kv_blocks_total)


@dataclass
class SpecStats:
    steps: int = 0  # verification passes (one per step that speculated)
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0


def _rows_of(i: int, lengths: list[int]) -> range:
    first = sum(lengths[:i]) + i
    return range(first, first + lengths[i] + 1)


def _per_seq(alive: torch.Tensor, lengths: list[int]) -> list[bool]:
    """A sequence lives only if every one of its expanded rows does."""
    flags = alive.tolist()
    return [all(flags[r] for r in _rows_of(i, lengths)) for i in range(len(lengths))]


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
        self.spec_stats = SpecStats()
        self.speculator = None
        if config.speculative.method:
            from specdecode.worker import Speculator  # only when speculation is configured

            self.speculator = Speculator(config, self.runner)
            self.info.spec_method = config.speculative.method
            self.info.spec_k = config.speculative.num_spec_tokens

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
        # gone from the request count at once (gauges, queue bounds); its last output
        # still goes out with the next step's collection
        self.requests.pop(request_id, None)

    # ---- finishing ------------------------------------------------------------------

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """End a sequence for an external reason: flush text, free blocks, release state."""
        res = seq.output.finish(reason)
        delta = seq.delta()
        delta.text += res.text
        self._close(seq, reason, None, error)

    def _close(self, seq: Sequence, reason: FinishReason, stop: str | None,
               error: str | None) -> None:
        if self.speculator is not None:
            self.speculator.release(seq)
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
        return bool(self.requests or self._touched)

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
        proposals = self._propose(decode_seqs)
        rows: list = decode_seqs + prefill_seqs  # what each logits row's processors see
        if proposals is not None:
            assert self.speculator is not None
            decodes, rows, scoring = [], [], []
            for seq, props in zip(decode_seqs, proposals.token_ids, strict=True):
                if self.speculator.multi_token:  # logits come back in the same order
                    scoring.append(multi_token(seq, props))
                else:
                    decodes.extend(expand(seq, props))
                rows.extend(row_views(seq, props) if props else [seq])
            rows.extend(prefill_seqs)
            prefills = scoring + prefills
        # Batched processors prepare (e.g. grammar bitmasks) while the forward runs.
        prepared = (self.processor_runner.prepare(rows)
                    if any(r.processors for r in rows) else None)
        logits = self.runner.execute(decodes, prefills)
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_tokens
        alive = torch.ones(len(rows), dtype=torch.bool)
        if prepared is not None:
            for i, exc in self.processor_runner.apply(prepared, logits).items():
                alive[i] = False
                seq = rows[i] if isinstance(rows[i], Sequence) else rows[i].seq
                if not seq.is_finished:
                    self._fail(seq, exc)
        if proposals is None:
            self._sample(decode_seqs + prefill_seqs, logits, alive)
            return
        # Sequences with proposals are verified; the rest sample one token as usual.
        plain_rows: list[int] = []
        spec_rows: list[int] = []
        spec_seqs: list[Sequence] = []
        spec_props: list[list[int]] = []
        row = 0
        for seq, props in zip(decode_seqs, proposals.token_ids, strict=True):
            n = len(props) + 1
            if props:
                spec_rows.extend(range(row, row + n))
                spec_seqs.append(seq)
                spec_props.append(props)
            else:
                plain_rows.append(row)
            row += n
        plain_rows.extend(range(row, row + len(prefill_seqs)))
        plain_seqs = [s for s, p in zip(decode_seqs, proposals.token_ids, strict=True)
                      if not p] + prefill_seqs
        if plain_seqs:
            index = torch.tensor(plain_rows)
            self._sample(plain_seqs, logits[index.to(logits.device)], alive[index])
        if spec_seqs:
            q = None
            if proposals.probs is not None:
                which = [i for i, p in enumerate(proposals.token_ids) if p]
                q = proposals.probs[torch.tensor(which, device=proposals.probs.device)]
            index = torch.tensor(spec_rows)
            self._verify(spec_seqs, spec_props, q, logits[index.to(logits.device)],
                         alive[index])

    def _propose(self, seqs: list[Sequence]) -> Proposals | None:
        """Proposals for this step's decodes, trimmed by each sequence's grammar and the
        KV blocks free; None when nothing is proposed (speculation off or no guesses)."""
        spec = self.speculator
        if spec is None or not seqs or len(self.scheduler.running) > spec.disable_batch_size:
            return None
        proposals = spec.propose(seqs)
        for i, seq in enumerate(seqs):
            props = proposals.token_ids[i]
            # Never propose past an end token: the rows after it would score a sequence
            # that has ended (and a grammar cannot step beyond its end).
            ends = self._eos.union(seq.request.params.stop_token_ids)
            cut = next((j for j, t in enumerate(props) if t in ends), None)
            if cut is not None:
                proposals.truncate(i, cut)
            if not props:
                continue
            for product, _ in seq.processors:
                validate = getattr(product, "validate_proposals", None)
                if validate is not None and props:
                    try:
                        proposals.truncate(i, validate(seq.output_token_ids, props))
                    except Exception:  # the real step will surface a broken processor
                        proposals.truncate(i, 0)
            if props and not self.scheduler.ensure_blocks(seq, seq.num_tokens + len(props)):
                proposals.truncate(i, 0)
        return proposals if proposals.num_tokens else None

    def _row_bans(self, seq: Sequence, logits: torch.Tensor, extra: int) -> list[int]:
        """EOS / stop ids banned while min_new_tokens is unmet (``extra`` tokens ahead of
        the emitted output), but never every token a processor left open (a grammar that
        can only end): the processor's end wins over the minimum."""
        banned = self._banned(seq, extra)
        if banned and seq.processors:
            finite = torch.isfinite(logits)
            if int(finite.sum()) <= int(finite[banned].sum()):
                seq.output.min_new_tokens = 0
                return []
        return banned

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, alive: torch.Tensor) -> None:
        if not alive.all():
            keep = alive.nonzero().squeeze(1)
            seqs = [s for s, a in zip(seqs, alive.tolist(), strict=True) if a]
            logits = logits[keep.to(logits.device)]
        if not seqs:
            return
        banned = [self._row_bans(s, logits[i], 0) for i, s in enumerate(seqs)]
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
            lps = None
            if out.logprobs is not None:
                k = seq.request.params.top_logprobs
                top = []
                if k and out.top_token_ids is not None and out.top_logprobs is not None:
                    top = list(zip(out.top_token_ids[i, :k].tolist(),
                                   out.top_logprobs[i, :k].tolist(), strict=True))
                lps = [TokenLogprob(token_ids[i], float(out.logprobs[i]), top)]
            self._emit(seq, [token_ids[i]], lps)

    def _verify(self, seqs: list[Sequence], proposals: list[list[int]], q: torch.Tensor | None,
                logits: torch.Tensor, alive: torch.Tensor) -> None:
        """Score each sequence's ``m + 1`` rows (grouped in ``logits``) and emit the accepted
        proposals plus the bonus token. Every row gets the sampling treatment of its own
        prefix: penalties over output + the proposals before it, min-token bans."""
        lengths = [len(p) for p in proposals]
        dead = {i for i, ok in enumerate(_per_seq(alive, lengths)) if not ok}
        if dead:
            keep = [i for i in range(len(seqs)) if i not in dead]
            rows = torch.tensor([r for i in keep for r in _rows_of(i, lengths)])
            seqs = [seqs[i] for i in keep]
            proposals = [proposals[i] for i in keep]
            q = None if q is None else q[torch.tensor(keep, device=q.device)]
            lengths = [lengths[i] for i in keep]
            logits = logits[rows.to(logits.device)]
            if not seqs:
                return
        params, prompts, outputs, banned = [], [], [], []
        row = 0
        for seq, props in zip(seqs, proposals, strict=True):
            for j in range(len(props) + 1):
                params.append(seq.request.params)
                prompts.append(seq.prompt_token_ids)
                outputs.append(seq.output_token_ids + props[:j])
                banned.append(self._row_bans(seq, logits[row], j))
                row += 1
        # The verification draws its randomness itself (the sequences' generators).
        meta = SamplingMetadata.build(params, prompts, outputs, [None] * row, banned,
                                      logits.device)
        draft = torch.tensor([p + [0] * (max(lengths) - len(p)) for p in proposals])
        lens = torch.tensor(lengths)
        if meta.all_greedy:
            target = apply_penalties(logits.float(), meta).argmax(-1)
            verified = verify_greedy(contract(target, lengths).cpu(), draft, lens)
        else:
            probs = contract(compute_probs(logits, meta), lengths)
            verified = rejection_sample(probs, draft, lens, q, [s.generator for s in seqs])
        logprobs = self._spec_logprobs(seqs, logits, lengths, verified.token_ids, meta)
        self.spec_stats.steps += 1
        for i, seq in enumerate(seqs):
            usage = seq.request.usage
            usage.spec_proposed_tokens += lengths[i]
            usage.spec_accepted_tokens += verified.num_accepted[i]
            self.spec_stats.proposed += lengths[i]
            self.spec_stats.accepted += verified.num_accepted[i]
            self.spec_stats.emitted += len(verified.token_ids[i])
            if self.speculator is not None:
                self.speculator.observe(seq, verified.num_accepted[i])
            self._emit(seq, verified.token_ids[i], logprobs[i] if logprobs else None)

    @staticmethod
    def _spec_logprobs(seqs: list[Sequence], logits: torch.Tensor, lengths: list[int],
                       emitted: list[list[int]], meta: SamplingMetadata
                       ) -> list[list[TokenLogprob]] | None:
        """Raw-distribution logprobs of every emitted token, from the row that chose it."""
        if not meta.need_logprobs:
            return None
        rows: list[int] = []
        ids: list[int] = []
        for i, tokens in enumerate(emitted):
            rows.extend(_rows_of(i, lengths)[:len(tokens)])
            ids.extend(tokens)
        logp = logits[torch.tensor(rows, device=logits.device)].float().log_softmax(-1)
        chosen = logp.gather(1, torch.tensor(ids, device=logp.device)[:, None])[:, 0].tolist()
        k = min(meta.max_top_logprobs, logp.shape[1])
        top = logp.topk(k, dim=-1) if k else None
        top_ids = top.indices.tolist() if top is not None else []
        top_lps = top.values.tolist() if top is not None else []
        out, r = [], 0
        for seq, tokens in zip(seqs, emitted, strict=True):
            kk = seq.request.params.top_logprobs
            lps = []
            for t in tokens:
                pairs = list(zip(top_ids[r][:kk], top_lps[r][:kk], strict=True)) if kk else []
                lps.append(TokenLogprob(t, chosen[r], pairs))
                r += 1
            out.append(lps)
        return out

    def _banned(self, seq: Sequence, extra: int = 0) -> list[int]:
        params = seq.request.params
        if len(seq.output_token_ids) + extra >= seq.output.min_new_tokens:
            return []
        banned = list(params.stop_token_ids)
        if not params.ignore_eos:
            banned.extend(self._eos)
        return banned

    def _emit(self, seq: Sequence, token_ids: list[int],
              logprobs: list[TokenLogprob] | None) -> None:
        res = seq.output.append(token_ids)
        seq.output_token_ids.extend(res.token_ids)
        seq.request.usage.completion_tokens += len(res.token_ids)
        delta = seq.delta()
        delta.text += res.text
        delta.token_ids.extend(res.token_ids)
        if logprobs:
            delta.logprobs.extend(logprobs[:len(res.token_ids)])
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
            spec_steps=self.spec_stats.steps,
            spec_proposed_tokens=self.spec_stats.proposed,
            spec_accepted_tokens=self.spec_stats.accepted,
            spec_emitted_tokens=self.spec_stats.emitted,
        )
