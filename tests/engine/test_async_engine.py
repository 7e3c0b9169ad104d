"""AsyncEngine: the asyncio side never touches the scheduler's containers."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, EngineDeadError, QueueFullError
from engine.llm_engine import LLMEngine
from engine.outputs import FinishReason
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


def crashing_engine(model_dir) -> LLMEngine:
    """An engine whose third step raises, as a bug in the step loop would."""
    engine = LLMEngine(EngineConfig(model=str(model_dir)))
    step = engine.step
    calls = 0

    def crashing():
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("boom")
        return step()

    engine.step = crashing  # type: ignore[method-assign]
    return engine


def test_an_engine_loop_crash_fails_every_waiting_caller_and_sets_died(tiny_model_dir):
    engine = crashing_engine(tiny_model_dir)

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


def _recording(ae: AsyncEngine) -> list[list]:
    """Every ``_deliver`` call (one per engine step that had results) and what it carried."""
    calls: list[list] = []
    deliver = ae._deliver

    def recorded(ready):
        calls.append([item for _, item in ready])
        deliver(ready)

    ae._deliver = recorded  # type: ignore[method-assign]
    return calls


def test_a_unary_request_wakes_its_caller_once_with_the_whole_output(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir)))
    params = SamplingParams(max_new_tokens=12, min_new_tokens=12, n=2)

    async def main():
        ae = AsyncEngine(engine)
        calls = _recording(ae)
        ae.start()
        stream = [o async for o in ae.generate("s", [5, 6, 7], params)]
        before = len(calls)
        whole = await ae.complete("u", [5, 6, 7], params)
        await ae.shutdown()
        return stream, whole, calls[before:]

    stream, whole, calls = asyncio.run(main())
    assert calls == [[whole]]  # twelve steps, one hand-over
    assert whole.finished and whole.usage.completion_tokens == 24
    # the same greedy text as the stream, and one timestamp per step that made tokens
    for c in whole.completions():
        deltas = [d for o in stream for d in o.deltas if d.index == c.index]
        assert c.token_ids == [t for d in deltas for t in d.token_ids]
        assert c.text == "".join(d.text for d in deltas)
        assert c.finish_reason is deltas[-1].finish_reason is not None
    assert [n for _, n in whole.token_times] == [1] * 12
    times = [t for t, _ in whole.token_times]
    assert times == sorted(times)


def test_each_step_reaches_the_event_loop_in_one_callback(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_num_seqs=8))
    steps = 0
    step = engine.step

    def counted():
        nonlocal steps
        out = step()
        steps += bool(out)
        return out

    engine.step = counted  # type: ignore[method-assign]

    async def main():
        ae = AsyncEngine(engine)
        calls = _recording(ae)
        ae.start()

        async def one(i: int) -> int:
            return sum([len(d.token_ids) async for o in ae.generate(
                f"r{i}", [5, 6, 7 + i], SamplingParams(max_new_tokens=8, min_new_tokens=8))
                for d in o.deltas])

        counts = await asyncio.gather(*(one(i) for i in range(6)))
        await ae.shutdown()
        return counts, calls

    counts, calls = asyncio.run(main())
    assert counts == [8] * 6
    assert len(calls) == steps  # not one per request per step
    assert max(len(c) for c in calls) == 6


def test_a_cancelled_unary_request_is_aborted_and_frees_its_blocks(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir)))
    from engine.output_collector import OutputCollector
    from engine.outputs import Usage

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        collector = OutputCollector("u", 1, Usage(prompt_tokens=3))
        task = asyncio.create_task(ae.complete(
            "u", [5, 6, 7], SamplingParams(max_new_tokens=400, min_new_tokens=400), collector))
        while collector.usage.completion_tokens < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(500):
            if not engine.has_work:
                break
            await asyncio.sleep(0.01)
        await ae.shutdown()
        return collector

    collector = asyncio.run(main())
    assert 3 <= collector.usage.completion_tokens < 400  # partial usage stays readable
    # the abort's final output still reaches the collector: ABORTED, as the drain relies on
    assert collector.completions()[0].finish_reason is FinishReason.ABORTED
    assert engine.scheduler.allocator.num_used == 0 and not engine.requests


def test_an_engine_crash_fails_unary_callers_too(tiny_model_dir):
    engine = crashing_engine(tiny_model_dir)

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        results = await asyncio.gather(*(ae.complete(f"r{i}", [5, 6], SamplingParams(
            max_new_tokens=50, min_new_tokens=50)) for i in range(3)), return_exceptions=True)
        await ae.shutdown()
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) and "boom" in str(r) for r in results), results


def test_a_burst_fills_free_seats_before_the_queue_bound_applies(tiny_model_dir):
    """max_waiting bounds requests that must wait, not those free seats take at once: a
    burst of seats + max_waiting requests is admitted whole, one more is refused."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_num_seqs=8, max_waiting=2))

    async def main() -> list:
        ae = AsyncEngine(engine)
        ae.start()

        async def one(i: int):
            return await ae.complete(f"b{i}", [5, 6, 7 + i], SamplingParams(max_new_tokens=4))

        results = await asyncio.gather(*(one(i) for i in range(11)), return_exceptions=True)
        await ae.shutdown()
        return results

    results = asyncio.run(main())
    refused = [r for r in results if isinstance(r, QueueFullError)]
    assert len(refused) == 1, results


def test_a_full_queue_refuses_at_once_while_the_engine_thread_is_in_a_step(tiny_model_dir):
    """The bound is decided on the event loop from counts the engine thread publishes: a
    refusal never waits for that thread (held here inside a step until the test lets it
    go), and the admitted requests run once it goes on."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_num_seqs=1, max_waiting=1))
    go_on = threading.Event()
    step = engine.step

    def held_step():
        go_on.wait(30)
        return step()

    engine.step = held_step  # type: ignore[method-assign]
    params = SamplingParams(max_new_tokens=3, min_new_tokens=3)

    async def main() -> tuple[float, list]:
        ae = AsyncEngine(engine)
        ae.start()
        running = asyncio.create_task(ae.complete("a", [5, 6, 7], params))
        while "a" not in engine.requests:  # the engine thread took it, and is in its step
            await asyncio.sleep(0.005)
        waiting = asyncio.create_task(ae.complete("b", [5, 6, 8], params))
        await asyncio.sleep(0)  # admitted: it waits for the seat
        start = time.perf_counter()
        with pytest.raises(QueueFullError, match="waiting queue is full"):
            await ae.complete("c", [5, 6, 9], params)
        took = time.perf_counter() - start
        go_on.set()
        done = await asyncio.gather(running, waiting)
        await ae.shutdown()
        return took, done

    took, done = asyncio.run(main())
    assert took < 0.05
    assert [len(c.completions()[0].token_ids) for c in done] == [3, 3]


def test_a_stream_consumer_behind_the_engine_gets_merged_outputs_with_every_token(
        tiny_model_dir):
    """A slow reader is not sent one output per step: what piled up comes as one output,
    with the same tokens and text, in order, and the finish reason once at the end."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir)))
    params = SamplingParams(max_new_tokens=24, min_new_tokens=24, n=2)

    async def read(ae: AsyncEngine, rid: str, pause: float):
        outs = []
        async for out in ae.generate(rid, [5, 6, 7], params):
            outs.append(out)
            await asyncio.sleep(pause)  # the engine thread keeps stepping meanwhile
        return outs

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        fast = await read(ae, "fast", 0)
        slow = await read(ae, "slow", 0.05)
        await ae.shutdown()
        return fast, slow

    fast, slow = asyncio.run(main())
    assert len(slow) < len(fast) // 2  # several steps per output
    for outs in (fast, slow):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].usage.completion_tokens == 48
    def joined(outs, index: int) -> tuple[list[int], str]:
        ds = [d for o in outs for d in o.deltas if d.index == index]
        assert [d.finish_reason for d in ds][-1] is FinishReason.LENGTH
        assert all(d.finish_reason is None for d in ds[:-1])
        return [t for d in ds for t in d.token_ids], "".join(d.text for d in ds)

    for index in (0, 1):
        assert joined(slow, index) == joined(fast, index)


def _os_threads() -> set[str]:
    """This process's live thread ids: compared as sets, so a thread some earlier test left
    behind that exits meanwhile cannot hide a new one (as counting did)."""
    import os
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="Linux /proc")
def test_torch_work_in_own_thread_leaves_no_openmp_team_behind():
    """A thread that ran a parallel torch op keeps its OpenMP workers while it lives (and
    more OpenMP threads than cores make libgomp stop spin-waiting, slowing the engine
    thread); ``in_own_thread`` ends its thread, so the workers go with it, where
    ``asyncio.to_thread``'s executor thread keeps them."""
    import time

    import torch

    from engine.async_engine import in_own_thread

    before_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def parallel_op() -> float:
            return float(torch.ones(1 << 22).mul_(2).sum())  # far above ATen's grain size

        def new_since(base: set[str], at_most: int) -> set[str]:
            for _ in range(100):  # workers leave at their thread's exit, asynchronously
                if len(_os_threads() - base) <= at_most:
                    break
                time.sleep(0.02)
            return _os_threads() - base

        async def main() -> tuple[set[str], set[str]]:
            base = _os_threads()
            assert await in_own_thread(parallel_op) == 2.0 * (1 << 22)
            left_by_own = new_since(base, 0)
            await asyncio.to_thread(parallel_op)
            left_by_executor = _os_threads() - base
            return left_by_own, left_by_executor

        left_by_own, left_by_executor = asyncio.run(main())
        assert not left_by_own, left_by_own
        # the control: the executor thread stays, and an OpenMP worker with it
        assert len(left_by_executor) >= 2, left_by_executor
    finally:
        torch.set_num_threads(before_threads)


def test_in_own_thread_hands_what_a_cancelled_caller_left_to_on_abandon():
    """A caller cancelled while ``fn`` runs gives up its result: it goes to ``on_abandon``
    (an adapter lease is released there), not nowhere."""
    from engine.async_engine import in_own_thread

    abandoned: list[object] = []
    gone = threading.Event()
    result = object()

    def slow() -> object:
        time.sleep(0.2)
        return result

    def on_abandon(value: object) -> None:
        abandoned.append(value)
        gone.set()

    async def main() -> None:
        task = asyncio.create_task(in_own_thread(slow, on_abandon=on_abandon))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert abandoned == []  # slow() is still running
        await asyncio.to_thread(gone.wait, 5)
        assert await in_own_thread(slow, on_abandon=on_abandon) is result  # taken: kept

    asyncio.run(main())
    assert abandoned == [result]


def test_in_own_thread_raises_the_functions_error():
    from engine.async_engine import in_own_thread

    def boom() -> None:
        raise ValueError("bad model path")

    with pytest.raises(ValueError, match="bad model path"):
        asyncio.run(in_own_thread(boom))


def _stream(model_dir, interval: int, params: SamplingParams,
            stop_after: int | None = None) -> tuple[list[list[int]], list[str], AsyncEngine]:
    """Each message's tokens and text of one greedy stream under ``stream_interval``;
    with ``stop_after``, the caller closes the stream after that many messages."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), stream_interval=interval))

    async def main() -> tuple[list[list[int]], list[str], AsyncEngine]:
        ae = AsyncEngine(engine)
        ae.start()
        tokens: list[list[int]] = []
        texts: list[str] = []
        stream = ae.generate("s", [5, 6, 7], params)
        async for out in stream:
            tokens.append([t for d in out.deltas for t in d.token_ids])
            texts.append("".join(d.text for d in out.deltas))
            if stop_after is not None and len(tokens) == stop_after:
                break
        await stream.aclose()
        await asyncio.sleep(0.2)  # the abort reaches the engine thread
        await ae.shutdown()
        return tokens, texts, ae

    return asyncio.run(main())


def test_stream_interval_sends_the_first_token_alone_then_messages_of_at_least_n_tokens(
        tiny_model_dir):
    params = SamplingParams(max_new_tokens=23, min_new_tokens=23)
    each, each_text, _ = _stream(tiny_model_dir, 1, params)
    grouped, grouped_text, ae = _stream(tiny_model_dir, 4, params)
    flat = [t for m in grouped for t in m]
    assert flat == [t for m in each for t in m] and len(flat) == 23
    assert "".join(grouped_text) == "".join(each_text)
    assert len(grouped[0]) == 1  # time to first token is not held back
    assert all(len(m) >= 4 for m in grouped[1:-1]), grouped
    assert len(grouped) <= 1 + -(-22 // 4)  # far fewer messages than tokens
    assert not ae._held


def test_closing_a_stream_while_its_tokens_are_held_aborts_it_and_keeps_nothing(
        tiny_model_dir):
    tokens, _, ae = _stream(tiny_model_dir, 8, SamplingParams(max_new_tokens=200,
                                                              min_new_tokens=200),
                            stop_after=2)
    assert len(tokens) == 2 and len(tokens[1]) >= 8
    assert not ae._held
    assert not ae.engine.requests
    assert ae.engine.scheduler.allocator.num_used == 0
