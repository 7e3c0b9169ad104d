"""Scheduler and block allocator: token budget, chunked prefill, preemption order, block
growth for proposals, freeing. Plain sequences, no model."""

from __future__ import annotations

import pytest

from engine.kv_cache import BlockAllocator
from engine.scheduler import Scheduler
from engine.sequence import SeqStatus, Sequence


def seq(i: int, prompt_len: int) -> Sequence:
    return Sequence(i, None, 0, list(range(prompt_len)), None)  # type: ignore[arg-type]


def step(sched: Scheduler) -> list[tuple[int, int, bool]]:
    """Schedule, then pretend the forward ran (and a token was sampled where due)."""
    out = sched.schedule()
    for s in out:
        s.seq.num_computed_tokens += s.num_tokens
        if s.samples:
            s.seq.output_token_ids.append(0)
    return [(s.seq.seq_id, s.num_tokens, s.samples) for s in out]


def test_the_token_budget_chunks_prefills_and_admits_in_arrival_order():
    sched = Scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=16)
    for i, n in enumerate([10, 10, 10]):
        sched.add(seq(i, n))
    assert step(sched) == [(0, 10, True), (1, 6, False)]
    # running sequences go first: 0 decodes, 1 finishes its prefill, 2 gets the rest
    assert step(sched) == [(0, 1, True), (1, 4, True), (2, 10, True)]
    assert step(sched) == [(0, 1, True), (1, 1, True), (2, 1, True)]


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks_sampled_only_at_the_end():
    sched = Scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=16)
    sched.add(seq(0, 40))
    assert [step(sched) for _ in range(4)] == [[(0, 16, False)], [(0, 16, False)],
                                              [(0, 8, True)], [(0, 1, True)]]


def test_max_num_seqs_bounds_the_running_set():
    sched = Scheduler(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        sched.add(seq(i, 3))
    assert [s for s, _, _ in step(sched)] == [0, 1]
    assert len(sched.waiting) == 1


def test_blocks_grow_with_the_sequence_and_are_freed_on_remove():
    sched = Scheduler(num_blocks=8, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    s = seq(0, 5)
    sched.add(s)
    step(sched)
    assert len(s.block_table) == 2  # 5 tokens
    for _ in range(3):
        step(sched)  # tokens 6, 7, 8 computed
    assert len(s.block_table) == 2
    step(sched)  # the 9th token needs a third block
    assert len(s.block_table) == 3 and sched.allocator.num_used == 3
    sched.remove(s)
    assert s.block_table == [] and sched.allocator.num_used == 0
    assert not sched.running


def test_memory_pressure_preempts_the_latest_arrival_which_keeps_its_output():
    sched = Scheduler(num_blocks=4, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq(0, 4), seq(1, 4)
    sched.add(a)
    sched.add(b)
    step(sched)  # each holds 1 block, has 1 output token
    step(sched)  # 5 tokens each: 2 blocks each, all 4 used
    assert sched.allocator.num_used == 4
    for _ in range(4):
        step(sched)
    # a needed a third block: b (the latest arrival) was preempted, a went on
    assert sched.num_preemptions == 1 and b.num_preemptions == 1
    assert b.status is SeqStatus.WAITING and sched.waiting[0] is b
    assert b.num_computed_tokens == 0 and b.block_table == []
    assert len(b.output_token_ids) == 5  # kept: it is recomputed, not restarted
    assert a.status is SeqStatus.RUNNING and len(a.block_table) == 3
    sched.remove(a)
    out = step(sched)  # b comes back and prefills prompt + output at once
    assert out == [(1, 9, True)]


def test_a_sequence_that_alone_exceeds_memory_preempts_itself():
    sched = Scheduler(num_blocks=2, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    s = seq(0, 8)
    sched.add(s)
    step(sched)
    assert step(sched) == [] and s.status is SeqStatus.WAITING


def test_reserve_grows_blocks_for_proposals_without_preempting():
    sched = Scheduler(num_blocks=3, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq(0, 4), seq(1, 4)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.reserve(a, a.num_tokens + 3)  # 8 tokens: a second block
    assert len(a.block_table) == 2
    assert not sched.reserve(b, b.num_tokens + 8)  # would need 3 more: refused, none taken
    assert len(b.block_table) == 1 and sched.allocator.num_used == 3
    assert sched.num_preemptions == 0 and a.status is b.status is SeqStatus.RUNNING


def test_the_allocator_never_hands_out_a_block_twice_and_refuses_whole():
    alloc = BlockAllocator(5)
    first = alloc.allocate(3)
    assert first is not None and alloc.allocate(3) is None and alloc.num_used == 3
    second = alloc.allocate(2)
    assert second is not None and not set(first) & set(second)
    assert sorted(first + second) == list(range(5))
    alloc.free(first)
    assert first == [] and alloc.num_used == 2
    again = alloc.allocate(3)
    assert again is not None and not set(again) & set(second)


@pytest.mark.parametrize("budget", [1, 7])
def test_the_budget_is_never_exceeded(budget):
    sched = Scheduler(num_blocks=64, block_size=4, max_num_seqs=8,
                      max_num_batched_tokens=budget)
    for i, n in enumerate([5, 9, 2]):
        sched.add(seq(i, n))
    for _ in range(12):
        assert sum(n for _, n, _ in step(sched)) <= budget


def long_prefill_scheduler(**kw) -> Scheduler:
    base = dict(num_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                long_prefill_token_threshold=16)
    base.update(kw)
    return Scheduler(**base)  # type: ignore[arg-type]


def test_a_long_prefill_beside_another_sequence_gets_at_most_the_threshold_a_step():
    sched = long_prefill_scheduler()
    sched.add(seq(1, 4))
    sched.add(seq(0, 40))
    assert [step(sched) for _ in range(4)] == [
        [(1, 4, True), (0, 16, False)], [(1, 1, True), (0, 16, False)],
        [(1, 1, True), (0, 8, True)], [(1, 1, True), (0, 1, True)]]


def test_a_long_prefill_alone_takes_twice_the_threshold_until_another_request_comes():
    sched = long_prefill_scheduler()
    sched.add(seq(0, 100))
    assert step(sched) == [(0, 32, False)]  # nobody else: a bigger chunk shortens no step
    sched.add(seq(1, 10))
    assert step(sched) == [(0, 16, False), (1, 10, True)]  # the threshold again at once


def test_a_short_prompt_arriving_during_a_long_prefill_is_prefilled_and_decoded_beside_it():
    sched = long_prefill_scheduler()
    sched.add(seq(0, 100))
    assert step(sched) == [(0, 32, False)]  # alone: twice the threshold
    sched.add(seq(1, 10))
    assert step(sched) == [(0, 16, False), (1, 10, True)]  # its first token: this step
    assert step(sched) == [(0, 16, False), (1, 1, True)]


def test_without_a_threshold_a_long_prefill_takes_the_whole_budget_and_blocks_the_queue():
    """Today's behaviour with the threshold off (0): the head-of-line blocking it fixes."""
    sched = long_prefill_scheduler(long_prefill_token_threshold=0)
    sched.add(seq(0, 200))
    step(sched)
    sched.add(seq(1, 10))
    assert step(sched) == [(0, 64, False)] and step(sched) == [(0, 64, False)]


def test_a_second_long_prompt_waits_and_short_ones_queued_behind_it_go_first():
    sched = long_prefill_scheduler()
    for i, n in enumerate([100, 100, 10]):
        sched.add(seq(i, n))
    assert step(sched) == [(0, 16, False), (2, 10, True)]
    assert [s.seq_id for s in sched.waiting] == [1]
    for _ in range(5):  # 0 prefills tokens 16..95; 1 waits while 0 has more than 16 left
        assert step(sched) == [(0, 16, False), (2, 1, True)]
    # 0's last 4 tokens: no longer long, so 1 starts beside it
    assert step(sched) == [(0, 4, True), (2, 1, True), (1, 16, False)]


def test_max_long_partial_prefills_lets_that_many_long_prompts_prefill_at_once():
    sched = long_prefill_scheduler(max_long_partial_prefills=2)
    for i in range(3):
        sched.add(seq(i, 100))
    assert step(sched) == [(0, 16, False), (1, 16, False)]
    assert [s.seq_id for s in sched.waiting] == [2]


def test_the_long_prefill_limits_are_validated():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        long_prefill_scheduler(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        long_prefill_scheduler(max_long_partial_prefills=0)


def adapter_seq(i: int, prompt_len: int, slot: int) -> Sequence:
    """A sequence of a request running with LoRA adapter slot ``slot`` (0 = base)."""
    from types import SimpleNamespace

    return Sequence(i, SimpleNamespace(adapter_slot=slot), 0,  # type: ignore[arg-type]
                    list(range(prompt_len)), None)  # type: ignore[arg-type]


def test_without_mixed_adapters_the_adapter_slots_take_turns_one_step_each():
    """A runner that sets adapters per step (llama.cpp) gets steps of one slot; the slots
    with sequences take turns, so every sequence advances one token per round."""
    sched = Scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                      mixed_adapters=False, adapter_turn_steps=1)
    slots = {0: 0, 1: 1, 2: 0, 3: 2, 4: 1}  # seq id -> adapter slot
    for i, slot in slots.items():
        sched.add(adapter_seq(i, 3, slot))
    served = []
    for _ in range(9):
        out = step(sched)
        assert len({slots[i] for i, _, _ in out}) == 1
        served.append((slots[out[0][0]], sorted(i for i, _, _ in out)))
    assert served == [(0, [0, 2]), (1, [1, 4]), (2, [3])] * 3
    assert all(len(s.output_token_ids) == 3 for s in sched.running)


def test_an_adapter_slot_that_cannot_run_passes_its_turn():
    """No seat for slot 1's waiting prompt: its turn goes to the base rows, never an empty
    step; it runs once a seat frees."""
    sched = Scheduler(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64,
                      mixed_adapters=False, adapter_turn_steps=1)
    a, b, c = adapter_seq(0, 3, 0), adapter_seq(1, 3, 0), adapter_seq(2, 3, 1)
    for s in (a, b, c):
        sched.add(s)
    assert [step(sched) for _ in range(3)] == [[(0, 3, True), (1, 3, True)],
                                               [(0, 1, True), (1, 1, True)],
                                               [(0, 1, True), (1, 1, True)]]
    sched.remove(a)
    assert step(sched) == [(2, 3, True)]
    assert step(sched) == [(1, 1, True)]


def test_an_adapter_turn_lasts_adapter_turn_steps_steps_while_the_slot_has_work():
    """Turns of 3 steps (each adapter change costs llama.cpp a graph rebuild); a slot whose
    sequences finish mid-turn hands the turn on at once."""
    sched = Scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                      mixed_adapters=False, adapter_turn_steps=3)
    a, b = adapter_seq(0, 3, 0), adapter_seq(1, 3, 1)
    sched.add(a)
    sched.add(b)
    assert [step(sched)[0][0] for _ in range(7)] == [0, 0, 0, 1, 1, 1, 0]
    sched.remove(a)
    assert [step(sched)[0][0] for _ in range(2)] == [1, 1]
