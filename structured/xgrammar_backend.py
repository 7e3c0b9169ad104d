"""xgrammar: compiled grammars with a token-level FSM; ~0.4 ms a mask on this CPU."""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch
import xgrammar as xgr

from structured.spec import XGRAMMAR, StructuredSpec


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


class XGrammarBackend:
    name = XGRAMMAR
    kinds = frozenset({"json_schema", "json_object", "regex", "choice", "grammar"})

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 max_whitespace: int) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=eos_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.max_whitespace = max_whitespace

    def compile(self, spec: StructuredSpec) -> XGrammarCompiled:
        try:
            if spec.kind == "json_schema":
                assert isinstance(spec.value, str)
                json.loads(spec.value)  # a clear error for bad JSON before xgrammar's
                out = self.compiler.compile_json_schema(
                    spec.value, any_whitespace=True, max_whitespace_cnt=self.max_whitespace)
            elif spec.kind == "json_object":
                out = self.compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=True,
                    max_whitespace_cnt=self.max_whitespace)
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
        return XGrammarCompiled(out)
