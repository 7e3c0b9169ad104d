"""llguidance: an Earley parser over a lazily built lexer, so a grammar is ready in
milliseconds whatever its size (no vocabulary-wide precompute), ~60 µs a mask.

Its own fuel and size limits bound every build and mask step, so it runs in-process. A
JSON schema it refuses as *unsupported* is retried with ``lenient`` (unknown keywords
ignored); such a grammar is marked so the service validates the output against the schema.
A schema or regex it refuses as *invalid* (missing ``$ref`` target, unsatisfiable, bad
syntax, look-around) is refused for every backend.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance.hf
import numpy as np
import torch
from llguidance import LLMatcher, LLParserLimits
from llguidance.gbnf_to_lark import any_to_lark

from structured.grammar import bitmask_words
from structured.spec import COMPACT, LLGUIDANCE, SINGLE, StructuredSpec

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a stub-only TypedDict

# Refusals that mean the spec is wrong in itself, so no backend may serve it (no backend
# enforces look-around either). Any other refusal means llguidance cannot enforce the spec
# (an unimplemented keyword, an unknown format, a limit) and another backend may.
_INVALID = re.compile(r"does not exist|unsatisfiable|regex parse error|look-?around|"
                      r"look-?ahead|look-?behind|not valid JSON|must be a JSON object|"
                      r"expected .* for|admits no output", re.IGNORECASE)


# Errors that are llguidance's own limits, not the spec's fault.
_LIMIT = re.compile(r"lexer error|max is|too many|fuel|limit", re.IGNORECASE)
# llguidance's Earley parser gives up past this many items in one row (its default
# ``max_items_in_row``): a rule with this many alternatives fails on its first tokens.
MAX_ITEMS_IN_ROW = 2000
# Error messages without the parser's state dump (it names schema internals).
LIMITS = LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW, verbose_errors=False)
# The build probe: how many single-character first tokens it tries, and how long a path it
# then follows (the lowest allowed token each step) looking for a limit llguidance only
# reports once tokens arrive (a too-wide row, a lexer past its fuel).
PROBE_FIRST_TOKENS = 256
PROBE_STEPS = 8


class UnsupportedSpec(ValueError):
    """The spec may be fine, but this backend cannot enforce it."""


class MatcherError(UnsupportedSpec):
    """The matcher entered its error state while the build was probed."""

    def __init__(self, error: str) -> None:
        super().__init__(f"past llguidance's limits: {error}")
        self.error = error


def whitespace_options(mode: str, max_whitespace: int) -> JsonCompileOptions:
    if mode == COMPACT:
        return {"whitespace_flexible": False}
    if mode == SINGLE:
        return {"whitespace_pattern": r"[ \n]?"}
    return {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{max_whitespace}}}"}


def choice_lark(choices: Sequence[str]) -> str:
    """The choices as ONE lexeme: the lexer matches them all at once, so the parser's row
    stays one item wide however many there are (one rule of alternatives would pass
    ``MAX_ITEMS_IN_ROW`` at 2,000)."""
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices)


def widest_rule(lark: str) -> int:
    """The most top-level alternatives (``|`` outside strings, regexes and brackets, plus
    one) of any rule in a Lark grammar; a line that starts with ``|`` continues a rule."""
    widest = 0
    for rule in re.split(r"\n(?!\s*\|)", lark):
        alternatives, depth, quote = 1, 0, ""
        escaped = False
        for ch in rule:
            if quote:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == quote:
                    quote = ""
            elif ch in "\"/":
                quote = ch
            elif ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            elif ch == "|" and depth == 0:
                alternatives += 1
        widest = max(widest, alternatives)
    return widest


class LLGuidanceGrammar:
    """``validate_tokens`` of llguidance stops before an EOS that ends a complete output;
    like xgrammar, such an EOS counts here as accepted (it terminates the grammar)."""

    def __init__(self, matcher: LLMatcher, eos_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.eos = eos_token_ids

    def _valid(self, ids: list[int]) -> int:
        n = self.matcher.validate_tokens(ids)
        if n < len(ids) and ids[n] in self.eos:
            head = ids[:n]
            if self.matcher.consume_tokens(head):  # valid: checked just above
                ends = self.matcher.is_accepting()
                self.rollback(len(head))
                n += ends
        return n

    def accept_tokens(self, ids: Sequence[int]) -> bool:
        ids = list(ids)
        if self._valid(ids) != len(ids):
            return False  # consuming would leave the matcher in its error state
        # consume_token, unlike consume_tokens, takes the EOS that follows a stopped parser
        ok = all(self.matcher.consume_token(t) for t in ids)
        if self.matcher.is_error():  # a limit the build's probe did not reach: say which
            raise RuntimeError(first_line(self.matcher.get_error()))
        return ok

    def validate_tokens(self, ids: Sequence[int]) -> int:
        return self._valid(list(ids))

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(target.data_ptr(),
                                             target.numel() * target.element_size())
        if self.matcher.is_error():
            raise RuntimeError(first_line(self.matcher.get_error()))

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def reset(self) -> None:
        self.matcher.reset()


class LLGuidanceCompiled:
    def __init__(self, template: LLMatcher, eos: frozenset[int], lenient_ignored: list[str]
                 ) -> None:
        self.template = template
        self.eos = eos  # never advanced: each sequence gets a copy
        # Keywords the lenient build ignored: the output must be validated afterwards.
        self.lenient_ignored = lenient_ignored

    def new_grammar(self) -> LLGuidanceGrammar:
        return LLGuidanceGrammar(self.template.deep_copy(), self.eos)


def first_line(message: str) -> str:
    """The message on one line (llguidance puts the reason after a location line)."""
    return " ".join(message.split())[:500] or "unknown error"


class LLGuidanceBackend:
    name = LLGUIDANCE
    kinds = frozenset({"json_schema", "json_object", "regex", "choice", "grammar"})

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 max_whitespace: int) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self.eos = frozenset(eos_token_ids)
        self.max_whitespace = max_whitespace
        n = min(vocab_size, len(tokenizer))
        texts = tokenizer.batch_decode([[i] for i in range(n)])
        self._one_char = np.zeros(vocab_size, dtype=bool)
        self._one_char[:n] = [len(t) == 1 for t in texts]
        self._eos_array = np.array(sorted(self.eos), dtype=np.int64)

    def grammar_text(self, spec: StructuredSpec, lenient: bool = False) -> str:
        if spec.kind in ("json_schema", "json_object"):
            schema = spec.value if spec.kind == "json_schema" else '{"type": "object"}'
            assert isinstance(schema, str)
            try:
                if not isinstance(json.loads(schema), dict):
                    raise ValueError("a JSON schema must be a JSON object")
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON: {e}") from None
            options = whitespace_options(spec.whitespace, self.max_whitespace)
            if lenient:
                options["lenient"] = True
            return LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if spec.kind == "regex":
            assert isinstance(spec.value, str)
            return LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            return LLMatcher.grammar_from_lark(choice_lark(spec.value))
        assert isinstance(spec.value, str)
        # Our API's grammars are GBNF-style EBNF (``root ::= ...``); Lark is accepted too.
        lark = any_to_lark(spec.value)
        widest = widest_rule(lark)
        if widest >= MAX_ITEMS_IN_ROW:  # refused now: building it would take seconds
            raise UnsupportedSpec(f"a rule has {widest} alternatives; llguidance's parser "
                                  f"takes fewer than {MAX_ITEMS_IN_ROW} (max_items_in_row)")
        return LLMatcher.grammar_from_lark(lark)

    def check(self, grammar: str) -> tuple[str, list[str]]:
        """(error or "", warnings) for a grammar text."""
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer,
                                                                      limits=LIMITS)
        return (messages[0] if is_error else ""), ([] if is_error else messages)

    @staticmethod
    def classify(error: str) -> ValueError:
        """The refusal as UnsupportedSpec (another backend may serve it) or ValueError."""
        return (ValueError if _INVALID.search(error) else UnsupportedSpec)(first_line(error))

    def refuse_invalid(self, spec: StructuredSpec) -> None:
        """Raise if llguidance finds the spec wrong in itself (not merely beyond it), so
        that no other backend serves it either (xgrammar accepts a ``$ref`` to nothing)."""
        if spec.kind not in ("json_schema", "regex"):
            return
        error, _ = self.check(self.grammar_text(spec, lenient=True))
        refusal = self.classify(error) if error else None
        if refusal is not None and not isinstance(refusal, UnsupportedSpec):
            raise refusal

    def compile(self, spec: StructuredSpec) -> LLGuidanceCompiled:
        try:
            grammar = self.grammar_text(spec)
        except ValueError:
            raise
        except Exception as e:  # gbnf_to_lark and friends raise assorted errors
            raise ValueError(f"{type(e).__name__}: {first_line(str(e))}") from None
        error, _ = self.check(grammar)
        ignored: list[str] = []
        if (error and isinstance(self.classify(error), UnsupportedSpec)
                and spec.kind == "json_schema"):
            lenient = self.grammar_text(spec, lenient=True)
            lenient_error, warnings = self.check(lenient)
            if not lenient_error:
                ignored = [first_line(w) for w in warnings] or [first_line(error)]
                grammar, error = lenient, ""
        if error:
            raise self.classify(error)
        template = LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
        if template.is_error():
            raise ValueError(first_line(template.get_error()))
        self._probe(template)
        return LLGuidanceCompiled(template, self.eos, ignored)

    def _probe(self, template: LLMatcher) -> None:
        """Refuse now what would fail once tokens arrive. The build is lazy: a grammar
        that admits no first token (a schema whose $ref only loops) shows at the first
        mask, a limit (a row wider than ``MAX_ITEMS_IN_ROW``, a lexer out of fuel on
        ``a{1000000}``) when the first tokens are consumed. So: the first mask, every
        single-character first token, then a short path of lowest allowed tokens."""
        matcher = template.deep_copy()
        try:
            allowed = self._allowed(matcher)
        except MatcherError as e:
            if not _LIMIT.search(e.error):
                raise ValueError(f"the grammar admits no output ({e.error})") from None
            raise
        if not allowed.size:
            raise ValueError("the grammar admits no output (no token can start it)")
        for tok in allowed[self._one_char[allowed]][:PROBE_FIRST_TOKENS]:
            self._consume(matcher.deep_copy(), int(tok))
        for _ in range(PROBE_STEPS):
            allowed = allowed[~np.isin(allowed, self._eos_array)]
            if not allowed.size or matcher.is_stopped():
                return
            self._consume(matcher, int(allowed[0]))
            allowed = self._allowed(matcher)

    def _allowed(self, matcher: LLMatcher) -> np.ndarray:
        bitmask = torch.zeros(bitmask_words(self.vocab_size), dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
        self._raise_limit(matcher)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
        return np.flatnonzero(bits[:self.vocab_size])

    def _consume(self, matcher: LLMatcher, tok: int) -> None:
        matcher.consume_token(tok)
        self._raise_limit(matcher)

    @staticmethod
    def _raise_limit(matcher: LLMatcher) -> None:
        if matcher.is_error():
            raise MatcherError(first_line(matcher.get_error()).removesuffix(" <non-verbose/>"))
