"""What a request asks its output to match, independent of the proto and the backend."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
AUTO = "auto"
XGRAMMAR = "xgrammar"
LM_FORMAT_ENFORCER = "lm-format-enforcer"


@dataclass(frozen=True)
class StructuredSpec:
    kind: str  # one of KINDS
    value: str | tuple[str, ...] = ""  # schema / regex / EBNF text; choices for "choice"
    backend: str = AUTO  # AUTO, XGRAMMAR or LM_FORMAT_ENFORCER

    @property
    def size(self) -> int:
        return sum(map(len, self.value)) if isinstance(self.value, tuple) else len(self.value)
