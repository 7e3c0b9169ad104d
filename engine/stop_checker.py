"""Turns sampled tokens into emitted tokens and text, and decides when a sequence ends.

Written for several tokens per step (speculative decoding): tokens are checked one by one
and whatever follows a stop is dropped. While stop strings are pending, the last
``max_stop_len - 1`` characters are held back so streamed text is never retracted.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams


@dataclass
class AppendResult:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = None


class OutputState:
    def __init__(self, params: SamplingParams, detokenizer: IncrementalDetokenizer,
                 eos_token_ids: set[int], max_new_tokens: int) -> None:
        self.params = params
        self.detokenizer = detokenizer
        self.eos_token_ids = eos_token_ids
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = set(params.stop_token_ids)
        self.hold = max(params.max_stop_len - 1, 0)
        self.num_tokens = 0
        self.text = ""  # all text decoded so far (emitted + held back)
        self.emitted = 0  # characters of ``text`` already handed out
        self.finished = False

    def _flush(self, upto: int | None = None) -> str:
        end = len(self.text) if upto is None else upto
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out

    def _find_stop(self, before: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            i = self.text.find(stop, max(0, before - len(stop) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        return best

    def append(self, token_ids: list[int]) -> AppendResult:
        params = self.params
        kept: list[int] = []
        for tok in token_ids:
            kept.append(tok)
            self.num_tokens += 1
            active = self.num_tokens > params.min_new_tokens
            if active and tok in self.eos_token_ids and not params.ignore_eos:
                return self._end(kept, FinishReason.EOS)
            if active and tok in self.stop_token_ids:
                if params.include_stop_sequence:
                    self.text += self.detokenizer.step(tok)
                return self._end(kept, FinishReason.STOP_TOKEN)
            before = len(self.text)
            self.text += self.detokenizer.step(tok)
            if active and params.stop and len(self.text) > before:
                hit = self._find_stop(before)
                if hit is not None:
                    pos, stop = hit
                    self.text = self.text[:pos + (len(stop) if params.include_stop_sequence
                                                  else 0)]
                    self.emitted = min(self.emitted, len(self.text))
                    return self._end(kept, FinishReason.STOP_SEQUENCE, stop)
            if self.num_tokens >= self.max_new_tokens:
                return self._end(kept, FinishReason.LENGTH)
        return AppendResult(kept, self._flush(max(self.emitted, len(self.text) - self.hold)))

    def _end(self, kept: list[int], reason: FinishReason, stop: str | None = None
             ) -> AppendResult:
        self.finished = True
        return AppendResult(kept, self._flush(), reason, stop)

    def finish(self, reason: FinishReason) -> AppendResult:
        """An outside end (abort, time limit, error): release the held-back text."""
        self.finished = True
        return AppendResult([], self._flush(), reason)
