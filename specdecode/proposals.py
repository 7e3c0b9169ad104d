"""What a proposer hands the scorer: up to k guessed tokens per sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposals:
    """``token_ids[i]`` holds 0..k tokens for sequence ``i`` (0 = a plain decode).

    ``probs`` is the draft distribution q each token was drawn from, ``[batch, k, vocab]``
    on the model's device, or None when the proposer is deterministic (n-gram lookup):
    the rejection sampler then treats q as one-hot on the proposed token.
    """

    token_ids: list[list[int]]
    probs: torch.Tensor | None = None

    def truncate(self, i: int, n: int) -> None:
        del self.token_ids[i][n:]

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)
