"""xgrammar: compiled grammars with a token-level FSM; ~0.4 ms a mask on this CPU."""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch
import xgrammar as xgr

from structured.grammar import bitmask_words
from structured.spec import COMPACT, SINGLE, XGRAMMAR, StructuredSpec


def choice_ebnf(choices: Sequence[str]) -> str:
    # JSON string literals are valid EBNF string literals in xgrammar.
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class XGrammarGrammar:
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, ids: Sequence[int]) -> bool:
        for n, t in enumerate(ids):
            if not self.matcher.accept_token(t):
                if n:
                    self.matcher.rollback(n)
                return False
        return True

    def validate_tokens(self, ids: Sequence[int]) -> int:
        n = 0
        for t in ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        self.matcher.reset()


class XGrammarCompiled:
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled

    def new_grammar(self) -> XGrammarGrammar:
        return XGrammarGrammar(xgr.GrammarMatcher(self.compiled))

    def check_first_mask(self, vocab_size: int) -> None:
        """A grammar with no first token (a schema whose $ref only loops) is refused."""
        bitmask = torch.zeros(1, bitmask_words(vocab_size), dtype=torch.int32)
        self.new_grammar().fill_bitmask(bitmask, 0)
        if not bool(bitmask.any()):
            raise ValueError("the grammar admits no output (no token can start it)")


def json_options(whitespace: str, max_whitespace: int) -> dict:
    if whitespace == COMPACT:
        return {"any_whitespace": False, "separators": (",", ":")}
    return {"any_whitespace": True,
            "max_whitespace_cnt": 1 if whitespace == SINGLE else max_whitespace}


class XGrammarBackend:
    name = XGRAMMAR
    kinds = frozenset({"json_schema", "json_object", "regex", "choice", "grammar"})

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 max_whitespace: int, cache_bytes: int = 0) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=eos_token_ids)
        # The cache shares the costly counted-repetition masks (string max/minLength)
        # across schemas: on in the compile workers, bounded by ``cache_bytes``.
        self.compiler = xgr.GrammarCompiler(
            self.info, max_threads=1, cache_enabled=cache_bytes > 0,
            cache_limit_bytes=cache_bytes if cache_bytes > 0 else -1)
        self.vocab_size = vocab_size
        self.max_whitespace = max_whitespace

    def deserialize(self, payload: str) -> XGrammarCompiled:
        """A grammar compiled in a worker process (``serialize_json``), ready to serve."""
        compiled = XGrammarCompiled(xgr.CompiledGrammar.deserialize_json(payload, self.info))
        compiled.check_first_mask(self.vocab_size)
        return compiled

    def compile(self, spec: StructuredSpec) -> XGrammarCompiled:
        try:
            if spec.kind == "json_schema":
                assert isinstance(spec.value, str)
                json.loads(spec.value)  # a clear error for bad JSON before xgrammar's
                out = self.compiler.compile_json_schema(
                    spec.value, **json_options(spec.whitespace, self.max_whitespace))
            elif spec.kind == "json_object":
                out = self.compiler.compile_json_schema(
                    '{"type": "object"}', **json_options(spec.whitespace, self.max_whitespace))
            elif spec.kind == "regex":
                assert isinstance(spec.value, str)
                out = self.compiler.compile_regex(spec.value)
            elif spec.kind == "choice":
                out = self.compiler.compile_grammar(choice_ebnf(spec.value))
            else:
                assert isinstance(spec.value, str)
                out = self.compiler.compile_grammar(spec.value)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from None
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(str(e).strip().splitlines()[0][:500]) from None
        compiled = XGrammarCompiled(out)
        compiled.check_first_mask(self.vocab_size)
        return compiled
