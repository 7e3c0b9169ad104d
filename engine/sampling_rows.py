"""Sampling metadata for chosen logits rows of a step, each row over its own prefix (its
sequence's output plus the proposals before it), with min-new-tokens bans."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch

from engine.sampler import SamplingMetadata, greedy_with_bans
from engine.step_layout import RowView


def sampling_rows(rows: list[int], views: list[RowView], logits: torch.Tensor,
                  eos: Collection[int]) -> tuple[SamplingMetadata, torch.Tensor]:
    """Sampling metadata of ``rows`` (each over its own prefix, so its own output position)
    and their logits."""
    sub = rows_of(logits, rows)
    vs = [views[r] for r in rows]
    meta = SamplingMetadata.build(
        [v.seq.request.params for v in vs], [v.prompt_token_ids for v in vs],
        [v.output_token_ids for v in vs],
        [v.seq.sampling_key for v in vs],
        [min_tokens_bans(v, logits, r, eos) for r, v in zip(rows, vs, strict=True)],
        logits.device)
    return meta, sub


def greedy_rows(rows: list[int], views: list[RowView], logits: torch.Tensor,
                eos: Collection[int]) -> list[int]:
    """Each row's argmax over its non-banned ids: the sampler's pick (``greedy_with_bans``)
    for rows that are all greedy with no penalties, without building its metadata (~0.2 ms
    a step, a few % of a batch-1 llama.cpp step). CPU float32 logits (the llama.cpp
    runner's) are read through numpy alone: right after a decode has streamed the weights
    through the caches, each torch call here ran cold, ~0.15 ms of a batch-1 step."""
    bans = [min_tokens_bans(views[r], logits, r, eos) for r in rows]
    every = _cpu_float32_numpy(logits)
    if every is None:
        return greedy_with_bans(rows_of(logits, rows).float(), bans).tolist()
    sub = every if rows == list(range(len(every))) else every[rows]
    picked: list[int] = np.argmax(sub, axis=-1).tolist()  # first maximum; NaN wins, as torch
    for i, ids in enumerate(bans):
        if ids and picked[i] in ids:  # rare: EOS first before min_new_tokens
            row = sub[i].copy()
            row[ids] = -np.inf
            picked[i] = int(np.argmax(row))
    return picked


_last_numpy: tuple[torch.Tensor, np.ndarray | None] | None = None


def _cpu_float32_numpy(logits: torch.Tensor) -> np.ndarray | None:
    """``logits`` as numpy when they are CPU float32, else None. The last answer is kept:
    the llama.cpp runner hands back the same tensor (a view of llama.cpp's buffer) step
    after step, and even reading its device and dtype ran cold (~0.1 ms a step)."""
    global _last_numpy
    last = _last_numpy  # one read: engines on other threads may replace it meanwhile
    if last is None or last[0] is not logits:
        cpu32 = logits.device.type == "cpu" and logits.dtype == torch.float32
        last = _last_numpy = (logits, logits.numpy() if cpu32 else None)
    return last[1]


def rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The logits of ``rows``; every row in order (a step of plain decodes): the logits as
    they are, no gathered copy."""
    return (logits if rows == list(range(len(logits)))
            else logits[torch.tensor(rows, device=logits.device)])


def min_tokens_bans(view: RowView, logits: torch.Tensor, row: int,
                    eos: Collection[int]) -> list[int]:
    """EOS / stop ids banned while min_new_tokens is unmet, but never every token a
    processor left open in ``logits[row]`` (a grammar that can only end): its end wins
    over the minimum."""
    seq, params = view.seq, view.seq.request.params
    if len(view.output_token_ids) >= seq.output.min_new_tokens:
        return []
    banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos))
    if banned and seq.processors:
        finite = torch.isfinite(logits[row])
        if int(finite.sum()) <= int(finite[banned].sum()):
            seq.output.min_new_tokens = 0
            return []
    return banned


