"""Applies each sequence's logits processors, batching the work of batched factories.

A factory may offer two batch-level methods (a grammar filling one token bitmask for all
its rows is the main user):

    prepare_batch(products, prompt_ids, output_ids) -> prepared   # worker thread
    apply_batch(prepared, logits_rows) -> logits_rows            # after the forward

``prepare_batch`` depends only on what the sequences have emitted so far, so it runs in a
worker thread *while the model forward runs*; ``apply_batch`` then touches the logits once
for all of that factory's rows. Order is kept: position ``j`` of every row's processor list
is applied before position ``j + 1``. If a batched call raises, its rows fall back to
calling each product on its own row, so a failure is pinned to the one sequence that
caused it and every other sequence goes on.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.sequence import Sequence

log = logging.getLogger(__name__)


def is_batched(factory: Any) -> bool:
    return (factory is not None and callable(getattr(factory, "prepare_batch", None))
            and callable(getattr(factory, "apply_batch", None)))


@dataclass
class _Group:
    factory: Any
    rows: list[int]
    future: Future | None = None


@dataclass
class PreparedStep:
    seqs: list[Sequence]
    groups: dict[tuple[int, int], _Group] = field(default_factory=dict)  # (position, id)
    depth: int = 0


class _Done(Future):
    """A future already holding its result: prepare run inline (``overlap=False``)."""

    def __init__(self, fn, *args) -> None:
        super().__init__()
        try:
            self.set_result(fn(*args))
        except Exception as e:
            self.set_exception(e)


class ProcessorRunner:
    def __init__(self, overlap: bool = True) -> None:
        self.overlap = overlap  # False runs prepare inline: only the bench's baseline wants it
        self._pool: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="genserve-prepare")
        return self._pool

    def prepare(self, seqs: list[Sequence]) -> PreparedStep:
        """Start every batched factory's prepare in the worker thread; returns at once."""
        step = PreparedStep(seqs)
        for i, seq in enumerate(seqs):
            step.depth = max(step.depth, len(seq.processors))
            for j, (_, factory) in enumerate(seq.processors):
                if is_batched(factory):
                    key = (j, id(factory))
                    step.groups.setdefault(key, _Group(factory, [])).rows.append(i)
        for (j, _), group in step.groups.items():
            rows = [seqs[i] for i in group.rows]
            fn = group.factory.prepare_batch
            args = ([s.processors[j][0] for s in rows], [s.prompt_token_ids for s in rows],
                    [list(s.output_token_ids) for s in rows])
            group.future = (self._executor().submit(fn, *args) if self.overlap
                            else _Done(fn, *args))
        return step

    def apply(self, step: PreparedStep, logits: torch.Tensor) -> dict[int, BaseException]:
        """Apply all processors in order; returns the rows whose processor raised."""
        failed: dict[int, BaseException] = {}
        by_position: dict[int, list[_Group]] = defaultdict(list)
        for (j, _), group in step.groups.items():
            by_position[j].append(group)
        for j in range(step.depth):
            batched_rows: set[int] = set()
            for group in by_position.get(j, []):
                rows = [i for i in group.rows if i not in failed]
                batched_rows.update(group.rows)
                if rows and len(rows) == len(group.rows):
                    try:
                        assert group.future is not None
                        prepared = group.future.result()
                        index = torch.tensor(rows, device=logits.device)
                        logits[index] = group.factory.apply_batch(prepared, logits[index])
                        continue
                    except Exception as e:
                        log.warning("batched processor failed (%s: %s); retrying row by row",
                                    type(e).__name__, e)
                for i in rows:  # per row: pins a failure on the sequence that caused it
                    self._apply_one(step.seqs[i], j, i, logits, failed)
            for i, seq in enumerate(step.seqs):
                if i not in failed and i not in batched_rows and j < len(seq.processors):
                    self._apply_one(seq, j, i, logits, failed)
        return failed

    @staticmethod
    def _apply_one(seq: Sequence, j: int, i: int, logits: torch.Tensor,
                   failed: dict[int, BaseException]) -> None:
        try:
            proc = seq.processors[j][0]
            logits[i] = proc(seq.prompt_token_ids, seq.output_token_ids, logits[i])
        except Exception as e:
            failed[i] = e

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
