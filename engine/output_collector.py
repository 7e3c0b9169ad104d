"""A request's whole output, merged on the engine thread as its steps come out.

A unary call (``Generate``, each ``GenerateBatch`` item) needs only the end result, so its
per-step outputs are merged where they are made and its caller is woken once, when the
request finishes, instead of once per token. When each step's tokens appeared is kept
(``token_times``), so time-to-first-token and time-per-token metrics come out the same as
for a stream.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

from engine.outputs import (
    Completion,
    CompletionDelta,
    RequestOutput,
    RequestTimes,
    TokenLogprob,
    Usage,
)


@dataclass
class _Parts:
    """One sequence's output so far: text kept as pieces (joined once, at the end)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    last: CompletionDelta | None = None  # the delta that carried the finish reason


@dataclass
class OutputCollector:
    """Written by the engine thread only; ``usage`` may be read from any thread (a
    reference swapped once per step), e.g. to count the tokens of a cancelled call."""

    request_id: str
    num_completions: int
    usage: Usage
    finished: bool = False
    # (time.perf_counter() when a step's output was made, most tokens any of the request's
    # sequences got in that step); only steps that produced tokens
    token_times: list[tuple[float, int]] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # when asked for (RequestOutput's)
    times: RequestTimes | None = None  # the finished output's
    _parts: list[_Parts] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._parts = [_Parts() for _ in range(self.num_completions)]

    def add(self, out: RequestOutput, now: float) -> None:
        step = 0
        for d in out.deltas:
            parts = self._parts[d.index]
            if d.text:
                parts.text.append(d.text)
            if d.token_ids:
                parts.token_ids.extend(d.token_ids)
                step = max(step, len(d.token_ids))
            if d.logprobs:
                parts.logprobs.extend(d.logprobs)
            if d.finish_reason is not None:
                parts.last = d
        if step:
            self.token_times.append((now, step))
        self.usage = out.usage
        self.finished = out.finished
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.times is not None:
            self.times = out.times

    def completions(self) -> list[Completion]:
        out = []
        for i, parts in enumerate(self._parts):
            c = Completion(i, "".join(parts.text), parts.token_ids, parts.logprobs)
            if parts.last is not None:
                c.finish_reason = parts.last.finish_reason
                c.stop_sequence = parts.last.stop_sequence
                c.error = parts.last.error
                c.rejected = parts.last.rejected
                c.invalid_field = parts.last.invalid_field
            out.append(c)
        return out


async def collect(stream: AsyncGenerator[RequestOutput, None],
                  collector: OutputCollector) -> OutputCollector:
    """Merge a stream of outputs into ``collector`` on the caller's side (for engines that
    only stream); ``AsyncEngine.complete`` does the same on its engine thread. Closes the
    stream however this ends, so a cancelled caller aborts the request."""
    async with aclosing(stream) as outputs:
        async for out in outputs:
            collector.add(out, time.perf_counter())
    return collector
