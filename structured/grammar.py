"""The one small protocol every grammar backend implements.

A backend compiles a spec once (cached by the manager) into a ``CompiledGrammar``; each
sequence gets its own ``Grammar`` (a matcher with state) from it. Bitmasks are int32
``[rows, ceil(vocab / 32)]`` (bit set = token allowed), the format both xgrammar and
lm-format-enforcer produce, so one apply kernel serves every backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from structured.spec import StructuredSpec


class Grammar(Protocol):
    def accept_tokens(self, ids: Sequence[int]) -> bool:
        """Advance through ``ids``; False (and no state change) if any is rejected."""

    def validate_tokens(self, ids: Sequence[int]) -> int:
        """How many leading ``ids`` the grammar accepts; the state is left unchanged."""

    def rollback(self, n: int) -> None: ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    def is_terminated(self) -> bool: ...

    def reset(self) -> None: ...


class CompiledGrammar(Protocol):
    def new_grammar(self) -> Grammar: ...


class StructuredBackend(Protocol):
    name: str
    kinds: frozenset[str]

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """Blocking; raises ValueError when the spec is invalid for this backend."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
