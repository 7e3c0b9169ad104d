"""Scenarios shared by both runners' long-prefill tests: a short request arriving while a
long prompt is prefilled, counted in engine steps (deterministic) and timed through the
async engine against the same request on the idle engine."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field

from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

TEXT = "The quick brown fox jumps over the lazy dog while 42 cats watch. "


def prompt_of(tokenizer, n: int, text: str = TEXT) -> list[int]:
    """A prompt of exactly ``n`` tokens."""
    ids = tokenizer(text * (n // 8 + 1))["input_ids"]
    assert len(ids) >= n
    return ids[:n]


@dataclass
class Arrival:
    steps_to_first_token: int  # engine steps from the short request's arrival
    long_tokens: list[int]
    long_prefilling: bool  # was the long prompt still prefilling at the short's token?


def short_during_long_prefill(engine: LLMEngine, long_ids: list[int], long: SamplingParams,
                              short_ids: list[int], short: SamplingParams,
                              after_steps: int = 2) -> Arrival:
    """Add the long request, step ``after_steps`` times, add the short one, run both out."""
    engine.add_request("long", long_ids, long)
    seq = engine.requests["long"].sequences[0]
    long_tokens: list[int] = []
    for _ in range(after_steps):
        assert not any(d.token_ids for o in engine.step() for d in o.deltas)
    assert 0 < seq.num_computed_tokens < len(long_ids)
    engine.add_request("short", short_ids, short)
    steps, first, prefilling = 0, 0, False
    while engine.has_work:
        outs = engine.step()
        steps += 1
        for out in outs:
            got = [t for d in out.deltas for t in d.token_ids]
            if out.request_id == "long":
                long_tokens += got
            elif got and not first:
                first, prefilling = steps, seq.num_computed_tokens < len(long_ids)
        assert steps < 10_000
    return Arrival(first, long_tokens, prefilling)


def alone(engine: LLMEngine, ids: list[int], params: SamplingParams) -> list[int]:
    engine.add_request("alone", ids, params)
    tokens: list[int] = []
    while engine.has_work:
        tokens += [t for o in engine.step() for d in o.deltas for t in d.token_ids]
    return tokens


@dataclass
class Timing:
    idle_ttft: float  # the short request alone (best of 3)
    busy_ttft: float  # the short request sent while the long prompt prefills
    step: float  # median engine step while the long prompt prefilled
    short_first: bool  # the short request's first token came before the long one's
    steps: list[float] = field(default_factory=list)


def time_short_during_long_prefill(engine: LLMEngine, long_ids: list[int],
                                   short_ids: list[int], warmup_steps: int = 2,
                                   abort_long: bool = False) -> Timing:
    """TTFT of a short request on the idle engine and while a long prompt prefills,
    through ``AsyncEngine`` (so the request arrives mid-step, as a client's does), with
    every step's duration recorded. ``abort_long``: abort the long request once the short
    one has its token (the rest of a slow runner's prefill proves nothing more)."""
    durations: list[tuple[float, bool]] = []  # (seconds, long prompt prefilling)
    step = engine.step

    def timed():  # type: ignore[no-untyped-def]
        req = engine.requests.get("long")
        prefilling = req is not None and req.sequences[0].num_computed_tokens < len(long_ids)
        t = time.perf_counter()
        out = step()
        durations.append((time.perf_counter() - t, prefilling))
        return out

    engine.step = timed  # type: ignore[method-assign]
    short = SamplingParams(max_new_tokens=2, ignore_eos=True)

    async def first_token_at(ae: AsyncEngine, rid: str, ids: list[int],
                             params: SamplingParams) -> float:
        at = 0.0
        async for out in ae.generate(rid, ids, params):
            if not at and any(d.token_ids for d in out.deltas):
                at = time.perf_counter()
        return at

    async def ttft(ae: AsyncEngine, rid: str, ids: list[int]) -> float:
        t0 = time.perf_counter()
        return await first_token_at(ae, rid, ids, short) - t0

    async def main() -> Timing:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            idle = min([await ttft(ae, f"idle{i}", short_ids) for i in range(3)])
            durations.clear()
            long = asyncio.create_task(first_token_at(
                ae, "long", long_ids, SamplingParams(max_new_tokens=1, ignore_eos=True)))
            while sum(p for _, p in durations) < warmup_steps and not long.done():
                await asyncio.sleep(0.001)  # well into its prefill (unless it is over)
            busy = await ttft(ae, "busy", short_ids)
            short_at = time.perf_counter()
            if abort_long and not long.done():
                ae.abort("long")
            long_at = await long or float("inf")  # aborted before its token: after
            during = [d for d, p in durations if p]
            return Timing(idle, busy, statistics.median(during), short_at < long_at, during)
        finally:
            await ae.shutdown()
            engine.step = step  # type: ignore[method-assign]

    return asyncio.run(main())
