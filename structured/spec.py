"""What a request asks its output to match, independent of the proto and the backend."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
AUTO = "auto"
LLGUIDANCE = "llguidance"
XGRAMMAR = "xgrammar"
LM_FORMAT_ENFORCER = "lm-format-enforcer"

# Free whitespace a JSON grammar allows between tokens: none (",", ":" only), at most one
# space or newline, or a bounded run of any JSON whitespace.
COMPACT = "compact"
SINGLE = "single"
FLEXIBLE = "flexible"
WHITESPACE_MODES = (COMPACT, SINGLE, FLEXIBLE)
# the most finished valid outputs end to end on 72 real schemas (bench.structured_coverage
# --e2e 72: flexible 35, single 33, compact 32; README, Performance)
DEFAULT_WHITESPACE = FLEXIBLE


@dataclass(frozen=True)
class StructuredSpec:
    kind: str  # one of KINDS
    value: str | tuple[str, ...] = ""  # schema / regex / EBNF text; choices for "choice"
    backend: str = AUTO  # AUTO, LLGUIDANCE, XGRAMMAR or LM_FORMAT_ENFORCER
    # one of WHITESPACE_MODES (JSON kinds only); "" = the server's default
    whitespace: str = ""

    @property
    def size(self) -> int:
        return sum(map(len, self.value)) if isinstance(self.value, tuple) else len(self.value)
