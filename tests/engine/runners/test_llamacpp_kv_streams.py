"""``--batch-invariant`` on the llama.cpp runner, real default GGUF: one KV stream per
sequence keeps each sequence's cells in position order, so a request's greedy and seeded
sampled output alone equals its output under staggered load where batch mates finish and
are aborted (freeing cells before its older ones), with n-gram speculation on or off.
The streams are sized from the KV budget, cap the engine's concurrency, and refuse to
start when not even one fits; prefix caching goes through host memory
(test_llamacpp_stream_prefix_caching.py). Skipped where llama-cpp-python is not installed."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import Completion
from engine.runners.llamacpp_stream_cache import StreamKeeper
from engine.runners.llamacpp_streams import kv_streams
from engine.runners.select import llama_cpp_available
from engine.sampling_params import SamplingParams
from specdecode.config import SpeculativeConfig
from specdecode.worker import speculator_for
from tests.engine.long_prefill import prompt_of
from tests.engine.runners.test_llamacpp_runner import PROMPTS, THREADS

pytestmark = [pytest.mark.skipif(not llama_cpp_available(),
                                 reason="llama-cpp-python is not installed"),
              pytest.mark.usefixtures("torch_threads_restored")]

CELL = 30 * 3 * 64 * 2 * 2  # bytes of one cell: 30 layers, 3 KV heads of 64, K and V f16
STREAMS = 8
NEW = 32
COPY = ("Repeat this list exactly: apples, bananas, cherries, dates, elderberries, figs.\n"
        "List: apples,")  # n-gram proposals get accepted (and some rejected)


def config(**kw) -> EngineConfig:
    base = dict(model="default", runner="llamacpp", max_model_len=256, threads=THREADS,
                kv_cache_memory=STREAMS * 256 * CELL, max_num_seqs=16, batch_invariant=True,
                requantize="none", enable_prefix_caching=True)
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(config())


@pytest.fixture(scope="module")
def speculating(engine) -> LLMEngine:
    eng = LLMEngine(config(), speculator=speculator_for(
        SpeculativeConfig(method="ngram", num_spec_tokens=4)))
    eng.runner._row_cost = 0.0  # type: ignore[attr-defined]  # propose every step
    return eng


@pytest.fixture(scope="module")
def ids(engine) -> list[list[int]]:
    return [engine.tokenizer(p)["input_ids"] for p in [*PROMPTS[:4], COPY]]


def run(eng: LLMEngine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
        aborts: dict[int, list[str]] | None = None) -> dict[str, list[int]]:
    """Add requests and abort others at the given step numbers; each request's tokens."""
    out: dict[str, Completion] = {}
    step = 0
    while step <= max(arrivals) or eng.has_work:
        for rid, prompt, params in arrivals.get(step, []):
            eng.add_request(rid, prompt, params)
            out[rid] = Completion(0)
        for rid in (aborts or {}).get(step, []):
            eng.abort(rid)
        for o in eng.step():
            for d in o.deltas:
                out[o.request_id].add(d)
        step += 1
    return {rid: c.token_ids for rid, c in out.items()}


def params(kind: str, i: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    return SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.9, top_p=0.95,
                          seed=100 + i)


def under_load(eng: LLMEngine, ids: list[list[int]], kind: str) -> list[list[int]]:
    """The measured requests among mates that arrive first, then finish or are aborted
    while the measured ones run: on one unified cache, the measured sequences' later
    tokens land in the cells the mates freed, before their older ones."""
    def mate(rid: str, i: int, n: int) -> tuple[str, list[int], SamplingParams]:
        return rid, ids[i], SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=1.0)

    half = len(ids) // 2
    got = run(eng, {0: [mate("m0", 0, 3), mate("m1", 1, 6), mate("m2", 2, 30)],
                    1: [(f"b{i}", p, params(kind, i)) for i, p in enumerate(ids[:half])],
                    4: [mate("m3", 3, 5)],
                    5: [(f"b{i}", p, params(kind, i)) for i, p in enumerate(ids) if i >= half],
                    9: [mate("m4", 4, 4), mate("m5", 0, 12)]},
              aborts={7: ["m2"], 12: ["m5"]})
    return [got[f"b{i}"] for i in range(len(ids))]


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_output_alone_equals_output_under_load_with_speculation_on_or_off(
        engine, speculating, ids, kind):
    alone = [run(engine, {0: [("a", p, params(kind, i))]})["a"] for i, p in enumerate(ids)]
    assert under_load(engine, ids, kind) == alone
    assert under_load(speculating, ids, kind) == alone
    assert speculating.stats().spec.accepted > 0
    for eng in (engine, speculating):
        assert eng.scheduler.allocator.num_used == 0


def test_one_stream_per_sequence_caps_concurrency_and_caches_prefixes_in_host_memory(engine):
    runner = engine.runner
    lc = runner.llama_cpp  # type: ignore[attr-defined]
    assert lc.llama_n_ctx_seq(runner.ctx) == 256  # type: ignore[attr-defined]
    assert lc.llama_n_ctx(runner.ctx) == STREAMS * 256  # type: ignore[attr-defined]
    assert engine.config.max_num_seqs == engine.scheduler.max_num_seqs == STREAMS  # not 16
    assert runner.num_blocks * engine.config.block_size == STREAMS * 256
    assert engine.info.prefix_caching and isinstance(runner.block_keeper, StreamKeeper)


def test_streams_hold_a_whole_sequence_each_and_none_fitting_is_refused_at_start():
    assert kv_streams(10 * 512 * CELL, 300, CELL, 64) == (s := kv_streams(
        10 * 512 * CELL, 512, CELL, 64))  # max_model_len padded to 256 cells, as llama.cpp
    assert (s.count, s.cells, s.n_ctx) == (10, 512, 5120)
    assert kv_streams(10 * 512 * CELL, 512, CELL, 4).count == 4  # at most --max-num-seqs
    with pytest.raises(ValueError, match="--batch-invariant.*--kv-cache-memory"):
        LLMEngine(config(kv_cache_memory=256 * CELL - 1))


def test_a_lone_row_over_512_cells_on_two_threads_equals_the_same_row_beside_others():
    """Past 256 cells (llama.cpp attends over the cells padded to 256), a ubatch of a single
    row takes llama.cpp's split-KV decode kernel on f16 K and V, whose rounding differs
    from the row's beside other rows from 2 threads on: the mode's bf16 V keeps every row
    on one kernel. Logprobs alone equal those beside a mate in the next stream."""
    eng = LLMEngine(config(max_model_len=512, kv_cache_memory=2 * 512 * CELL, threads=2))
    prompt = prompt_of(eng.tokenizer, 260)
    mate = prompt_of(eng.tokenizer, 16, "Rivers carry sand and stones down to the sea. ")
    p = SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=True)

    def logprobs(arrivals) -> list[float]:
        out: list[float] = []
        for rid, ids_, params_ in arrivals:
            eng.add_request(rid, ids_, params_)
        while eng.has_work:
            for o in eng.step():
                if o.request_id == "x":
                    out += [t.logprob for d in o.deltas for t in d.logprobs]
        return out

    alone = logprobs([("x", prompt, p)])
    assert logprobs([("x", prompt, p), ("m", mate, dataclasses.replace(
        p, max_new_tokens=8))]) == alone


def test_kv_streams_alone_gives_a_stream_per_sequence_with_512_token_ubatches_and_f16_v(
        ids):
    """--kv-streams without --batch-invariant: a stream per sequence (concurrency and
    prefix caching as above), llama.cpp's default 512-token ubatches, and greedy output
    of sequences running together equal to llama.cpp's own generation of each (f16 V),
    with n-gram speculation too."""
    import itertools

    import llama_cpp

    from engine.loading.model_loader import default_model_path
    from engine.runners.llamacpp import UBATCH

    eng = LLMEngine(config(batch_invariant=False, kv_streams=True))
    runner = eng.runner
    lc = runner.llama_cpp  # type: ignore[attr-defined]
    assert lc.llama_n_ctx_seq(runner.ctx) == 256  # type: ignore[attr-defined]
    assert eng.config.max_num_seqs == STREAMS and eng.info.prefix_caching
    assert lc.llama_n_ubatch(runner.ctx) == UBATCH  # type: ignore[attr-defined]
    llm = llama_cpp.Llama(default_model_path(), n_ctx=256, n_threads=THREADS, flash_attn=True,
                          n_ubatch=UBATCH, verbose=False)  # f16 K and V
    want = [list(itertools.islice(llm.generate(p, temp=0.0, reset=True), NEW)) for p in ids]
    llm.close()
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    got = run(eng, {i: [(f"k{i}", p, greedy)] for i, p in enumerate(ids)})
    assert [got[f"k{i}"] for i in range(len(ids))] == want
    # n-gram speculation: verify rows of unequal counts per sequence (more ubatches)
    spec = LLMEngine(config(batch_invariant=False, kv_streams=True),
                     speculator=speculator_for(SpeculativeConfig(method="ngram",
                                                                 num_spec_tokens=4)))
    spec.runner._row_cost = 0.0  # type: ignore[attr-defined]  # propose every step
    got = run(spec, {i: [(f"k{i}", p, greedy)] for i, p in enumerate(ids)})
    assert [got[f"k{i}"] for i in range(len(ids))] == want
    assert spec.stats().spec.accepted > 0
    with pytest.raises(ValueError, match="--kv-streams.*--kv-cache-memory"):
        LLMEngine(config(batch_invariant=False, kv_streams=True,
                         kv_cache_memory=256 * CELL - 1))


def test_sequences_left_above_a_gap_move_down_and_decode_as_they_would_have(ids):
    """--kv-streams: two short requests finish first and leave the lowest ids free; the
    two still running move down into them (llama.cpp batches only consecutive ids: a gap
    costs a ubatch a step), and their greedy output equals each alone. A third arrives
    later, takes the next id, and moves to the lowest once the others finish."""
    eng = LLMEngine(config(batch_invariant=False, kv_streams=True))
    runner = eng.runner
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    short = SamplingParams(max_new_tokens=3, ignore_eos=True)
    alone = {i: run(eng, {0: [("a", ids[i], greedy)]})["a"] for i in (2, 3, 4)}
    seen: dict[str, set[int]] = {}
    real = runner._pack_streams  # type: ignore[attr-defined]

    def watched(decodes, prefills):
        real(decodes, prefills)
        ids_of = {s.seq_id: r.request_id for r in eng.requests.values() for s in r.sequences}
        for seq, slot in runner._slot_of.items():  # type: ignore[attr-defined]
            seen.setdefault(ids_of[seq], set()).add(slot)

    runner._pack_streams = watched  # type: ignore[attr-defined]
    got = run(eng, {0: [("s0", ids[0], short), ("s1", ids[1], short), ("c", ids[2], greedy),
                        ("d", ids[3], greedy)], 12: [("e", ids[4], greedy)]})
    assert got["c"] == alone[2] and got["d"] == alone[3] and got["e"] == alone[4]
    # the highest id takes the lowest free one; e, alone after c and d finish, moves to 0
    assert seen["c"] == {2, 1} and seen["d"] == {3, 0} and seen["e"] == {2, 0}
    assert eng.scheduler.allocator.num_used == 0
