"""A sequence's speculative rows share its block table and attend as one group (context
gathered once): same logits as attending row by row."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.runners.base import DecodeRow, PrefillWork
from engine.runners.torch.decode_inputs import build_decode_inputs
from engine.runners.torch.model_runner import ModelRunner


def test_rows_sharing_a_table_are_grouped_and_score_like_single_rows(tiny_model_dir):
    runner = ModelRunner(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                      kv_cache_memory=1 << 20))
    a_table, b_table = [0, 1, 2, 3, 4], [5, 6, 7, 8]
    a_ids, b_ids = list(range(3, 14)), list(range(20, 27))
    runner.execute([], [PrefillWork(a_ids, 0, a_table, False),
                        PrefillWork(b_ids, 0, b_table, False)])
    # a: 1 + 3 expansion rows (positions 11..14) sharing a's table; b: one plain row.
    rows = [DecodeRow(t, 11 + j, a_table) for j, t in enumerate([30, 31, 32, 33])]
    rows.append(DecodeRow(50, 7, b_table))
    grouped = build_decode_inputs(rows, 4, runner.scratch_block, runner.device).groups
    assert grouped is not None and grouped.rows.shape == (2, 4)
    together = runner.execute(rows, [])
    # The same rows, each with its own copy of the table: no grouping, row by row.
    apart_rows = [DecodeRow(r.token_id, r.position, list(r.block_table)) for r in rows]
    assert build_decode_inputs(apart_rows, 4, runner.scratch_block, runner.device).groups is None
    apart = runner.execute(apart_rows, [])
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-5)
    assert torch.equal(together.argmax(-1), apart.argmax(-1))
