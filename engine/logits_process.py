"""The logits-processor contract between the engine and whatever shapes the logits.

A *processor* is a callable ``(prompt_ids, output_ids, logits) -> logits`` over one
sequence's logits row (1-D, vocab-sized). A processor placed directly in
``SamplingParams.logits_processors`` is shared by every sequence using those params, so it
must be stateless.

A *factory* has ``create()`` and ``release(processor)``. The engine calls ``create()`` once
per sequence when that sequence is created (each of the ``n`` samples, each batch item),
so stateful processors (a grammar FSM) are never shared; when the sequence ends for any
reason the product is handed back with ``release()`` exactly once, so the factory can pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeGuard, runtime_checkable

import torch


@runtime_checkable
class LogitsProcessor(Protocol):
    def __call__(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], logits: torch.Tensor
    ) -> torch.Tensor: ...


@runtime_checkable
class LogitsProcessorFactory(Protocol):
    def create(self) -> LogitsProcessor: ...

    def release(self, processor: LogitsProcessor) -> None: ...


def is_factory(obj: object) -> TypeGuard[LogitsProcessorFactory]:
    return isinstance(obj, LogitsProcessorFactory)
