"""Prefix caching with a KV stream per sequence (``--kv-streams``), real default GGUF:
cached blocks go to host memory when their sequence is released and are written into a
new sequence's own stream, so a shared system prompt, a chat's previous turn and a prompt
cached but for its last token are served from cache with llama.cpp's own greedy output
(f16 V, 512-token ubatches), also while the sequence that computed the blocks still runs
and is moved to a lower stream in the same step, and after a sharer is aborted.
Skipped where llama-cpp-python is not installed."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from engine.llm_engine import LLMEngine
from engine.loading.model_loader import default_model_path
from engine.runners.llamacpp import UBATCH
from engine.runners.llamacpp_stream_cache import StreamKeeper
from engine.runners.select import llama_cpp_available
from engine.sampling_params import SamplingParams
from tests.engine.runners.test_llamacpp_kv_streams import CELL, run
from tests.engine.runners.test_llamacpp_prefix_caching import (
    QUESTIONS,
    SYSTEM,
    _hashes,
    chat_turns,
    generate,
)
from tests.engine.runners.test_llamacpp_runner import THREADS, config

pytestmark = [pytest.mark.skipif(not llama_cpp_available(),
                                 reason="llama-cpp-python is not installed"),
              pytest.mark.usefixtures("torch_threads_restored")]

NEW = 16
STREAMS = 4


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    eng = LLMEngine(config(batch_invariant=False, kv_streams=True, max_model_len=512,
                           kv_cache_memory=STREAMS * 512 * CELL, torch_prefill_tokens=0))
    assert eng.info.prefix_caching and isinstance(eng.runner.block_keeper, StreamKeeper)
    return eng


@pytest.fixture(scope="module")
def llm():
    import llama_cpp

    llm = llama_cpp.Llama(default_model_path(), n_ctx=512, n_threads=THREADS,
                          flash_attn=True, n_ubatch=UBATCH, verbose=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def llama(llm):
    """llama.cpp's own greedy generation, as a --kv-streams context runs it."""
    def own(ids: list[int], n: int = NEW) -> list[int]:
        llm.reset()
        return list(itertools.islice(llm.generate(ids, temp=0.0, reset=True), n))
    return own


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def test_a_shared_system_prompt_is_written_from_host_memory_into_each_new_stream(
        engine, llama):
    bs = engine.config.block_size
    prompts = [engine.tokenizer(SYSTEM + q)["input_ids"] for q in QUESTIONS]
    shared = min(next(i for i, (a, b) in enumerate(zip(prompts[0], p, strict=False)) if a != b)
                 for p in prompts[1:])
    kept = engine.runner.block_keeper
    for i, ids in enumerate(prompts):
        tokens, cached = generate(engine, f"q{i}", ids)
        assert tokens == llama(ids), f"prompt {i}"
        assert cached == (0 if i == 0 else shared // bs * bs) and (i == 0 or cached > 0)
        assert kept._live == {} and engine.stats().prefix_cache_host_bytes > 0


def test_a_prompt_cached_but_for_its_last_token_starts_from_the_cached_blocks(engine, llama):
    bs = engine.config.block_size
    ids = engine.tokenizer("Café au lait, s'il vous plaît: one more, please\n")["input_ids"]
    ids = (ids * bs)[:bs + 1]  # one full block and one token: the decode-row path
    first, _ = generate(engine, "full1", ids, 4)
    again, cached = generate(engine, "full2", ids, 4)
    assert cached == bs and again == first == llama(ids, 4)


def test_a_chat_turn_gets_the_previous_turns_prompt_and_answer_in_one_write(engine, llm):
    """The second turn equals llama.cpp's own chat with its prompt cache (``generate``
    keeps the tokens it evaluated and computes only what follows them): the first answer's
    KV was computed a token at a time in both, where a fresh prefill of the whole second
    turn gets logits a few hundredths apart (a near tie here: 0.08)."""
    bs = engine.config.block_size
    turn1, answer, turn2 = chat_turns(engine)
    writes: list[int] = []
    host = engine.runner.block_keeper.host
    real = host.write_into

    def counted(blocks, seq):
        writes.append(len(blocks))
        real(blocks, seq)

    host.write_into = counted
    try:
        tokens, cached = generate(engine, "t2", turn2)
    finally:
        del host.write_into
    computed = len(turn1) + len(answer) - 1  # its full blocks, then its partial last one
    assert computed % bs and cached == computed > len(turn1)
    assert writes == [computed // bs + 1]  # one state: the blocks and the tail after them
    llm.reset()
    assert list(itertools.islice(llm.generate(turn1, temp=0.0, reset=True), 20)) == answer
    assert tokens == list(itertools.islice(llm.generate(turn2, temp=0.0, reset=True), NEW))
    assert engine.runner.block_keeper._grants == {}


def test_blocks_of_a_running_sequence_are_copied_out_before_it_moves_down_a_stream():
    """Two short requests take streams 0 and 1 and finish; the long one in stream 2 is
    still decoding when a request with its prompt arrives. That step moves the long one
    down to stream 0 (its copy happens only at the next decode), so its blocks must be
    read out of stream 2 first. Under --batch-invariant (batch mates change no output),
    both outputs equal each one's alone with caching off."""
    def streams_engine(caching: bool) -> LLMEngine:
        return LLMEngine(config(batch_invariant=True, max_model_len=512, torch_prefill_tokens=0,
                                kv_cache_memory=STREAMS * 512 * CELL,
                                enable_prefix_caching=caching))

    engine = streams_engine(True)
    runner = engine.runner
    bs = engine.config.block_size
    long_ids = engine.tokenizer(SYSTEM * 2 + QUESTIONS[1])["input_ids"]
    other = [engine.tokenizer(f"Tell me about {w}.")["input_ids"] for w in ("rope", "glue")]
    slots: dict[str, set[int]] = {}
    real = runner._pack_streams

    def watched(decodes, prefills):
        real(decodes, prefills)
        ids_of = {s.seq_id: r.request_id for r in engine.requests.values()
                  for s in r.sequences}
        for seq, slot in runner._slot_of.items():
            slots.setdefault(ids_of[seq], set()).add(slot)

    runner._pack_streams = watched
    try:
        got = run(engine, {0: [("x0", other[0], greedy(2)), ("x1", other[1], greedy(2)),
                               ("long", long_ids, greedy(40))],
                           2: [("hit", long_ids, greedy(NEW))]})
    finally:
        del runner._pack_streams
    assert slots["long"] == {2, 0} and slots["hit"] == {1}
    alone = streams_engine(False)
    assert got["long"] == run(alone, {0: [("a", long_ids, greedy(40))]})["a"]
    assert got["hit"] == run(alone, {0: [("a", long_ids, greedy(NEW))]})["a"]
    assert engine.stats().prefix_cache_hits >= (len(long_ids) - 1) // bs * bs


def test_n_samples_prefill_once_and_an_aborted_sharer_leaves_the_blocks_cached(engine, llama):
    """``n = 2``: the second sample waits for the first's prompt blocks and gets them out
    of its stream; aborting the request keeps the blocks cached (in host memory), and a
    later prompt gets them back bit-exact."""
    bs = engine.config.block_size
    ids = engine.tokenizer("A customer asks about garden hoses. " * 6 + QUESTIONS[2])[
        "input_ids"]
    hits = engine.stats().prefix_cache_hits
    engine.add_request("two", ids, SamplingParams(n=2, max_new_tokens=30, ignore_eos=True))
    for _ in range(6):
        engine.step()
    full = (len(ids) - 1) // bs
    assert engine.stats().prefix_cache_hits - hits == full * bs  # the second sample's
    kept = engine.runner.block_keeper
    blocks = engine.scheduler.allocator.lookup(_hashes(engine, ids), bs, len(ids))
    engine.scheduler.allocator.free(list(blocks))
    assert len(blocks) == full and all(b in kept.host for b in blocks)
    rows = {b: [r.copy() for r in kept.host.rows(b)] for b in blocks}
    engine.abort("two")
    while engine.has_work:
        engine.step()
    assert kept._live == {} and all(b in kept.host for b in blocks)
    tokens, cached = generate(engine, "after", ids)
    assert cached == full * bs and tokens == llama(ids)
    for b in blocks:
        assert all(np.array_equal(a, c) for a, c in zip(kept.host.rows(b), rows[b],
                                                        strict=True))
