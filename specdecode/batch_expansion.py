"""Batch expansion: a sequence with m proposals becomes m + 1 single-token target queries.

Query j feeds token ``t_j`` (the last real token for j = 0, proposal j for j > 0) at
position ``L - 1 + j`` over the sequence's own block table, so every query writes its KV at
its own slot; the paged attention writes the whole step's KV before attending, so query j
sees the proposals before it. The forward returns one logits row per query (decode rows
come first), contracted here to ``[batch, k + 1, vocab]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.model_runner import DecodeRow, PrefillWork
from engine.sequence import Sequence


@dataclass
class RowView:
    """One expanded query as processors see it: the sequence with ``j`` proposals
    appended to its output (duck-types the ``Sequence`` fields processors read)."""

    seq: Sequence
    output_token_ids: list[int]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.prompt_token_ids

    @property
    def processors(self) -> list[tuple[Any, Any | None]]:
        return self.seq.processors


def _query_tokens(seq: Sequence, proposals: list[int]) -> tuple[int, list[int]]:
    """The position of the sequence's last real token, and the k + 1 tokens to score."""
    last = seq.num_tokens - 1
    return last, [seq.token_at(last), *proposals]


def row_views(seq: Sequence, proposals: list[int]) -> list[RowView]:
    """What the processors of each of the ``len(proposals) + 1`` rows see (either scorer)."""
    return [RowView(seq, seq.output_token_ids + proposals[:j])
            for j in range(len(proposals) + 1)]


def expand(seq: Sequence, proposals: list[int]) -> list[DecodeRow]:
    """The ``len(proposals) + 1`` decode rows of one sequence."""
    last, tokens = _query_tokens(seq, proposals)
    return [DecodeRow(t, last + j, seq.block_table) for j, t in enumerate(tokens)]


def multi_token(seq: Sequence, proposals: list[int]) -> PrefillWork:
    """The other scorer: one causal query of the same ``len(proposals) + 1`` tokens at the
    same positions, returning a logits row per token, in the same order as ``expand``."""
    last, tokens = _query_tokens(seq, proposals)
    return PrefillWork(tokens, last, seq.block_table, True, num_logits=len(tokens))


def contract(rows: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """``[sum(m + 1), ...]`` rows grouped per sequence -> ``[batch, k + 1, ...]``, padding a
    sequence with fewer than k proposals by repeating its last row (never read)."""
    k = max(lengths)
    sizes = torch.tensor(lengths) + 1
    starts = sizes.cumsum(0) - sizes
    offsets = torch.minimum(torch.arange(k + 1)[None, :], torch.tensor(lengths)[:, None])
    index = (starts[:, None] + offsets).to(rows.device)
    return rows[index]
