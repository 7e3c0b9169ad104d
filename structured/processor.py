"""Grammar-constrained decoding as a batched logits-processor factory.

The engine only sees a factory: ``create()`` gives each sequence its own grammar state;
``prepare_batch`` advances every constrained row's grammar by the tokens it emitted and
fills all their bitmask rows in one pass (built on CPU, possibly while the forward runs);
``apply_batch`` masks the logits on their own device in one call. Rows without a grammar
never reach this code. Matchers are pooled per compiled grammar and reset on release.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import xgrammar as xgr

from engine.logits_process import RequestSpecError
from structured.grammar import CompiledGrammar, Grammar, bitmask_words
from structured.output_check import OutputCheck, object_checker, schema_checker
from structured.spec import StructuredSpec

_T = TypeVar("_T")


class GrammarProcessor:
    """One sequence's grammar state, kept in step with the tokens it has emitted.

    Speculative decoding calls it on rows whose ``output_ids`` run ahead through proposed
    tokens, and later on the real output, which may have dropped some of them: ``sync``
    rolls the grammar back to the common prefix before accepting what is new.

    Whatever the backend raises (a limit or error state it meets only mid-output, e.g.
    llguidance's Earley row limit, or a token it allowed and then rejects) is the spec's
    failure on that backend: ``RequestSpecError`` naming the spec's kind and the backend's
    reason, so the client gets INVALID_ARGUMENT, never INTERNAL.
    """

    def __init__(self, grammar: Grammar, vocab_size: int, backend: str = "",
                 kind: str = "grammar") -> None:
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.backend = backend
        self.kind = kind  # the request's field, relative to its structured-output options
        self.history: list[int] = []  # the tokens the grammar has accepted, in order

    def _guarded(self, step: Callable[[], _T]) -> _T:
        try:
            return step()
        except RequestSpecError:
            raise
        except Exception as e:
            raise RequestSpecError(self.kind, f"{self.backend or 'the grammar backend'} could "
                                   f"not go on after {len(self.history)} output tokens: "
                                   f"{e}") from e

    @property
    def num_accepted(self) -> int:
        return len(self.history)

    def sync(self, output_ids: Sequence[int]) -> None:
        self._guarded(lambda: self._sync(output_ids))

    def _sync(self, output_ids: Sequence[int]) -> None:
        h = self.history
        common = min(len(h), len(output_ids))
        if h[:common] != list(output_ids[:common]):
            common = next(i for i in range(common) if h[i] != output_ids[i])
        if common < len(h):
            self.grammar.rollback(len(h) - common)
            del h[common:]
        new = list(output_ids[common:])
        if new and not self.grammar.accept_tokens(new):
            raise RuntimeError(f"the grammar rejected emitted tokens {new}")
        h.extend(new)

    def validate_proposals(self, output_ids: Sequence[int], proposals: Sequence[int]) -> int:
        """How many leading proposed tokens the grammar allows after ``output_ids``."""
        self.sync(output_ids)
        return self._guarded(lambda: self.grammar.validate_tokens(proposals))

    def fill(self, bitmask: torch.Tensor, row: int, output_ids: Sequence[int]) -> None:
        self.sync(output_ids)
        self._guarded(lambda: self.grammar.fill_bitmask(bitmask, row))

    def __call__(self, prompt_ids: Sequence[int], output_ids: Sequence[int],
                 logits: torch.Tensor) -> torch.Tensor:
        """Per-row path (used when a batched call fails): same result, one row."""
        bitmask = torch.zeros(1, bitmask_words(self.vocab_size), dtype=torch.int32)
        self.fill(bitmask, 0, output_ids)
        row = logits.unsqueeze(0).contiguous()
        apply_bitmask(row, bitmask)
        return row[0]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf where the bit is clear. Works for any vocab padding of the logits."""
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))


class GrammarFactory:
    """Shared by every request with the same compiled spec, so their rows batch together.

    ``check_output`` (JSON schemas a backend may enforce only in part) is the engine's to
    run on each output that ends at EOS (``engine.logits_process.CheckedFactory``)."""

    def __init__(self, compiled: CompiledGrammar, vocab_size: int, backend: str,
                 check_output: OutputCheck | None = None, lenient: bool = False,
                 kind: str = "grammar") -> None:
        self.compiled = compiled
        self.vocab_size = vocab_size
        self.backend = backend
        self.kind = kind
        self.check_output = check_output
        self.lenient = lenient
        self._pool: list[Grammar] = []
        self.created = self.released = 0

    @classmethod
    def for_spec(cls, compiled: CompiledGrammar, vocab_size: int, backend: str,
                 spec: StructuredSpec, lenient_ignored: list[str]) -> GrammarFactory:
        """A JSON schema's outputs are checked against it, and a JSON object's for being
        one, whichever backend enforces it: lm-format-enforcer refuses the keywords it would
        not enforce, yet its fallback once let EOS end an unfinished string and its objects
        took a trailing comma (see ``lmfe_backend``)."""
        check = None
        if spec.kind == "json_schema":
            check = schema_checker(spec, backend, lenient_ignored)
        elif spec.kind == "json_object":
            check = object_checker(backend)
        return cls(compiled, vocab_size, backend, check, lenient=bool(lenient_ignored),
                   kind=spec.kind)

    def create(self) -> GrammarProcessor:
        self.created += 1
        grammar = self._pool.pop() if self._pool else self.compiled.new_grammar()
        return GrammarProcessor(grammar, self.vocab_size, self.backend, self.kind)

    def release(self, proc: GrammarProcessor) -> None:
        self.released += 1
        proc.grammar.reset()
        self._pool.append(proc.grammar)

    def prepare_batch(self, products: list[GrammarProcessor], prompt_ids, output_ids
                      ) -> torch.Tensor:
        bitmask = torch.zeros(len(products), bitmask_words(self.vocab_size), dtype=torch.int32)
        for row, (proc, out) in enumerate(zip(products, output_ids, strict=True)):
            proc.fill(bitmask, row, out)
        return bitmask

    def apply_batch(self, bitmask: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.contiguous()
        apply_bitmask(logits, bitmask)
        return logits
