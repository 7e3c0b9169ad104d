"""AsyncEngine: the asyncio side never touches the scheduler's containers."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, EngineDeadError, QueueFullError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def test_queue_accounting_runs_only_on_the_engine_thread(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_num_seqs=2, max_waiting=6))
    threads: set[str] = set()
    count = engine.num_waiting_requests

    def recorded() -> int:
        threads.add(threading.current_thread().name)
        return count()

    engine.num_waiting_requests = recorded  # type: ignore[method-assign]

    async def main() -> tuple[int, int]:
        ae = AsyncEngine(engine)
        ae.start()

        async def one(i: int) -> int:
            n = 0
            async for out in ae.generate(f"r{i}", [5, 6, 7 + i],
                                         SamplingParams(max_new_tokens=8, min_new_tokens=8)):
                n += sum(len(d.token_ids) for d in out.deltas)
            return n

        results = await asyncio.gather(*(one(i) for i in range(20)), return_exceptions=True)
        await ae.shutdown()
        done = [r for r in results if r == 8]
        full = [r for r in results if isinstance(r, QueueFullError)]
        assert len(done) + len(full) == 20, results
        return len(done), len(full)

    done, full = asyncio.run(main())
    assert done >= 6 and full >= 1  # the bound held and admitted work completed
    assert threads == {"genserve-engine"}
    assert engine.scheduler.allocator.num_used == 0


def test_an_engine_loop_crash_fails_every_waiting_caller_and_sets_died(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir)))
    step = engine.step
    calls = 0

    def crashing():
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("boom")
        return step()

    engine.step = crashing  # type: ignore[method-assign]

    async def main() -> list:
        ae = AsyncEngine(engine)
        ae.start()

        async def one(i: int) -> int:
            async for _ in ae.generate(f"r{i}", [5, 6, 7 + i],
                                       SamplingParams(max_new_tokens=50, min_new_tokens=50)):
                pass
            return i

        results = await asyncio.gather(*(one(i) for i in range(4)), return_exceptions=True)
        assert ae.died is not None
        await asyncio.wait_for(ae.died.wait(), 5)
        assert not ae.is_running
        with pytest.raises(EngineDeadError):  # a new caller fails at once, too
            async for _ in ae.generate("late", [5], SamplingParams()):
                pass
        await ae.shutdown()
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) and "boom" in str(r) for r in results), results
