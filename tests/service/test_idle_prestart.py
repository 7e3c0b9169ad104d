"""Background work (the grammar-compile workers' imports) waits until the server has been
idle for a while, so it does not share the cores with the first requests."""

from __future__ import annotations

import asyncio
import itertools

from service.server import wait_until_idle


def run(pattern: list[bool]) -> list[bool]:
    """The polls ``wait_until_idle`` made (1 s idle wanted) on a clock that moves 0.1 s
    per reading, ``idle()`` answering ``pattern`` then True."""
    ticks = itertools.count()
    seen: list[bool] = []

    def idle() -> bool:
        seen.append(pattern[len(seen)] if len(seen) < len(pattern) else True)
        return seen[-1]

    asyncio.run(wait_until_idle(idle, for_s=1.0, poll_s=0.0,
                                clock=lambda: next(ticks) * 0.1))
    return seen


def test_returns_only_after_an_unbroken_idle_stretch():
    seen = run([False] * 5)
    assert seen[:5] == [False] * 5 and all(seen[5:])
    assert len(seen) - 5 >= 5  # idle polls covering 1 s of this clock, not one


def test_a_busy_poll_restarts_the_idle_stretch():
    quiet_then_busy = run([True] * 4 + [False])
    busy_from_start = run([False] * 5)
    assert quiet_then_busy.index(False) == 4
    assert len(quiet_then_busy) == len(busy_from_start)
