"""The speculator the engine drives (``engine.speculation.Speculator``): proposal budgets
and the auto-off policy, the proposers, the scorer's runner work, verification, and the
counts of what was proposed, accepted and emitted.

Each sequence paces its own proposals, because a verify row is not free (on this 2-core CPU
nine rows cost about 1.5 plain decode steps, two rows barely more than one): it proposes
``START_K`` tokens at first, four times as many (up to k) after a step that accepted them
all, and what was accepted plus one after a step that did not. A sequence whose proposals
keep being rejected (open-ended text under n-gram lookup) also backs off: from its second
step in a row that accepted nothing it skips 1, 2, 4 ... up to ``MAX_BACKOFF`` steps
before proposing again (one miss is common in copied text: a changed word). Any choice of
proposals leaves the output exact, so this only trades speed.

Where verify rows are *not* nearly free (the runner's ``row_cost``: on llama.cpp here each
extra row of a sequence costs ~0.6 of a one-row step, its quantised matmuls being compute
bound at batch 1), proposals are also capped at the count that maximises expected tokens
per unit of step cost, from the sequence's recent per-token acceptance; a sequence capped
to none probes with one proposal every ``PROBE_EVERY`` steps, so a copy run that begins is
found again.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.counter_rng import ACCEPT, uniforms
from engine.outputs import SpecStats
from engine.runners.base import DecodeRow, PrefillWork, Runner
from engine.sampler import (
    SamplingMetadata,
    apply_penalties,
    compute_probs,
    row_argmax,
    sample_from_probs,
)
from engine.sequence import Sequence
from engine.speculation import SpeculatorFactory
from specdecode.batch_expansion import contract, expand, multi_token
from specdecode.config import SpeculativeConfig
from specdecode.draft import DraftProposer
from specdecode.ngram import NgramProposer
from specdecode.rejection import SampledDraft, rejection_sample, verify_matching

MAX_BACKOFF = 16
START_K = 4
PROBE_EVERY = 8


def worth_proposing(k: int, alpha: float, row_cost: float) -> int:
    """The proposal count in 0..k with the most expected tokens per unit of step cost: with
    per-token acceptance ``alpha``, ``j`` proposals emit ``(1 - alpha**(j+1)) / (1 - alpha)``
    tokens (the accepted run plus one) for a step costing ``1 + row_cost * j``."""
    if row_cost <= 0 or k <= 0:
        return k
    alpha = min(alpha, 0.999)
    return max(range(k + 1),
               key=lambda j: (1 - alpha ** (j + 1)) / (1 - alpha) / (1 + row_cost * j))


@dataclass
class _Pace:
    k: int  # proposals to make next
    misses: int = 0  # consecutive speculative steps that accepted nothing
    skip: int = 0  # steps left before proposing again
    alpha: float = 0.5  # recent per-token acceptance (moving average over steps)
    idle: int = 0  # steps in a row the cost cap allowed no proposal

    def observe(self, proposed: int, accepted: int, k_max: int) -> None:
        rejected = int(accepted < proposed)  # a geometric run: successes, then one failure
        self.alpha = 0.5 * self.alpha + 0.5 * accepted / (accepted + rejected)
        if accepted == proposed:
            self.k = min(k_max, 4 * self.k)
        else:
            self.k = max(1, accepted + 1)
        if accepted:
            self.misses = self.skip = 0
        else:
            self.misses += 1
            if self.misses > 1:
                self.skip = min(2 ** (self.misses - 2), MAX_BACKOFF)


def speculator_for(spec: SpeculativeConfig) -> SpeculatorFactory | None:
    """What ``LLMEngine(speculator=...)`` takes; None when speculation is off."""
    return functools.partial(SpecWorker, spec) if spec.method else None


class SpecWorker:
    def __init__(self, spec: SpeculativeConfig, target: Runner) -> None:
        if spec.num_spec_tokens < 1:
            raise ValueError(f"num_spec_tokens must be >= 1, got {spec.num_spec_tokens}")
        if spec.scorer not in ("batch_expansion", "multi_token"):
            raise ValueError(f"unknown speculative scorer {spec.scorer!r} "
                             "(batch_expansion or multi_token)")
        self.method = spec.method or ""
        self.k = spec.num_spec_tokens
        self.multi_token = spec.scorer == "multi_token"
        self.disable_batch_size = spec.disable_batch_size
        self.enabled_by_default = spec.enabled_by_default
        self.max_model_len = target.max_model_len
        self.target = target  # its row_cost is read when first needed (timed then)
        self.stats = SpecStats()
        self._pace: dict[int, _Pace] = {}
        # This step's draft distributions by seq id, of the proposals sampled with their own
        # randomness (unseeded sampled rows of a draft model): verified by rejection sampling.
        self._q: dict[int, torch.Tensor] = {}
        self.draft: DraftProposer | None = None
        self.ngram: NgramProposer | None = None
        if spec.method == "ngram":
            self.ngram = NgramProposer(spec.ngram_min, spec.ngram_max)
        elif spec.method == "draft":
            if not spec.draft_model:
                raise ValueError("speculative method 'draft' needs a draft model")
            self.draft = DraftProposer(target, spec)
        else:
            raise ValueError(f"unknown speculative method {spec.method!r} (ngram or draft)")

    # ---- proposing ------------------------------------------------------------------

    def budgets(self, seqs: list[Sequence], num_running: int) -> list[int]:
        """Off for the step when the batch is big enough to be compute bound already."""
        if num_running > self.disable_batch_size:
            return [0] * len(seqs)
        return [self._budget(s) for s in seqs]

    def _budget(self, seq: Sequence) -> int:
        """Proposals worth making: none past the context (the step runs as a plain decode)
        and never more than the tokens the sequence may still emit, minus the bonus."""
        enabled = seq.request.params.speculative
        if not (self.enabled_by_default if enabled is None else enabled):
            return 0
        if seq.num_tokens + self.k > self.max_model_len:
            return 0
        pace = self._pace.get(seq.seq_id)
        if pace is None:
            pace = self._pace[seq.seq_id] = _Pace(min(START_K, self.k))
        if pace.skip > 0:
            pace.skip -= 1
            return 0
        left = seq.request.params.max_new_tokens - len(seq.output_token_ids)
        k = max(0, min(pace.k, left - 1))
        capped = worth_proposing(k, pace.alpha, self.target.row_cost)
        if capped or not k:
            pace.idle = 0
            return capped
        pace.idle += 1
        if pace.idle >= PROBE_EVERY:  # nothing pays at this acceptance: look again
            pace.idle = 0
            return 1
        return 0

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[list[int]]:
        self._q.clear()
        if self.draft is not None:
            proposals, q = self.draft.propose(seqs, budgets)
            self._q = {seqs[i].seq_id: qi for i, qi in q.items()}
            return proposals
        assert self.ngram is not None
        return [self.ngram.lookup(s.prompt_token_ids + s.output_token_ids, b) if b else []
                for s, b in zip(seqs, budgets, strict=True)]

    def score_work(self, seq: Sequence, proposals: list[int]
                   ) -> tuple[list[DecodeRow], list[PrefillWork]]:
        if self.multi_token:
            return [], [multi_token(seq, proposals)]
        return expand(seq, proposals), []

    # ---- verifying ------------------------------------------------------------------

    def verify(self, seqs: list[Sequence], proposals: list[list[int]], logits: torch.Tensor,
               meta: SamplingMetadata) -> list[list[int]]:
        """Each row's target token is what plain decoding would pick there (the argmax, or
        the inverse-CDF draw at the row's own output position); proposals are accepted while
        they are the target token, so the output is plain decoding's whether or not a step
        speculated. Proposals a draft sampled with randomness of its own get exact rejection
        sampling against the draft's q instead."""
        lengths = [len(p) for p in proposals]
        k = max(lengths)
        draft = torch.tensor([p + [0] * (k - len(p)) for p in proposals])
        lens = torch.tensor(lengths)
        if meta.all_greedy:
            target = row_argmax(apply_penalties(logits.float(), meta))
            verified = verify_matching(contract(target, lengths).cpu(), draft, lens)
        else:
            probs = compute_probs(logits, meta)
            u = meta.uniforms()
            target = contract(sample_from_probs(probs, u), lengths).cpu()
            sampled = self._sampled_draft(seqs, k)
            if sampled is None:
                verified = verify_matching(target, draft, lens)
            else:
                verified = rejection_sample(contract(probs, lengths), draft, lens, target,
                                            contract(u, lengths), sampled)
        self.stats.steps += 1
        for seq, n, accepted, tokens in zip(seqs, lengths, verified.num_accepted,
                                            verified.token_ids, strict=True):
            self.stats.proposed += n
            self.stats.accepted += accepted
            self.stats.emitted += len(tokens)
            seq.request.usage.spec_proposed_tokens += n
            seq.request.usage.spec_accepted_tokens += accepted
            self._pace[seq.seq_id].observe(n, accepted, self.k)
        return verified.token_ids

    def _sampled_draft(self, seqs: list[Sequence], k: int) -> SampledDraft | None:
        """The sequences whose proposals the draft sampled with randomness of its own, their
        ``[batch, k, vocab]`` draft distributions (other rows and rows past a sequence's own
        proposals are never read) and accept-test uniforms; None when there are none."""
        if not self._q:
            return None
        first = next(iter(self._q.values()))
        q = first.new_zeros(len(seqs), k, first.shape[-1])
        for i, seq in enumerate(seqs):
            mine = self._q.get(seq.seq_id)
            if mine is not None:
                q[i, :len(mine[:k])] = mine[:k]
        rows = torch.tensor([s.seq_id in self._q for s in seqs])
        keys = [s.sampling_key for s in seqs for _ in range(k)]
        positions = [len(s.output_token_ids) + j for s in seqs for j in range(k)]
        return SampledDraft(rows, q, uniforms(keys, positions, ACCEPT).view(len(seqs), k))

    def release(self, seq: Sequence) -> None:
        self._pace.pop(seq.seq_id, None)
        if self.draft is not None:
            self.draft.release(seq)
