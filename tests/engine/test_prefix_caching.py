"""Automatic prefix caching: full KV blocks found again by later prompts (hash chained over
the parent block), shared with reference counts, evicted least recently used; outputs equal
those computed without the cache."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.kv_cache import ROOT_HASH, BlockAllocator, block_hash
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Request, Sequence
from specdecode.config import SpeculativeConfig
from specdecode.worker import speculator_for
from tests.engine.test_engine import greedy, run_to_completion

BLOCK = 4


def hashes(tokens: list[int]) -> list[bytes]:
    out, parent = [], ROOT_HASH
    for i in range(len(tokens) // BLOCK):
        parent = block_hash(parent, tokens[i * BLOCK:(i + 1) * BLOCK])
        out.append(parent)
    return out


# ---- the allocator ---------------------------------------------------------------------

def cached_blocks(alloc: BlockAllocator, hs: list[bytes]) -> list[int]:
    """Blocks allocated for ``hs`` and made findable, still held."""
    blocks = alloc.allocate(len(hs))
    assert blocks is not None
    for b, h in zip(blocks, hs, strict=True):
        alloc.cache(b, h)
    return blocks

def test_a_block_hash_depends_on_everything_before_it():
    a, b = hashes([1, 2, 3, 4, 5, 6, 7, 8]), hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]  # same tokens in block 1, other parent
    assert hashes([1, 2, 3, 4, 5, 6, 7, 8]) == a


def test_lookup_finds_the_longest_cached_run_and_counts_queries_and_hits():
    alloc = BlockAllocator(8, caching=True)
    hs = hashes(list(range(12)))
    blocks = cached_blocks(alloc, hs)
    alloc.free(list(blocks))
    other = hashes([0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11])  # differs inside block 1
    assert alloc.lookup(other, BLOCK, 12) == blocks[:1]  # partial hit: block 0 only
    assert alloc.lookup(hs, BLOCK, 13) == blocks  # full hit
    assert alloc.lookup(hashes([7] * 8), BLOCK, 8) == []  # miss
    assert (alloc.stats.queries, alloc.stats.hits) == (33, 16)


def test_cached_blocks_nobody_holds_are_evicted_least_recently_used_first():
    alloc = BlockAllocator(3, caching=True)
    hs = hashes(list(range(12)))
    blocks = cached_blocks(alloc, hs)
    for b in (blocks[1], blocks[0], blocks[2]):  # freed in this order: LRU = 1, 0, 2
        alloc.free([b])
    assert alloc.num_used == 0 and alloc.num_cached == 3
    assert alloc.allocate(1) == [blocks[1]]  # the least recently used goes first
    assert alloc.lookup(hs[:1], BLOCK, 4) == [blocks[0]]
    assert alloc.num_cached == 2
    # caching never makes allocation fail: every block nobody holds can be taken
    alloc.free([blocks[0]])
    got = alloc.allocate(2)
    assert got is not None and sorted(got) == sorted([blocks[0], blocks[2]])
    assert alloc.num_cached == 0


def test_allocation_takes_every_free_block_before_evicting_a_cached_one():
    alloc = BlockAllocator(4, caching=True)
    alloc.free(cached_blocks(alloc, hashes(list(range(8)))))  # 2 cached, 2 never used
    got = alloc.allocate(3)  # more than the free list holds: one eviction is enough
    assert got is not None and len(set(got)) == 3
    assert alloc.num_cached == 1 and alloc.num_used == 3


def test_cached_blocks_nobody_holds_beyond_the_bound_are_evicted_when_freed():
    evicted: list[int] = []
    alloc = BlockAllocator(8, caching=True, on_evict=evicted.append, max_evictable=2)
    blocks = cached_blocks(alloc, hashes(list(range(12))))
    alloc.free(list(blocks))  # a chain is freed tail first: its tail goes first
    assert evicted == [blocks[2]] and alloc.num_cached == 2
    assert alloc.num_used == 0 and alloc.allocate(8) is not None  # all of them takeable


def test_a_shared_block_survives_one_sharers_free():
    alloc = BlockAllocator(2, caching=True)
    (b,) = alloc.allocate(1)
    h = hashes([1, 2, 3, 4])
    alloc.cache(b, h[0])
    assert alloc.lookup(h, BLOCK, 4) == [b]  # second holder
    alloc.free([b])
    assert alloc.num_used == 1  # still held by the other
    assert alloc.allocate(2) is None  # a held block is never handed out
    alloc.free([b])
    assert alloc.num_used == 0 and alloc.lookup(h, BLOCK, 4) == [b]


# ---- the engine ------------------------------------------------------------------------

SYSTEM = ("You are a careful assistant. Answer briefly and precisely, and say so when "
          "you do not know. ") * 3


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(SYSTEM + q)["input_ids"] for q in
            ("What is the capital of France?", "Name three prime numbers.",
             "How far is the Moon?")]


def engine(model_dir, caching: bool = True, **kw) -> LLMEngine:
    kw.setdefault("block_size", BLOCK)
    return LLMEngine(EngineConfig(model=str(model_dir), enable_prefix_caching=caching, **kw))


def run_one_by_one(eng: LLMEngine, prompts, params=None) -> tuple[list[list[int]], list[int]]:
    outs, cached = [], []
    for i, ids in enumerate(prompts):
        req = {}
        for out in _steps(eng, f"r{i}", ids, params or greedy(8)):
            req = out
        outs.append(req["tokens"])
        cached.append(req["cached"])
    return outs, cached


def _steps(eng: LLMEngine, rid: str, ids: list[int], params: SamplingParams):
    eng.add_request(rid, ids, params)
    tokens: list[int] = []
    while eng.has_work:
        for out in eng.step():
            for d in out.deltas:
                tokens.extend(d.token_ids)
            if out.finished:
                yield {"tokens": tokens, "cached": out.usage.cached_prompt_tokens}


def test_a_shared_system_prompt_is_computed_once_and_greedy_output_is_unchanged(
        tiny_model_dir, prompts):
    plain, plain_cached = run_one_by_one(engine(tiny_model_dir, caching=False), prompts)
    eng = engine(tiny_model_dir)
    cached_out, cached = run_one_by_one(eng, prompts)
    assert cached_out == plain
    assert plain_cached == [0, 0, 0]
    shared = min(
        next(i for i, (a, b) in enumerate(zip(prompts[0], p, strict=False)) if a != b)
        for p in prompts[1:])
    assert cached[0] == 0
    assert all(c == shared // BLOCK * BLOCK for c in cached[1:]), (cached, shared)
    stats = eng.stats()
    assert stats.prefix_cache_hits == sum(cached) and stats.prefix_cache_queries >= sum(
        len(p) for p in prompts)


def test_the_same_prompt_again_recomputes_only_its_last_token(tiny_model_dir, prompts):
    eng = engine(tiny_model_dir)
    first, _ = run_one_by_one(eng, prompts[:1])
    again, cached = run_one_by_one(eng, prompts[:1])
    assert again == first
    assert cached == [(len(prompts[0]) - 1) // BLOCK * BLOCK]


def test_a_request_asking_for_prompt_logprobs_gets_them_all_after_its_prompt_was_cached(
        tiny_model_dir, prompts):
    """Cached tokens have no logits, so a request that asks for prompt logprobs computes
    its whole prompt (as vLLM skips the cache for it); before, one that hit the cache got
    no prompt logprobs at all. Its prompt's blocks still serve later requests."""
    eng = engine(tiny_model_dir)
    run_one_by_one(eng, prompts[:1])
    eng.add_request("lp", prompts[0], SamplingParams(max_new_tokens=2, prompt_logprobs=1))
    got, cached = None, None
    while eng.has_work:
        for out in eng.step():
            got = out.prompt_logprobs or got
            if out.finished:
                cached = out.usage.cached_prompt_tokens
    fresh = engine(tiny_model_dir, caching=False)
    fresh.add_request("lp", prompts[0], SamplingParams(max_new_tokens=2, prompt_logprobs=1))
    want = None
    while fresh.has_work:
        for out in fresh.step():
            want = out.prompt_logprobs or want
    assert got is not None and want is not None
    assert [lp.token_id for lp in got] == prompts[0][1:]
    assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want], abs=1e-5)
    assert cached == 0
    assert run_one_by_one(eng, prompts[1:2])[1][0] > 0


def test_n_samples_prefill_their_prompt_once(tiny_model_dir, prompts, monkeypatch):
    eng = engine(tiny_model_dir)
    computed: list[int] = []
    real = eng.runner.execute

    def counting(decodes, prefills):
        computed.append(sum(len(p.token_ids) for p in prefills))
        return real(decodes, prefills)

    monkeypatch.setattr(eng.runner, "execute", counting)
    params = SamplingParams(n=4, max_new_tokens=6, min_new_tokens=6, temperature=0.8, seed=3)
    res = run_to_completion(eng, {0: [("r", prompts[0], params)]})
    assert len(res["r"]) == 4
    n = len(prompts[0])
    assert sum(computed) <= n + 3 * (n - (n - 1) // BLOCK * BLOCK)  # once + 3 tails
    off = engine(tiny_model_dir, caching=False)
    assert run_to_completion(off, {0: [("r", prompts[0], params)]})["r"][0].token_ids == \
        res["r"][0].token_ids


def test_speculation_preemption_and_aborts_with_shared_blocks_change_no_output(
        tiny_model_dir, prompts):
    """A small cache (preemption of sequences sharing blocks), n-gram speculation, a
    sharer aborted mid-run: greedy outputs equal a run without caching."""
    spec = SpeculativeConfig(method="ngram", num_spec_tokens=3, ngram_min=1, ngram_max=3,
                             disable_batch_size=64)
    probe = engine(tiny_model_dir, kv_cache_memory=1 << 20)
    per_block = probe.runner.kv_cache.spec.bytes_per_block  # type: ignore[attr-defined]
    arrivals = {0: [(f"r{i}", p, greedy(16)) for i, p in enumerate(prompts)],
                3: [("late", prompts[0] + prompts[1][-5:], greedy(16))]}
    outs = {}
    for caching in (False, True):
        eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=BLOCK,
                                     kv_cache_memory=per_block * 24,
                                     enable_prefix_caching=caching),
                        speculator=speculator_for(spec))
        eng.add_request("doomed", prompts[2], greedy(16))
        eng.step()
        eng.abort("doomed")
        while eng.has_work:  # collect the aborted request's last output
            eng.step()
        res = run_to_completion(eng, arrivals)
        outs[caching] = {r: c[0].token_ids for r, c in res.items()}
        assert eng.scheduler.allocator.num_used == 0
        if caching:  # shared prompt blocks let three run at once, then they outgrow it
            assert eng.scheduler.num_preemptions > 0
            assert eng.stats().prefix_cache_hits > 0
    assert outs[True] == outs[False]


def test_the_flag_turns_caching_off_and_the_torch_runner_needs_no_keeper(tiny_model_dir):
    eng = engine(tiny_model_dir)
    assert eng.info.prefix_caching and eng.runner.block_keeper is None
    assert not engine(tiny_model_dir, caching=False).info.prefix_caching


# ---- a runner that keeps cached blocks' KV itself (llama.cpp) --------------------------

class RecordingKeeper:
    """``BlockKeeper`` that records what the scheduler tells it; refuses some indices."""

    max_idle_blocks = 4
    idle_blocks_cost_steps = True
    host_bytes = 0

    def __init__(self, refuse: set[int]) -> None:
        self.refuse = refuse
        self.kept: list[int] = []
        self.evicted: list[int] = []
        self.demoted: list[list[int]] = []
        self.keep_tails = False
        self.tails: list[int] = []
        self.tail_lengths: list[int] = []
        self.granted: dict[int, int] = {}

    def keep(self, seq_id: int, block_table: list[int], index: int) -> bool:
        if index in self.refuse:
            return False
        self.kept.append(block_table[index])
        return True

    def evict(self, block: int) -> None:
        self.evicted.append(block)

    def keep_tail(self, seq_id: int, block_table: list[int], index: int, n: int) -> bool:
        self.tails.append(block_table[index])
        self.tail_lengths.append(n)
        return self.keep_tails

    def grant_tail(self, seq_id: int, block: int) -> None:
        self.granted[seq_id] = block

    def forget_grant(self, seq_id: int) -> None:
        self.granted.pop(seq_id, None)

    def demote(self, blocks: list[int]) -> None:
        self.demoted.append(list(blocks))

    def kv_pending(self, seq_id: int) -> bool:
        return False


def _run_prompt(sched: Scheduler, seq_id: int, prompt: list[int]) -> Sequence:
    """Admit ``prompt``, compute all of it in one step, and cache its full blocks."""
    seq = Sequence(seq_id, Request(f"r{seq_id}", prompt, SamplingParams()), 0, prompt,
                   None)  # type: ignore[arg-type]
    sched.add(seq)
    (scheduled,) = sched.schedule()
    seq.num_computed_tokens += scheduled.num_tokens
    sched.cache_blocks(seq)
    return seq


def test_a_runners_keeper_hears_of_cached_and_evicted_blocks_and_one_it_refuses_stays_private():
    keeper = RecordingKeeper(refuse={1})
    sched = Scheduler(num_blocks=4, block_size=BLOCK, max_num_seqs=4,
                      max_num_batched_tokens=64, prefix_caching=True, keeper=keeper)
    prompt = list(range(13))  # three full blocks and one token

    def admit(seq_id: int) -> Sequence:
        return _run_prompt(sched, seq_id, prompt)

    first = admit(0)
    b = list(first.block_table)
    assert keeper.kept == [b[0], b[2]]  # block 1 refused
    sched.remove(first)
    again = admit(1)
    assert again.request.usage.cached_prompt_tokens == BLOCK  # block 1 was never findable
    assert keeper.evicted == [b[2]]  # its room went to the new sequence's blocks
    assert keeper.kept[2:] == [again.block_table[2]]
    again_table = list(again.block_table)
    sched.remove(again)
    assert sched.allocator.allocate(4) is not None  # every block: the cached are evicted
    assert sorted(keeper.evicted[1:]) == sorted([b[0], again_table[2]])


def test_a_keeper_holds_fewer_idle_blocks_the_more_sequences_run():
    """llama.cpp's kept cells cost every running row: the idle cap is divided by them."""
    keeper = RecordingKeeper(refuse=set())  # max_idle_blocks = 4
    sched = Scheduler(num_blocks=32, block_size=BLOCK, max_num_seqs=8,
                      max_num_batched_tokens=256, prefix_caching=True, keeper=keeper)

    def start(seq_id: int, n: int) -> Sequence:
        prompt = [seq_id * 100 + t for t in range(n)]
        seq = Sequence(seq_id, Request(f"r{seq_id}", prompt, SamplingParams()), 0, prompt,
                       None)  # type: ignore[arg-type]
        sched.add(seq)
        return seq

    done = start(0, 4 * BLOCK)
    for scheduled in sched.schedule():
        scheduled.seq.num_computed_tokens += scheduled.num_tokens
        sched.cache_blocks(scheduled.seq)
    sched.remove(done)
    assert sched.allocator.num_cached == 4 and keeper.evicted == []  # idle, none running
    for i in (1, 2):
        start(i, 2)  # no full block: nothing of their own to cache
    sched.schedule()  # admits both; the cap applies from the next step on
    assert len(sched.running) == 2
    sched.schedule()
    assert sched.allocator.num_cached == 2  # 4 // 2 running
    assert keeper.evicted == done_table_tail(keeper, 2)


def done_table_tail(keeper: RecordingKeeper, n: int) -> list[int]:
    """The last ``n`` blocks kept, deepest first: the order an idle prompt's blocks go."""
    return keeper.kept[::-1][:n]


def test_a_keeper_that_moves_idle_blocks_out_hears_of_them_when_a_step_runs_and_keeps_them_all():
    """A keeper whose idle blocks cost no step (llama.cpp's host tier) keeps its whole cap
    under load, and is told of blocks gone idle only as a step is about to run, never of
    one a new prompt has just found."""
    keeper = RecordingKeeper(refuse=set())  # max_idle_blocks = 4
    keeper.idle_blocks_cost_steps = False
    sched = Scheduler(num_blocks=32, block_size=BLOCK, max_num_seqs=8,
                      max_num_batched_tokens=256, prefix_caching=True, keeper=keeper)

    def run(seq_id: int, prompt: list[int]) -> Sequence:
        seq = Sequence(seq_id, Request(f"r{seq_id}", prompt, SamplingParams()), 0, prompt,
                       None)  # type: ignore[arg-type]
        sched.add(seq)
        for scheduled in sched.schedule():
            scheduled.seq.num_computed_tokens += scheduled.num_tokens
            sched.cache_blocks(scheduled.seq)
        return seq

    a = run(0, list(range(3 * BLOCK + 1)))
    a_blocks = list(a.block_table[:3])
    sched.remove(a)
    assert sched.schedule() == [] and keeper.demoted == []  # nothing runs: nothing told
    b = run(1, list(range(2 * BLOCK)) + [999] * (BLOCK + 1))  # finds a's first two blocks
    assert keeper.demoted == [[a_blocks[2]]]  # the one it did not take
    for i in (2, 3):
        run(i, [i * 100 + t for t in range(2)])
    assert len(sched.running) == 3
    b_cached = b.block_table[:3]  # a's first two and its own full block
    sched.remove(b)
    sched.schedule()
    assert sorted(keeper.demoted[-1]) == sorted(b_cached)
    # all four cached blocks stay with three sequences running (4 // 3 would be 1)
    assert sched.allocator.num_cached == 4 and keeper.evicted == []


# ---- kept partial last blocks (a keeper that can hold them: llama.cpp) ------------------

def _tail_scheduler(keep: bool = True) -> tuple[Scheduler, RecordingKeeper]:
    keeper = RecordingKeeper(refuse=set())
    keeper.keep_tails = keep
    keeper.max_idle_blocks = 64
    sched = Scheduler(num_blocks=64, block_size=BLOCK, max_num_seqs=4,
                      max_num_batched_tokens=64, prefix_caching=True, keeper=keeper)
    return sched, keeper


def test_a_finished_sequences_partial_last_block_is_found_by_a_prompt_that_continues_it():
    sched, keeper = _tail_scheduler()
    first = _run_prompt(sched, 0, list(range(14)))  # three full blocks and two tokens
    tail = first.block_table[3]
    sched.remove(first)
    assert keeper.tails == [tail] and keeper.tail_lengths == [2]
    prompt = list(range(14)) + [90, 91, 92]
    seq = Sequence(1, Request("r1", prompt, SamplingParams()), 0, prompt,
                   None)  # type: ignore[arg-type]
    sched.add(seq)
    (scheduled,) = sched.schedule()
    # the full blocks and then the kept two tokens: it computes from token 14 on
    assert scheduled.num_tokens == len(prompt) - 14 and seq.num_computed_tokens == 14
    assert seq.block_table[3] == tail and keeper.granted == {1: tail}
    assert seq.request.usage.cached_prompt_tokens == 14
    assert sched.allocator.stats.hits == 14
    # taken private: a prompt diverging inside it does not find it
    assert sched.allocator.take(b"") is None and tail not in sched.allocator._hash_of


def test_a_partial_block_is_found_only_after_the_same_tokens_and_only_its_own_length():
    sched, keeper = _tail_scheduler()
    sched.remove(_run_prompt(sched, 0, list(range(14))))
    other = list(range(12)) + [77, 13, 50]  # token 12 differs: the tail does not continue
    seq = _run_prompt(sched, 1, other)
    assert seq.request.usage.cached_prompt_tokens == 12
    sched.remove(seq)
    shorter = list(range(13))  # only its first token comes next: no partial match
    seq2 = _run_prompt(sched, 2, shorter)
    assert seq2.request.usage.cached_prompt_tokens == 12 and 2 not in keeper.granted


def test_a_keeper_that_cannot_hold_a_partial_block_leaves_it_private():
    sched, keeper = _tail_scheduler(keep=False)
    first = _run_prompt(sched, 0, list(range(14)))
    tail = first.block_table[3]
    sched.remove(first)
    assert keeper.tails == [tail] and tail not in sched.allocator._hash_of
    seq = _run_prompt(sched, 1, list(range(14)) + [90])
    assert seq.request.usage.cached_prompt_tokens == 12 and not keeper.granted


def test_only_the_most_recent_partial_blocks_are_kept():
    from engine.scheduler import MAX_TAILS

    sched, keeper = _tail_scheduler()
    sched.allocator = BlockAllocator(4 * (MAX_TAILS + 2), caching=True,
                                     on_evict=keeper.evict, max_evictable=None,
                                     track_idle=True)
    tails = []
    for i in range(MAX_TAILS + 1):
        seq = _run_prompt(sched, i, [1000 * i + t for t in range(6)])  # a block and two
        tails.append(seq.block_table[1])
        sched.remove(seq)
    assert keeper.evicted == [tails[0]]  # the oldest went, its block free again
    seq = _run_prompt(sched, 99, [0, 1, 2, 3, 4, 5, 9])
    assert seq.request.usage.cached_prompt_tokens == 4  # its full block only
    sched.remove(seq)
    seq = _run_prompt(sched, 98, [1000 * MAX_TAILS + t for t in range(6)] + [5])
    assert seq.request.usage.cached_prompt_tokens == 6


def test_a_granted_partial_block_not_scheduled_after_all_is_forgotten():
    sched, keeper = _tail_scheduler()
    sched.remove(_run_prompt(sched, 0, list(range(14))))
    prompt = list(range(14)) + [90]
    seq = Sequence(1, Request("r1", prompt, SamplingParams()), 0, prompt,
                   None)  # type: ignore[arg-type]
    sched._use_cached(seq)
    assert keeper.granted == {1: seq.block_table[3]}
    sched._drop_cached(seq)
    assert keeper.granted == {} and seq.num_computed_tokens == 0
