"""The compiled decode step on a tiny random model: same logits and greedy tokens as the
eager step for every row count, context lengths far apart, reused (preempted) blocks and
speculation rows; eager fallback for the rest; ``enforce_eager`` compiles nothing.

Compiling is the slow part, so one compiled runner (1..MAX_ROWS rows) serves the file and
every other runner shares its weights: the compiled graphs are reused, not rebuilt.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.runners.base import DecodeRow, PrefillWork
from engine.runners.torch.attention import StaticDecode, forward_context
from engine.runners.torch.compiled_step import DecodeGraphs, cap_buckets
from engine.runners.torch.decode_inputs import (
    build_decode_inputs,
    flat_decode_inputs,
    flat_views,
)
from engine.runners.torch.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from specdecode.config import SpeculativeConfig
from specdecode.worker import speculator_for
from tests.conftest import build_tiny_model
from tests.engine.test_engine import run_to_completion

MAX_ROWS = 8
BLOCK = 4
ATOL = 1e-4


def config(model_dir, **kw) -> EngineConfig:
    kw.setdefault("max_num_seqs", MAX_ROWS)
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("kv_cache_memory", 2 << 20)
    kw.setdefault("pack_weights", False)  # a packed model is never compiled
    kw.setdefault("device", "cpu")  # the CPU path, also on a machine with CUDA
    return EngineConfig(model=str(model_dir), decode_buckets=[1, MAX_ROWS], **kw)


@pytest.fixture(scope="module")
def base(tiny_model_dir) -> LLMEngine:
    """An engine whose runner holds the compiled graphs (1 and 2..MAX_ROWS rows)."""
    engine = LLMEngine(config(tiny_model_dir))
    report = engine.runner.warmup()
    assert report.ready == ["1", f"2-{MAX_ROWS}"], report
    return engine


@pytest.fixture(scope="module")
def compiled(base) -> ModelRunner:
    return base.runner


@pytest.fixture
def pair(compiled) -> tuple[ModelRunner, ModelRunner]:
    """A compiled runner and an eager one, each with its own empty cache, sharing the
    weights (and so the compiled graphs: warming up again finds them in dynamo's cache)."""
    fast = ModelRunner(compiled.config, share_weights=compiled)
    fast.warmup()
    assert fast.decode_graphs is not None
    return fast, ModelRunner(compiled.config, share_weights=compiled)


class Seqs:
    """Sequences with their own blocks, fed the same way to every runner. Each one's last
    token is the pending one: not in the cache yet, the next decode row's input."""

    def __init__(self, runners: tuple[ModelRunner, ...], seed: int = 0) -> None:
        self.runners = runners
        self.gen = torch.Generator().manual_seed(seed)
        self.free = list(range(runners[0].num_blocks))
        self.tokens: list[list[int]] = []
        self.tables: list[list[int]] = []

    def add(self, length: int, blocks: list[int] | None = None,
            ids: list[int] | None = None) -> int:
        if ids is None:
            ids = torch.randint(0, 1000, (length,), generator=self.gen).tolist()
        need = -(-(len(ids) + 24) // BLOCK)
        table = blocks if blocks is not None else [self.free.pop() for _ in range(need)]
        outs = [r.execute([], [PrefillWork(ids, 0, table, True)]) for r in self.runners]
        self.tokens.append(ids + [int(outs[0][-1].argmax())])
        self.tables.append(table)
        return len(self.tokens) - 1

    def rows(self, which: list[int]) -> list[DecodeRow]:
        return [DecodeRow(self.tokens[i][-1], len(self.tokens[i]) - 1, self.tables[i])
                for i in which]

    def step(self, which: list[int]) -> list[torch.Tensor]:
        """One decode step of ``which`` on every runner; appends the first's greedy token."""
        rows = self.rows(which)
        outs = [r.execute(rows, []) for r in self.runners]
        for i, tok in zip(which, outs[0].argmax(-1).tolist(), strict=True):
            self.tokens[i].append(tok)
        return outs


def assert_same(outs: list[torch.Tensor]) -> None:
    first, *rest = outs
    for o in rest:
        assert o.shape == first.shape
        torch.testing.assert_close(o, first, atol=ATOL, rtol=0)
        assert torch.equal(o.argmax(-1), first.argmax(-1))


def count_compiled(monkeypatch, runner: ModelRunner) -> list[int]:
    calls: list[int] = []
    graphs = runner.decode_graphs
    assert graphs is not None
    real = graphs._cpu_step

    def spy(inputs):
        calls.append(inputs.num_rows)
        return real(inputs)

    monkeypatch.setattr(graphs, "_cpu_step", spy)
    return calls


def test_every_row_count_matches_eager_with_contexts_far_apart(pair, monkeypatch):
    fast, eager = pair
    calls = count_compiled(monkeypatch, fast)
    seqs = Seqs(pair)
    lengths = [3, 300, 17, 64, 1, 150, 40, 230]  # 1 to 75 blocks of context
    for n in lengths:
        seqs.add(n)
    for rows in range(1, MAX_ROWS + 1):
        for _ in range(2):  # a second step reads what the first wrote
            assert_same(seqs.step(list(range(rows))))
    assert sorted(set(calls)) == list(range(1, MAX_ROWS + 1))
    assert len(calls) == 2 * MAX_ROWS  # no step fell back to eager


def test_reused_blocks_after_preemption_match_eager(pair, monkeypatch):
    fast, eager = pair
    calls = count_compiled(monkeypatch, fast)
    seqs = Seqs(pair, seed=1)
    a = seqs.add(50)
    b = seqs.add(9)
    for _ in range(3):
        assert_same(seqs.step([a, b]))
    # a is preempted: its blocks go to a new sequence c, and a is recomputed (its tokens
    # so far, prompt and output) into other blocks.
    c = seqs.add(30, blocks=seqs.tables[a])
    a2 = seqs.add(0, ids=seqs.tokens[a][:-1])
    assert seqs.tokens[a2] == seqs.tokens[a]
    for _ in range(3):
        assert_same(seqs.step([c, a2, b]))
    assert len(calls) == 6


def test_speculation_rows_of_one_sequence_in_one_compiled_step(pair, monkeypatch):
    fast, eager = pair
    calls = count_compiled(monkeypatch, fast)
    seqs = Seqs(pair, seed=2)
    s = seqs.add(21)
    other = seqs.add(70)
    # k = 4: k + 1 rows at consecutive positions sharing one table, plus another sequence.
    start = len(seqs.tokens[s]) - 1
    query = [seqs.tokens[s][-1], 5, 6, 7, 8]
    rows = [DecodeRow(t, start + j, seqs.tables[s]) for j, t in enumerate(query)]
    rows += seqs.rows([other])
    assert_same([r.execute(rows, []) for r in pair])
    assert calls == [6]
    # Each expanded row equals decoding the same prefix one token at a time.
    single = ModelRunner(eager.config, share_weights=eager)
    single.execute([], [PrefillWork(seqs.tokens[s][:-1], 0, seqs.tables[s], True)])
    want = torch.cat([single.execute([row], []) for row in rows[:5]])
    torch.testing.assert_close(fast.execute(rows, [])[:5], want, atol=ATOL, rtol=0)


def test_mixed_steps_and_too_many_rows_run_eagerly(pair, monkeypatch):
    fast, eager = pair
    calls = count_compiled(monkeypatch, fast)
    seqs = Seqs(pair, seed=3)
    for n in range(MAX_ROWS + 1):
        seqs.add(5 + n)
    assert_same(seqs.step(list(range(MAX_ROWS + 1))))  # one row more than compiled
    rows = seqs.rows([0, 1])
    work = PrefillWork([1, 2, 3], 0, [seqs.free.pop() for _ in range(2)], True)
    assert_same([r.execute(rows, [work]) for r in pair])  # decodes + a prefill
    assert calls == []


def test_padded_rows_touch_only_the_scratch_block(compiled):
    """The padding the CUDA-graph buckets use, run eagerly on CPU: padded rows change
    nothing but the scratch block, and the in-graph full-width attention of a captured
    step (StaticDecode) gives the eager logits."""
    runner = ModelRunner(compiled.config, share_weights=compiled)
    seqs = Seqs((runner,), seed=4)
    for n in (12, 45, 7):
        seqs.add(n)
    rows = seqs.rows([0, 1, 2])
    model, bs = runner.model, runner.block_size

    def forward(inputs, meta):
        with torch.inference_mode():
            return model(input_ids=inputs.input_ids, position_ids=inputs.positions,
                         use_cache=False, genserve_meta=meta).logits[0]

    plain = build_decode_inputs(rows, bs, runner.scratch_block, runner.device)
    want = forward(plain, plain.metadata(runner.kv_cache, bs))
    before = [t.clone() for t in runner.kv_cache.key + runner.kv_cache.value]
    padded = build_decode_inputs(rows, bs, runner.scratch_block, runner.device, pad_to=8)
    got = forward(padded, padded.metadata(runner.kv_cache, bs))
    torch.testing.assert_close(got[:3], want, atol=ATOL, rtol=0)
    assert torch.isfinite(got).all()
    wide = build_decode_inputs(rows, bs, runner.scratch_block, runner.device, pad_to=8,
                               width=-(-runner.max_model_len // bs))
    meta = StaticDecode(runner.kv_cache, wide.slot_mapping, wide.block_tables, wide.seq_lens)
    torch.testing.assert_close(forward(wide, meta)[:3], want, atol=ATOL, rtol=0)
    # The real rows rewrote their own slots (same values up to float rounding: a batch of
    # 8 rows multiplies in a different order); nothing else outside the scratch block moved.
    written = plain.slot_mapping
    for old, new in zip(before, runner.kv_cache.key + runner.kv_cache.value, strict=True):
        old, new = old.flatten(0, 1), new.flatten(0, 1)  # [slots, kv_heads, head_dim]
        torch.testing.assert_close(new[written], old[written], atol=ATOL, rtol=0)
        new[written] = old[written]
        real = runner.scratch_block * bs
        assert torch.equal(old[:real], new[:real])


def test_one_flat_buffer_holds_the_padded_step_inputs(compiled):
    """A CUDA graph step copies its inputs in as one flat tensor: viewed back, it holds
    exactly the padded inputs ``build_decode_inputs`` makes."""
    runner = ModelRunner(compiled.config, share_weights=compiled)
    seqs = Seqs((runner,), seed=3)
    for n in (5, 30, 17):
        seqs.add(n)
    rows, bs = seqs.rows([0, 1, 2]), runner.block_size
    want = build_decode_inputs(rows, bs, runner.scratch_block, runner.device, pad_to=8,
                               width=12)
    got = flat_views(flat_decode_inputs(rows, bs, runner.scratch_block, 8, 12), 8, 12)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_the_compiled_forward_over_static_buffers_gives_the_eager_logits(compiled):
    """What a CUDA graph captures by default (compile_cuda_graphs), run on CPU: the
    compiled forward with its opaque attention reading the static buffers' full-width
    table (StaticDecode), padded rows included, gives the eager step's logits."""
    runner = ModelRunner(compiled.config, share_weights=compiled)
    graphs = compiled.decode_graphs
    assert graphs is not None and graphs._compiled is not None
    seqs = Seqs((runner,), seed=5)
    for n in (9, 38):
        seqs.add(n)
    rows = seqs.rows([0, 1])
    bs = runner.block_size
    plain = build_decode_inputs(rows, bs, runner.scratch_block, runner.device)
    with torch.inference_mode():
        want = runner.model(input_ids=plain.input_ids, position_ids=plain.positions,
                            use_cache=False,
                            genserve_meta=plain.metadata(runner.kv_cache, bs)).logits[0]
        width = -(-runner.max_model_len // bs)  # the static buffers as a graph holds them
        wide = flat_views(flat_decode_inputs(rows, bs, runner.scratch_block, MAX_ROWS, width),
                          MAX_ROWS, width)
        meta = StaticDecode(runner.kv_cache, wide.slot_mapping, wide.block_tables,
                            wide.seq_lens)
        with forward_context(meta, graphs.num_layers), \
                torch.compiler.set_stance("fail_on_recompile"):
            got = graphs._compiled(wide.input_ids, wide.positions)[0]
    torch.testing.assert_close(got[:2], want, atol=ATOL, rtol=0)
    assert torch.isfinite(got).all()


def test_enforce_eager_never_compiles(tiny_model_dir, compiled, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("torch.compile called with enforce_eager")

    monkeypatch.setattr(torch, "compile", refuse)
    cfg = config(tiny_model_dir, enforce_eager=True)
    runner = ModelRunner(cfg, share_weights=compiled)
    report = runner.warmup()
    assert report.graphs == [] and runner.decode_graphs is None
    seqs = Seqs((runner,), seed=5)
    seqs.add(4)
    seqs.step([0])


def test_a_spent_budget_leaves_everything_eager(compiled):
    runner = ModelRunner(compiled.config, share_weights=compiled)
    report = runner.warmup(budget_s=0)
    assert [g.status for g in report.graphs] == ["skipped (budget)"] * 2
    assert runner.decode_graphs is None


def test_cap_buckets_keeps_one_bucket_above_the_limit():
    assert cap_buckets([1, 2, 4, 8, 16], 8) == [1, 2, 4, 8]
    assert cap_buckets([1, 2, 4, 8, 16], 5) == [1, 2, 4, 8]
    assert cap_buckets([16, 4, 4], 2) == [4]
    assert cap_buckets([1, 2], 64) == [1, 2]


def test_engine_greedy_output_is_unchanged_with_preemption_and_speculation(
        tiny_model_dir, base, tokenizer, monkeypatch):
    """The engine end to end with the compiled step: a small KV cache forces preemption,
    n-gram speculation sends k + 1 rows per sequence."""
    prompts = ["1, 2, 3, 4, 5, 6, 7, 8,", "Hello, my name is", "A B C A B C A B",
               "The quick brown fox jumps over the lazy dog. The quick brown"]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    greedy = SamplingParams(max_new_tokens=24, min_new_tokens=24)
    arrivals = {0: [(f"r{i}", p, greedy) for i, p in enumerate(ids)]}
    spec = SpeculativeConfig(method="ngram", num_spec_tokens=3, ngram_min=1, ngram_max=3,
                             disable_batch_size=64)
    kv = base.runner.kv_cache.spec.bytes_per_block * 24  # ~2 sequences at a time
    compiled_rows: list[int] = []
    real_step = DecodeGraphs._cpu_step

    def spy(self, inputs):
        compiled_rows.append(inputs.num_rows)
        return real_step(self, inputs)

    monkeypatch.setattr(DecodeGraphs, "_cpu_step", spy)
    outs = {}
    for compile_ in (False, True):
        for speculate in (False, True):
            engine = LLMEngine(config(tiny_model_dir, kv_cache_memory=kv), share_weights=base,
                               speculator=speculator_for(spec) if speculate else None)
            if compile_:
                engine.runner.warmup()
                assert engine.runner.decode_graphs is not None
            res = run_to_completion(engine, arrivals)
            assert engine.scheduler.num_preemptions > 0
            outs[compile_, speculate] = {r: c[0].token_ids for r, c in res.items()}
    assert len(set(compiled_rows)) > 3  # compiled steps of many sizes ran
    assert outs[True, False] == outs[False, False]
    assert outs[True, True] == outs[False, False]
    assert outs[False, True] == outs[False, False]


def test_two_models_of_one_architecture_each_run_their_own_weights(
        tmp_path, tokenizer_dir, compiled):
    """A draft model shaped like the target: both compiled in one process, each step runs
    the weights of its own runner (dynamo tells their graphs apart by the model)."""
    other_dir = build_tiny_model(tmp_path / "other", tokenizer_dir, seed=1)
    other = ModelRunner(config(other_dir))
    other.warmup()
    for runner in (compiled, other):
        eager = ModelRunner(runner.config, share_weights=runner)
        fast = ModelRunner(runner.config, share_weights=runner)
        fast.warmup()
        seqs = Seqs((fast, eager), seed=6)
        for n in (5, 33, 12):
            seqs.add(n)
        for rows in ([0], [0, 1, 2]):
            assert_same(seqs.step(rows))


def test_packed_linears_compile_and_match_the_eager_packed_step(tiny_model_dir,
                                                                monkeypatch):
    """Packed linears inside the compiled graph (the native kernel's ops with the panels as
    graph inputs, or oneDNN's behind the opaque keyed op), for packed models the native
    step (native_decode.py, turned off here) does not take."""
    monkeypatch.setenv("GENSERVE_NATIVE_DECODE", "0")
    cfg = config(tiny_model_dir, pack_weights=True)
    fast = ModelRunner(cfg)
    assert fast.warmup().ready == ["1", f"2-{MAX_ROWS}"]
    slow = ModelRunner(cfg, share_weights=fast)  # the same packed layers, eager
    seqs = Seqs((fast, slow), seed=3)
    for n in (5, 17, 33):
        seqs.add(n)
    for which in ([0], [0, 1, 2], [1, 2], [2]):
        assert_same(seqs.step(which))


def test_a_graph_for_fewer_rows_is_not_taken_for_a_wider_range(
        tmp_path, tokenizer_dir, monkeypatch):
    """A runner compiled for 2..4 rows, then one for 2..8 in the same process (a smaller
    ``max_num_seqs`` before; inductor's on-disk cache behaves alike across processes):
    the second gets a graph of its own covering 8 rows, exact, not the first's (which
    failed the check at 8 rows, or broke the 2..8 constraint: issue 29)."""
    model_dir = build_tiny_model(tmp_path / "m", tokenizer_dir, num_layers=1, hidden=32,
                                 seed=2)  # a shape no other test compiles
    narrow = ModelRunner(config(model_dir))
    assert narrow.warmup(buckets=[4]).ready == ["2-4"]
    wide = ModelRunner(config(model_dir), share_weights=narrow)
    assert wide.warmup(buckets=[MAX_ROWS]).ready == [f"2-{MAX_ROWS}"]
    calls = count_compiled(monkeypatch, wide)
    seqs = Seqs((wide, ModelRunner(config(model_dir), share_weights=narrow)), seed=7)
    for n in range(1, MAX_ROWS + 1):
        seqs.add(3 * n)
    assert_same(seqs.step(list(range(MAX_ROWS))))
    assert calls == [MAX_ROWS]
