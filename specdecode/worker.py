"""The speculator the engine drives: chooses each sequence's proposal budget and asks the
proposer.

A sequence whose proposals keep being rejected (open-ended text under n-gram lookup) backs
off: after a step that accepted nothing it skips 1, 2, 4 ... up to ``MAX_BACKOFF`` steps
before proposing again, so wrong guesses stop costing verification rows; one accepted
proposal resets it. Any choice of proposals leaves the output exact, so this only trades
speed.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.sequence import Sequence
from specdecode.draft import DraftProposer
from specdecode.ngram import NgramProposer
from specdecode.proposals import Proposals

MAX_BACKOFF = 16


@dataclass
class _Backoff:
    misses: int = 0  # consecutive speculative steps that accepted nothing
    skip: int = 0  # steps left before proposing again


class Speculator:
    def __init__(self, config: EngineConfig, target: ModelRunner) -> None:
        spec = config.speculative
        if spec.num_spec_tokens < 1:
            raise ValueError(f"num_spec_tokens must be >= 1, got {spec.num_spec_tokens}")
        if spec.scorer not in ("batch_expansion", "multi_token"):
            raise ValueError(f"unknown speculative scorer {spec.scorer!r} "
                             "(batch_expansion or multi_token)")
        self.k = spec.num_spec_tokens
        self.multi_token = spec.scorer == "multi_token"
        self.method = spec.method
        self.disable_batch_size = spec.disable_batch_size
        self.enabled_by_default = spec.enabled_by_default
        self.max_model_len = target.max_model_len
        self._backoff: dict[int, _Backoff] = {}
        self.draft: DraftProposer | None = None
        self.ngram: NgramProposer | None = None
        if spec.method == "ngram":
            self.ngram = NgramProposer(spec.ngram_min, spec.ngram_max)
        elif spec.method == "draft":
            if not spec.draft_model:
                raise ValueError("speculative method 'draft' needs a draft model")
            self.draft = DraftProposer(target, spec, config)
        else:
            raise ValueError(f"unknown speculative method {spec.method!r} (ngram or draft)")

    def wants(self, seq: Sequence) -> bool:
        enabled = seq.request.params.speculative
        return self.enabled_by_default if enabled is None else enabled

    def budget(self, seq: Sequence) -> int:
        """Proposals worth making: none past the context (the step runs as a plain decode)
        and never more than the tokens the sequence may still emit, minus the bonus."""
        if not self.wants(seq) or seq.num_tokens + self.k > self.max_model_len:
            return 0
        backoff = self._backoff.get(seq.seq_id)
        if backoff is not None and backoff.skip > 0:
            backoff.skip -= 1
            return 0
        left = seq.output.max_new_tokens - len(seq.output_token_ids)
        return max(0, min(self.k, left - 1))

    def propose(self, seqs: list[Sequence]) -> Proposals:
        budgets = [self.budget(s) for s in seqs]
        if self.draft is not None:
            return self.draft.propose(seqs, budgets)
        assert self.ngram is not None
        return self.ngram.propose([s.prompt_token_ids + s.output_token_ids if b else []
                                   for s, b in zip(seqs, budgets, strict=True)], budgets)

    def observe(self, seq: Sequence, accepted: int) -> None:
        """Feed back one verification: accepted proposals of ``seq`` this step."""
        if accepted:
            self._backoff.pop(seq.seq_id, None)
            return
        backoff = self._backoff.setdefault(seq.seq_id, _Backoff())
        backoff.misses += 1
        backoff.skip = min(2 ** (backoff.misses - 1), MAX_BACKOFF)

    def release(self, seq: Sequence) -> None:
        self._backoff.pop(seq.seq_id, None)
        if self.draft is not None:
            self.draft.release(seq)
