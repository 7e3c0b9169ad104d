"""Turns sampled tokens into emitted tokens and text, and decides when a sequence ends.

Written for several tokens per step (speculative decoding accepts runs of tokens): the
tokens of one ``append`` are checked one by one, in order, and whatever follows the token
that finishes the sequence is dropped, so the result does not depend on how the tokens
were grouped into steps.

Streamed text is never retracted. A stop string may start in one token and end in a later
one, so while stop strings are pending we hold back the end of the text that could still be
the start of one (at most ``max_stop_len - 1`` characters) until the next tokens settle it.

Costs per token are bounded by the stop strings' length, not the output's: only a tail of
``max_stop_len - 1`` characters is kept as search context, never the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams


@dataclass
class AppendResult:
    """What one ``append`` (or ``finish``) adds to the sequence's output."""

    token_ids: list[int]  # tokens kept this call (tokens after a stop are dropped)
    text: str  # newly emitted text (safe to stream; never retracted)
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = None  # the matched stop string, if STOP_SEQUENCE


class OutputState:
    """Per-sequence output bookkeeping: token count, held-back text, stop conditions.

    ``params.max_new_tokens`` is the limit the engine admitted (clipped to the context).
    ``min_new_tokens``: the first ``min_new_tokens`` tokens never finish the sequence. The
    engine bans EOS and stop ids while sampling them, and a stop token or stop string
    arriving anyway is treated as ordinary text (stop strings only match if they end after
    that point).
    """

    def __init__(self, params: SamplingParams, detokenizer: IncrementalDetokenizer,
                 eos_token_ids: set[int]) -> None:
        self.params = params
        self.detokenizer = detokenizer
        self.eos_token_ids = set(eos_token_ids)
        # The engine zeroes this when a processor (a grammar) can only end the output.
        self.min_new_tokens = params.min_new_tokens
        self.num_tokens = 0  # tokens kept so far
        self.finish_reason: FinishReason | None = None
        self._stop_token_ids = set(params.stop_token_ids)
        self._stops = list(params.stop)
        # A new match ends in new text, so it starts at most this many characters earlier.
        self._context_len = max(params.max_stop_len - 1, 0)
        # The last ``_context_len`` characters of text so far (emitted or not) ...
        self._tail = ""
        # ... of which the last ``_unsent`` are held back (not emitted yet).
        self._unsent = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_ids: list[int]) -> AppendResult:
        """Take a run of sampled tokens; return what to emit and whether the sequence ended.

        Per token: count it; EOS -> EOS; a stop id -> STOP_TOKEN; else decode it and look
        for a stop string ending in its text -> STOP_SEQUENCE; then the length limit.
        """
        self._check_open()
        params = self.params
        buf = self._tail  # search context + this call's text; positions below index it
        sent = len(buf) - self._unsent  # buf[:sent] was emitted by earlier calls
        kept: list[int] = []
        for tok in token_ids:
            kept.append(tok)
            self.num_tokens += 1
            may_stop = self.num_tokens > self.min_new_tokens
            if may_stop and tok in self.eos_token_ids and not params.ignore_eos:
                return self._end(kept, buf, sent, FinishReason.EOS)
            if may_stop and tok in self._stop_token_ids:
                if params.include_stop_sequence:
                    buf += self.detokenizer.step(tok)
                return self._end(kept, buf, sent, FinishReason.STOP_TOKEN)
            before = len(buf)
            buf += self.detokenizer.step(tok)
            if may_stop and len(buf) > before and self._stops:
                match = self._find_stop(buf, before)
                if match is not None:
                    pos, stop = match
                    end = pos + len(stop) if params.include_stop_sequence else pos
                    self.finish_reason = FinishReason.STOP_SEQUENCE
                    return AppendResult(kept, buf[sent:end], FinishReason.STOP_SEQUENCE, stop)
            if self.num_tokens >= params.max_new_tokens:
                return self._end(kept, buf, sent, FinishReason.LENGTH)

        cut = max(sent, len(buf) - self._held_len(buf))
        self._tail = buf[max(0, len(buf) - self._context_len):]
        self._unsent = len(buf) - cut
        return AppendResult(kept, buf[sent:cut])

    def finish(self, reason: FinishReason) -> AppendResult:
        """End for an outside reason (abort, time limit, error): release held-back text."""
        self._check_open()
        return self._end([], self._tail, len(self._tail) - self._unsent, reason)

    def _end(self, kept: list[int], buf: str, sent: int, reason: FinishReason) -> AppendResult:
        """Finish without a stop string: everything decoded so far is final, emit it all."""
        self.finish_reason = reason
        buf += self.detokenizer.flush()
        return AppendResult(kept, buf[sent:], reason)

    def _find_stop(self, buf: str, before: int) -> tuple[int, str] | None:
        """Earliest stop string ending after ``before``; on a tie, the shorter (it ends
        first). Matches wholly inside older text were either found already or fell before
        ``min_new_tokens``, so they are not searched again."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            pos = buf.find(stop, max(0, before - len(stop) + 1))
            if pos != -1 and (best is None or (pos, len(stop)) < (best[0], len(best[1]))):
                best = (pos, stop)
        return best

    def _held_len(self, buf: str) -> int:
        """How many trailing characters to hold back: the longest end of the text that is
        the start of some stop string. With ``include_stop_sequence`` a match is cut at its
        end, which lies in text not yet seen, so nothing needs holding."""
        if self.params.include_stop_sequence:
            return 0
        for k in range(min(self._context_len, len(buf)), 0, -1):
            suffix = buf[-k:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return k
        return 0

    def _check_open(self) -> None:
        if self.finished:
            raise RuntimeError(f"sequence already finished ({self.finish_reason})")
