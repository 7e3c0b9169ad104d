"""The seam between the engine and speculative decoding, defined on the engine's side.

The engine receives a ``Speculator`` at construction (``specdecode`` builds one) and talks
to it four times a step at most: how many tokens to propose for each decoding sequence
(the speculator's auto-off policy lives there), the proposals themselves (KV blocks for
them already reserved by the scheduler), the runner work that scores them (batch
expansion or one multi-token query), and the verification of the scored rows. The
engine imports nothing from ``specdecode``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from engine.outputs import SpecStats
from engine.runners.base import DecodeRow, PrefillWork, Runner
from engine.sampler import SamplingMetadata
from engine.sequence import Sequence


class Speculator(Protocol):
    method: str
    k: int
    stats: SpecStats

    def budgets(self, seqs: list[Sequence], num_running: int) -> list[int]:
        """Tokens worth proposing for each decoding sequence this step (0 = plain)."""
        ...

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[list[int]]:
        """At most ``budgets[i]`` proposed tokens for ``seqs[i]``; the sequence's block
        table already covers them."""
        ...

    def score_work(self, seq: Sequence, proposals: list[int]
                   ) -> tuple[list[DecodeRow], list[PrefillWork]]:
        """Runner work scoring ``seq``'s last token and ``proposals``: their
        ``len(proposals) + 1`` logits rows come back in order."""
        ...

    def verify(self, seqs: list[Sequence], proposals: list[list[int]], logits: torch.Tensor,
               meta: SamplingMetadata) -> list[list[int]]:
        """The tokens each sequence emits: its accepted proposals and one more.
        ``logits``: the processed rows, ``len(p) + 1`` per sequence in order; ``meta``:
        each row's sampling parameters over its own prefix."""
        ...

    def release(self, seq: Sequence) -> None:
        """``seq`` has ended: drop whatever the speculator keeps for it."""
        ...


SpeculatorFactory = Callable[[Runner], Speculator]
