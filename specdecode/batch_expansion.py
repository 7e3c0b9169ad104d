"""The two scorers: runner work that scores a sequence's last token and its proposals.

Batch expansion: a sequence with m proposals becomes m + 1 single-token target queries.
Query j feeds token ``t_j`` (the last real token for j = 0, proposal j for j > 0) at
position ``L - 1 + j`` over the sequence's own block table, so every query writes its KV at
its own slot; the paged attention writes the whole step's KV before attending, so query j
sees the proposals before it. The multi-token scorer sends the same tokens as one causal
query. Either way the ``m + 1`` logits rows come back in order and are contracted here to
``[batch, k + 1, vocab]`` for verification.
"""

from __future__ import annotations

import torch

from engine.runners.base import DecodeRow, PrefillWork
from engine.sequence import Sequence


def _query_tokens(seq: Sequence, proposals: list[int]) -> tuple[int, list[int]]:
    """The position of the sequence's last real token, and the k + 1 tokens to score."""
    last = seq.num_tokens - 1
    return last, [seq.token_at(last), *proposals]


def expand(seq: Sequence, proposals: list[int]) -> list[DecodeRow]:
    """The ``len(proposals) + 1`` decode rows of one sequence."""
    last, tokens = _query_tokens(seq, proposals)
    return [DecodeRow(t, last + j, seq.block_table, seq.seq_id) for j, t in enumerate(tokens)]


def multi_token(seq: Sequence, proposals: list[int]) -> PrefillWork:
    """One causal query of the same ``len(proposals) + 1`` tokens at the same positions,
    returning a logits row per token, in the same order as ``expand``."""
    last, tokens = _query_tokens(seq, proposals)
    return PrefillWork(tokens, last, seq.block_table, True, num_logits=len(tokens),
                       seq_id=seq.seq_id)


def contract(rows: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """``[sum(m + 1), ...]`` rows grouped per sequence -> ``[batch, k + 1, ...]``, padding a
    sequence with fewer than k proposals by repeating its last row (never read)."""
    k = max(lengths)
    sizes = torch.tensor(lengths) + 1
    starts = sizes.cumsum(0) - sizes
    offsets = torch.minimum(torch.arange(k + 1)[None, :], torch.tensor(lengths)[:, None])
    index = (starts[:, None] + offsets).to(rows.device)
    return rows[index]
