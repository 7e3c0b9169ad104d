"""Prefix caching on the llama.cpp runner, real default GGUF: a shared system prompt and a
chat's previous turn are served from cached cells (``Usage.cached_prompt_tokens``) and the
greedy output is llama.cpp's own; in a small cache, eviction and preemption change no
output and free every kept cell. On the unified KV cache (no --batch-invariant, whose KV
streams turn prefix caching off), in ubatches under 64 tokens as the reference runs them.
Skipped where llama-cpp-python is not installed."""

from __future__ import annotations

import itertools

import pytest

from engine.llm_engine import LLMEngine
from engine.loading.model_loader import default_model_path
from engine.runners.llamacpp import INVARIANT_UBATCH
from engine.runners.select import llama_cpp_available
from tests.engine.runners.test_llamacpp_runner import THREADS, config, greedy
from tests.engine.test_engine import run_to_completion

pytestmark = [pytest.mark.skipif(not llama_cpp_available(),
                                 reason="llama-cpp-python is not installed"),
              pytest.mark.usefixtures("torch_threads_restored")]

SYSTEM = ("You are a careful assistant for a hardware shop. Answer briefly, name the aisle "
          "of every product, and say so when you do not know. ")
QUESTIONS = ["Where are the hammers?", "Do you sell blue paint?", "When do you open?"]
NEW = 16


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    eng = LLMEngine(config(batch_invariant=False))
    assert eng.info.prefix_caching
    return eng


@pytest.fixture(scope="module")
def llama():
    """llama.cpp's own greedy generation, as the runner's context runs it."""
    import llama_cpp

    llm = llama_cpp.Llama(default_model_path(), n_ctx=1024, n_threads=THREADS,
                          flash_attn=True, n_ubatch=INVARIANT_UBATCH, verbose=False)
    yield lambda ids, n=NEW: list(itertools.islice(llm.generate(ids, temp=0.0, reset=True),
                                                   n))
    llm.close()


def generate(eng: LLMEngine, rid: str, ids: list[int], n: int = NEW) -> tuple[list[int], int]:
    """Greedy tokens and ``Usage.cached_prompt_tokens`` of one request run alone."""
    eng.add_request(rid, ids, greedy(n))
    tokens: list[int] = []
    cached = -1
    while eng.has_work:
        for out in eng.step():
            tokens += [t for d in out.deltas for t in d.token_ids]
            if out.finished:
                cached = out.usage.cached_prompt_tokens
    return tokens, cached


def test_a_shared_system_prompt_is_served_from_cache_with_llama_cpps_own_output(engine, llama):
    bs = engine.config.block_size
    prompts = [engine.tokenizer(SYSTEM + q)["input_ids"] for q in QUESTIONS]
    shared = min(next(i for i, (a, b) in enumerate(zip(prompts[0], p, strict=False)) if a != b)
                 for p in prompts[1:])
    hits = engine.stats().prefix_cache_hits
    for i, ids in enumerate(prompts):
        tokens, cached = generate(engine, f"q{i}", ids)
        assert tokens == llama(ids), f"prompt {i}"
        assert cached == (0 if i == 0 else shared // bs * bs) and (i == 0 or cached > 0)
    assert engine.stats().prefix_cache_hits - hits == 2 * (shared // bs * bs)


def test_a_prompt_cached_but_for_its_last_token_starts_from_the_cached_cells(engine, llama):
    """The scheduler runs a prompt's one uncached token as a decode row; a sequence new to
    the runner must take the cached cells there too (it crashed the engine loop once)."""
    bs = engine.config.block_size
    ids = engine.tokenizer("Café au lait, s'il vous plaît: one more, please\n")["input_ids"]
    ids = (ids * bs)[:bs + 1]  # one full block and one token
    first, _ = generate(engine, "full1", ids, 4)
    again, cached = generate(engine, "full2", ids, 4)
    assert cached == bs and again == first == llama(ids, 4)


def chat_turns(eng: LLMEngine) -> tuple[list[int], list[int], list[int]]:
    """A chat's first turn, its greedy 20-token answer (run alone), and the second turn
    that resends both."""
    turn1 = list(eng.tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}],
        add_generation_prompt=True, tokenize=True)["input_ids"])
    answer, _ = generate(eng, "t1", turn1, 20)
    turn2 = turn1 + answer + eng.tokenizer("<|im_end|>\n<|im_start|>user\nThanks!"
                                           "<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    return turn1, answer, turn2


def test_a_chat_turn_reuses_the_previous_turns_prompt_and_answer(engine, llama):
    bs = engine.config.block_size
    turn1, answer, turn2 = chat_turns(engine)
    tokens, cached = generate(engine, "t2", turn2)
    # every computed token of the first turn: its prompt and its answer but the last token
    # (sampled, never fed back); its full blocks, then its kept partial last block
    computed = len(turn1) + len(answer) - 1
    assert computed % bs  # (the partial block's reuse is what this checks)
    assert cached == computed > len(turn1)
    assert tokens == llama(turn2)
    assert engine.runner.block_keeper._grants == {}  # the tail's cells were taken


def test_idle_cached_blocks_go_to_host_memory_and_come_back_bit_exact(engine, llama):
    """A finished request's blocks leave llama.cpp's cells when another request runs, and
    a later prompt that finds them gets the very rows back."""
    from engine.runners.llamacpp_host_blocks import get_state, parse_state

    kept = engine.runner.block_keeper
    assert kept.host is not None and not kept.idle_blocks_cost_steps
    lc, ctx = engine.runner.llama_cpp, engine.runner.ctx
    ids = engine.tokenizer("A customer asks about garden hoses. " * 6 + QUESTIONS[1])["input_ids"]
    first, _ = generate(engine, "h1", ids)
    blocks = list(engine.scheduler.allocator.lookup(  # the prompt's cached blocks...
        [h for h in _hashes(engine, ids)], engine.config.block_size, len(ids)))
    engine.scheduler.allocator.free(blocks[:])
    assert blocks and not any(b in list(kept.host) for b in blocks)  # ...still in cells
    rows = {b: [r.copy() for r in _rows_of(kept, b, lc, ctx, parse_state, get_state)]
            for b in blocks}
    generate(engine, "other", engine.tokenizer("Tell me about ladders.")["input_ids"], 4)
    assert all(b in list(kept.host) and b not in kept._where for b in blocks)
    block_bytes = 2 * 30 * 3 * 64 * 2 * engine.config.block_size  # K, V; 30 layers; f16
    assert engine.stats().prefix_cache_host_bytes >= len(blocks) * block_bytes
    for b in blocks:  # what went out is what llama.cpp had
        assert all((a == c).all() for a, c in zip(kept.host.rows(b), rows[b], strict=True))
    again, cached = generate(engine, "h2", ids)
    assert cached == len(blocks) * engine.config.block_size
    assert again == first == llama(ids)
    for b in blocks:  # back in a keeper's cells, the host copy gone
        assert b in kept._where and b not in list(kept.host)
        assert all((a == c).all() for a, c in zip(
            _rows_of(kept, b, lc, ctx, parse_state, get_state), rows[b], strict=True))


def test_a_run_llama_cpp_has_no_room_for_is_written_back_in_pieces(engine, llama):
    """llama.cpp restores a state into one run of consecutive free cells; where it refuses a
    run, the keeper halves it until it fits, and the output is the same."""
    kept = engine.runner.block_keeper
    host = kept.host
    ids = engine.tokenizer("A customer asks about drills and saws. " * 6 + QUESTIONS[2])[
        "input_ids"]
    first, _ = generate(engine, "p1", ids)
    generate(engine, "p-other", engine.tokenizer("Tell me about rope.")["input_ids"], 4)
    writes: list[int] = []
    real = host.lib

    class Cramped:  # llama.cpp with no run of free cells longer than 5
        def __getattr__(self, name):
            return getattr(real, name)

        def llama_state_seq_set_data(self, ctx, buf, size, seq):
            cells = int.from_bytes(bytes(buf[12:16]), "little")
            writes.append(cells)
            return 0 if cells > 5 else real.llama_state_seq_set_data(ctx, buf, size, seq)

    host.lib = Cramped()
    try:
        again, cached = generate(engine, "p2", ids)
    finally:
        host.lib = real
    bs = engine.config.block_size
    assert cached >= 2 * bs and again == first == llama(ids)
    assert sum(n for n in writes if n <= 5) == cached  # every cached position, in pieces


def _hashes(engine: LLMEngine, ids: list[int]) -> list[bytes]:
    from engine.kv_cache import block_hash, root_hash

    bs, parent, out = engine.config.block_size, root_hash(), []
    for i in range((len(ids) - 1) // bs):
        parent = block_hash(parent, ids[i * bs:(i + 1) * bs])
        out.append(parent)
    return out


def _rows_of(kept, block: int, lc, ctx, parse_state, get_state) -> list:
    """A kept block's K and V rows as llama.cpp holds them in its keeper's cells."""
    keeper, index = kept._where[block]
    bs = kept.block_size
    state = parse_state(get_state(lc, ctx, keeper))
    mine = (state.positions >= index * bs) & (state.positions < (index + 1) * bs)
    order = state.positions[mine].argsort()
    return [p[mine][order] for p in state.parts]


@pytest.mark.parametrize("host", [False, True], ids=["idle-in-cells", "idle-in-host"])
def test_eviction_and_preemption_in_a_small_cache_change_no_output_and_free_kept_cells(
        llama, host):
    # 20 blocks of 4 cells: three of these prompts with their outputs outgrow it even with
    # their shared blocks, so the scheduler preempts; cached blocks nobody holds are
    # evicted to make room.
    block = 2 * 30 * 3 * 64 * 2 * 4  # K and V, 30 layers, 3 KV heads of 64, f16, 4 tokens
    tight = LLMEngine(config(max_num_batched_tokens=7, block_size=4, kv_cache_memory=20 * block,
                            batch_invariant=False, prefix_cache_host_memory=None if host else 0))
    assert (tight.runner.block_keeper.host is not None) == host  # type: ignore[union-attr]
    prompts = [tight.tokenizer("Answer briefly and name the aisle. " * 4 + q)["input_ids"]
               for q in QUESTIONS]
    kept = tight.runner.block_keeper
    evicted: list[int] = []
    evict = kept.evict  # type: ignore[union-attr]

    def counting(b: int) -> None:
        evicted.append(b)
        evict(b)

    tight.scheduler.allocator.on_evict = counting
    res = run_to_completion(tight, {0: [(f"c{i}", p, greedy(24))
                                        for i, p in enumerate(prompts)]})
    assert tight.scheduler.num_preemptions > 0 and evicted
    assert tight.stats().prefix_cache_hits > 0
    for i, p in enumerate(prompts):
        if host:  # blocks written back where cells are free, not where they were computed
            assert_equal_but_for_near_ties(res[f"c{i}"][0].token_ids, p, 24)
        else:
            assert res[f"c{i}"][0].token_ids == llama(p, 24), f"prompt {i}"
    # Every cached block's cells are kept, and evicting them all frees every kept cell.
    alloc = tight.scheduler.allocator
    assert alloc.num_used == 0 and kept.num_kept == alloc.num_cached > 0  # type: ignore[union-attr]
    assert alloc.allocate(alloc.num_blocks) is not None
    lc, memory = tight.runner.llama_cpp, tight.runner.memory  # type: ignore[attr-defined]
    assert all(lc.llama_memory_seq_pos_max(memory, s) == -1 for s in range(256))


NEAR_TIE = 0.5  # logits; llama.cpp's f16 attention moves a logit ~0.1-0.4 with cell order


def assert_equal_but_for_near_ties(got: list[int], prompt: list[int], n: int) -> None:
    """``got`` is llama.cpp's own greedy output, or leaves it only where llama.cpp's own top
    two logits were within ``NEAR_TIE`` (its flash attention accumulates V in f16, in the
    order the cells lie, so a sequence whose cells lie in another order gets logits a few
    tenths apart: measured 0.38 at most over 900 cells)."""
    import llama_cpp

    llm = llama_cpp.Llama(default_model_path(), n_ctx=1024, n_threads=THREADS,
                          flash_attn=True, n_ubatch=INVARIANT_UBATCH, logits_all=True,
                          verbose=False)
    try:
        own = list(itertools.islice(llm.generate(prompt, temp=0.0, reset=True), n))
        d = next((j for j, (a, b) in enumerate(zip(own, got, strict=True)) if a != b), None)
        if d is None:
            return
        llm.reset()
        llm.eval(prompt + own[:d])
        logits = llm.scores[llm.n_tokens - 1]
        assert logits[own[d]] - logits[got[d]] < NEAR_TIE, (
            f"token {d}: {got[d]} where llama.cpp's own top token {own[d]} leads it by "
            f"{logits[own[d]] - logits[got[d]]:.3f}")
    finally:
        llm.close()


def test_a_kept_partial_block_holds_only_its_computed_positions(engine):
    """Cells past a sequence's computed tokens (rejected speculative proposals, until the
    next step trims them) must not go with its partial block to a later sequence."""
    runner, kept, lc = engine.runner, engine.runner.block_keeper, engine.runner.llama_cpp
    bs = engine.config.block_size
    ids = engine.tokenizer("Hammers, nails and screws are in aisle seven. " * 8)["input_ids"]
    ids = ids[:2 * bs + 5]
    assert len(ids) == 2 * bs + 5
    seq_id = 10_000
    slot = runner._slot(seq_id, 0)
    runner._decode(ids, list(range(len(ids))), [slot] * len(ids), [len(ids) - 1])
    table = [-1, -2, -3]  # block ids no real sequence has
    from engine.runners.llamacpp_host_blocks import get_state, parse_state

    def positions_at_block_2(keeper: int) -> list[int]:
        pos = parse_state(get_state(lc, runner.ctx, keeper)).positions
        return sorted(int(p) for p in pos if 2 * bs <= p < 3 * bs)

    try:
        assert kept.keep_tail(seq_id, table, 2, 3)  # 3 computed of the 5 cells there
        keeper, index, n = kept._tails[-3]
        assert n == 3
        assert index == 2
        assert positions_at_block_2(keeper) == [2 * bs, 2 * bs + 1, 2 * bs + 2]
    finally:
        kept.evict(-3)
        runner.release(seq_id)
    assert positions_at_block_2(keeper) == []
