"""Decode rows as padded tensors: two ``torch.tensor`` calls per step, no per-row tensors.

Shared by the eager runner (no padding) and the compiled decode step (padded up to a
bucket). Padded rows are token 0 at position 0 writing into the runner's *scratch block*
(a KV block past the scheduler's ``[0, num_blocks)``), attending to that one slot only, so
they never touch a real sequence's cache and never make an all-masked (NaN) row.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.runners.torch.attention import AttentionMetadata, DecodeGroups
from engine.runners.torch.kv_tensors import KVCache


class DecodeRowLike(Protocol):
    token_id: int
    position: int
    block_table: list[int]
    adapter_slot: int


@dataclass
class DecodeInputs:
    num_rows: int  # real rows; the rest up to ``input_ids.shape[1]`` is padding
    input_ids: torch.Tensor  # [1, B] long
    positions: torch.Tensor  # [1, B] long
    slot_mapping: torch.Tensor  # [B] long
    seq_lens: torch.Tensor  # [B] long: tokens each row attends to (position + 1)
    block_tables: torch.Tensor  # [B, W] long, columns past a row's blocks = scratch
    groups: DecodeGroups | None = None  # when some rows share a table (speculation)

    def mask(self, block_size: int) -> torch.Tensor:
        """``[B, 1, 1, W * block_size]`` bool: which gathered slots each row attends to."""
        width = self.block_tables.shape[1] * block_size
        ar = torch.arange(width, device=self.seq_lens.device)
        return (ar[None, :] < self.seq_lens[:, None])[:, None, None, :]

    def metadata(self, kv_cache: KVCache, block_size: int) -> AttentionMetadata:
        """The eager attention's view of this step (every row a decode row)."""
        return AttentionMetadata(
            kv_cache=kv_cache, slot_mapping=self.slot_mapping,
            num_decode=self.input_ids.shape[1], decode_block_tables=self.block_tables,
            decode_mask=self.mask(block_size), decode_groups=self.groups,
            decode_seq_lens=self.seq_lens,
        )


def decode_width(decodes: Sequence[DecodeRowLike], block_size: int) -> int:
    """Table columns that cover the longest row's context."""
    return max(r.position // block_size for r in decodes) + 1


def _padded_rows(decodes: Sequence[DecodeRowLike], block_size: int, scratch_block: int,
                 rows: int, width: int) -> tuple[list[list[int]], list[list[int]]]:
    """``[tokens, positions, slots, lens]`` and the block tables, padded to ``rows``."""
    pad = rows - len(decodes)
    tokens = [r.token_id for r in decodes] + [0] * pad
    positions = [r.position for r in decodes] + [0] * pad
    slots = [r.block_table[r.position // block_size] * block_size + r.position % block_size
             for r in decodes] + [scratch_block * block_size] * pad
    lens = [r.position + 1 for r in decodes] + [1] * pad
    tables: list[list[int]] = []
    for r in decodes:
        t = r.block_table[:width]
        tables.append(t + [scratch_block] * (width - len(t)) if len(t) < width else t)
    tables.extend([[scratch_block] * width] * pad)
    return [tokens, positions, slots, lens], tables


def build_decode_inputs(decodes: Sequence[DecodeRowLike], block_size: int, scratch_block: int,
                        device: torch.device, *, pad_to: int | None = None,
                        width: int | None = None) -> DecodeInputs:
    """``pad_to`` rows (default: no padding) with ``width`` table columns (default: just
    enough for the longest row)."""
    n = len(decodes)
    rows = pad_to or n
    if width is None:
        width = decode_width(decodes, block_size)
    vector_rows, tables = _padded_rows(decodes, block_size, scratch_block, rows, width)
    vectors = torch.tensor(vector_rows, dtype=torch.long)
    table_t = torch.tensor(tables, dtype=torch.long)
    groups = None
    if rows == n:
        groups = _groups(decodes, tables, vector_rows[3], width * block_size)
    if device.type != "cpu":
        vectors = vectors.to(device, non_blocking=True)
        table_t = table_t.to(device, non_blocking=True)
        if groups is not None:
            groups = DecodeGroups(*(t.to(device, non_blocking=True) for t in (
                groups.tables, groups.rows, groups.mask, groups.row_slot)))
    return DecodeInputs(n, vectors[0:1], vectors[1:2], vectors[2], vectors[3], table_t, groups)


def flat_decode_inputs(decodes: Sequence[DecodeRowLike], block_size: int, scratch_block: int,
                       rows: int, width: int) -> torch.Tensor:
    """The step's inputs as one host tensor laid out as ``flat_views`` reads them: a CUDA
    graph step takes them in one copy instead of seven (each a launch, and the host's time
    between two graph replays is time the GPU waits)."""
    vector_rows, tables = _padded_rows(decodes, block_size, scratch_block, rows, width)
    return torch.tensor(list(itertools.chain(*vector_rows, *tables)), dtype=torch.long)


def flat_views(flat: torch.Tensor, rows: int, width: int) -> DecodeInputs:
    """``DecodeInputs`` over one flat buffer of ``flat_decode_inputs``' layout."""
    v = flat[:4 * rows].view(4, rows)
    return DecodeInputs(rows, v[0:1], v[1:2], v[2], v[3], flat[4 * rows:].view(rows, width))


def _groups(decodes: Sequence[DecodeRowLike], tables: list[list[int]], lens: list[int],
            width: int) -> DecodeGroups | None:
    """Runs of consecutive rows holding the same block-table list; None when every run
    is a single row (plain decoding: the per-row path is as good)."""
    runs: list[list[int]] = []
    for i, r in enumerate(decodes):
        if runs and r.block_table is decodes[runs[-1][0]].block_table:
            runs[-1].append(i)
        else:
            runs.append([i])
    if len(runs) == len(decodes):
        return None
    size = max(len(run) for run in runs)
    rows = torch.tensor([run + [run[0]] * (size - len(run)) for run in runs], dtype=torch.long)
    seq_lens = torch.tensor([[lens[i] for i in run] + [1] * (size - len(run)) for run in runs],
                            dtype=torch.long)
    mask = torch.arange(width)[None, None, :] < seq_lens[:, :, None]
    slot = [0] * len(decodes)
    for g, run in enumerate(runs):
        for j, i in enumerate(run):
            slot[i] = g * size + j
    return DecodeGroups(torch.tensor([tables[run[0]] for run in runs], dtype=torch.long), rows,
                        mask[:, None], torch.tensor(slot, dtype=torch.long))
