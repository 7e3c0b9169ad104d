"""The logits-processor contract between the engine and whatever shapes the logits.

A *processor* is a callable ``(prompt_ids, output_ids, logits) -> logits`` over one
sequence's logits row (1-D, vocab-sized). A processor placed directly in
``SamplingParams.logits_processors`` is shared by every sequence using those params, so it
must be stateless.

A *factory* has ``create()`` and ``release(processor)``. The engine calls ``create()`` once
per sequence when that sequence is created (each of the ``n`` samples, each batch item),
so stateful processors (a grammar FSM) are never shared; when the sequence ends for any
reason the product is handed back with ``release()`` exactly once, so the factory can pool.

Two optional capabilities, found once per sequence (``bind``), never on the hot path:

- a *batched* factory also has ``prepare_batch`` / ``apply_batch``: it prepares the work of
  all its rows at once (a grammar fills one token bitmask, possibly while the forward
  runs) and applies it to their logits in one call;
- a product that is a *proposal validator* tells how many speculative proposals its state
  allows (a grammar stepping through them), so the engine never scores an impossible one;
- a *checked* factory's ``check_output`` judges each of its sequences' finished text (a
  grammar that enforces a JSON schema only in part): the engine runs it on an output that
  ends at EOS and, if it names a problem, finishes the sequence with ERROR and that
  message, its text kept and marked ``rejected`` (the request itself did not fail). So any
  caller of the engine gets the check, not only the gRPC service.

A processor that raises ends only its own sequence with ERROR. ``RequestSpecError`` says
the request is at fault (what it asked for cannot be enforced, e.g. a grammar backend met
one of its limits mid-output): callers answer it as bad input, never as a server failure.
So does a row the processors leave with no token allowed (a grammar whose only
continuations another processor bans): its sequence ends there with ERROR, the tokens
before it kept; a processor that writes NaN or +inf into its row fails its sequence as if
it had raised. Neither reaches the sampler, so no batch mate is touched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard, runtime_checkable

import torch


class RequestSpecError(ValueError):
    """A processor cannot go on with what the request asked for: a grammar backend reached
    one of its own limits, or its error state, after the build's checks passed. The
    request's spec is at fault, not the server: callers answer INVALID_ARGUMENT (a stream
    that already sent tokens ends with an ERROR finish carrying the message). ``field``
    names the part of the request at fault relative to its structured-output options
    ("grammar", "json_schema", ...), so each API can name it its own way; "" the request
    as a whole (the message says why)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@runtime_checkable
class LogitsProcessor(Protocol):
    def __call__(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], logits: torch.Tensor
    ) -> torch.Tensor: ...


@runtime_checkable
class LogitsProcessorFactory(Protocol):
    def create(self) -> LogitsProcessor: ...

    def release(self, processor: LogitsProcessor) -> None: ...


@runtime_checkable
class BatchedProcessorFactory(LogitsProcessorFactory, Protocol):
    def prepare_batch(self, products: list[Any], prompt_ids: list[list[int]],
                      output_ids: list[list[int]]) -> Any:
        """Work for every row of this factory; depends only on emitted tokens, so it may
        run in a worker thread while the forward runs."""
        ...

    def apply_batch(self, prepared: Any, logits: torch.Tensor) -> torch.Tensor:
        """The prepared work applied to those rows' logits ``[rows, vocab]``."""
        ...


OutputCheck = Callable[[str], str | None]  # finished text -> None, or why it is not valid


@runtime_checkable
class CheckedFactory(LogitsProcessorFactory, Protocol):
    check_output: OutputCheck | None  # None: nothing to check


@runtime_checkable
class ProposalValidator(Protocol):
    def validate_proposals(self, output_ids: Sequence[int], proposals: Sequence[int]) -> int:
        """How many leading ``proposals`` may follow ``output_ids``."""
        ...


@dataclass
class BoundProcessor:
    """One entry of a sequence's processor list, classified once when it is created."""

    processor: LogitsProcessor
    factory: LogitsProcessorFactory | None = None  # made ``processor`` for this sequence
    batched: BatchedProcessorFactory | None = None  # ``factory`` when it batches
    validator: ProposalValidator | None = None  # ``processor`` when it validates proposals
    check: OutputCheck | None = None  # ``factory``'s check of the finished output


def bind(entry: LogitsProcessor | LogitsProcessorFactory) -> BoundProcessor:
    """A shared processor as is; a factory's fresh product for one sequence."""
    if not isinstance(entry, LogitsProcessorFactory):
        return BoundProcessor(entry, validator=_validator(entry))
    product = entry.create()
    batched = entry if isinstance(entry, BatchedProcessorFactory) else None
    check = entry.check_output if isinstance(entry, CheckedFactory) else None
    return BoundProcessor(product, entry, batched, _validator(product), check)


def _validator(obj: object) -> ProposalValidator | None:
    return obj if isinstance(obj, ProposalValidator) else None


def is_factory(obj: object) -> TypeGuard[LogitsProcessorFactory]:
    return isinstance(obj, LogitsProcessorFactory)
