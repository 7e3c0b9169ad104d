"""Sampling metadata for chosen logits rows of a step, each row over its own prefix (its
sequence's output plus the proposals before it), with min-new-tokens bans."""

from __future__ import annotations

from collections.abc import Collection

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
        [min_tokens_bans(v, sub[i], eos) for i, v in enumerate(vs)], logits.device)
    return meta, sub


def greedy_rows(rows: list[int], views: list[RowView], logits: torch.Tensor,
                eos: Collection[int]) -> list[int]:
    """Each row's argmax over its non-banned ids: the sampler's pick (``greedy_with_bans``)
    for rows that are all greedy with no penalties, without building its metadata (~0.2 ms
    a step, a few % of a batch-1 llama.cpp step)."""
    sub = rows_of(logits, rows)
    bans = [min_tokens_bans(views[r], sub[i], eos) for i, r in enumerate(rows)]
    return greedy_with_bans(sub.float(), bans).tolist()


def rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The logits of ``rows``; every row in order (a step of plain decodes): the logits as
    they are, no gathered copy."""
    return (logits if rows == list(range(len(logits)))
            else logits[torch.tensor(rows, device=logits.device)])


def min_tokens_bans(view: RowView, logits: torch.Tensor, eos: Collection[int]) -> list[int]:
    """EOS / stop ids banned while min_new_tokens is unmet, but never every token a
    processor left open (a grammar that can only end): its end wins over the minimum."""
    seq, params = view.seq, view.seq.request.params
    if len(view.output_token_ids) >= seq.output.min_new_tokens:
        return []
    banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos))
    if banned and seq.processors:
        finite = torch.isfinite(logits)
        if int(finite.sum()) <= int(finite[banned].sum()):
            seq.output.min_new_tokens = 0
            return []
    return banned


