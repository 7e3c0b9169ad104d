"""lm-format-enforcer: a character-level parser walked over the tokenizer's prefix tree.

Its transformers integration does not import with transformers 5, so the tokenizer data
is built here, once per model. Supports JSON schema / object, regex and choice (as a
regex alternation); EBNF grammars are xgrammar's alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import torch
from lmformatenforcer import JsonSchemaParser, RegexParser, TokenEnforcer
from lmformatenforcer.characterlevelparser import CharacterLevelParser
from lmformatenforcer.tokenenforcer import TokenEnforcerTokenizerData

from structured.spec import LM_FORMAT_ENFORCER, StructuredSpec


def build_tokenizer_data(tokenizer, vocab_size: int, eos_token_ids: list[int]
                         ) -> TokenEnforcerTokenizerData:
    """(id, text as it reads after another token, starts-a-word) for every regular token."""
    special = set(tokenizer.all_special_ids)
    zero = tokenizer.encode("0", add_special_tokens=False)[-1]
    regular = []
    for tid in range(min(vocab_size, len(tokenizer))):
        if tid in special:
            continue
        after_zero = tokenizer.decode([zero, tid])[1:]
        alone = tokenizer.decode([tid])
        regular.append((tid, after_zero, len(after_zero) > len(alone)))

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids).rstrip("\ufffd")

    return TokenEnforcerTokenizerData(regular, decode, list(eos_token_ids), True, vocab_size)


# Keywords lm-format-enforcer parses but does not enforce: a schema using them could yield
# output that fails validation, so such a schema is refused instead of silently loosened.
# ("const" is in the list because 0.11.3 was seen to allow EOS inside the next key.)
UNENFORCED_KEYWORDS = frozenset({
    "const",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "format",
    "not", "if", "then", "else", "allOf", "oneOf", "uniqueItems", "minProperties",
    "maxProperties", "patternProperties", "dependentRequired", "dependentSchemas",
    "contains", "prefixItems",
})
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas", "patternProperties")


def unenforced_keywords(schema) -> set[str]:
    """Keywords in ``schema`` (at any depth) that lm-format-enforcer would not enforce."""
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            for key, value in node.items():
                if key in UNENFORCED_KEYWORDS:
                    found.add(key)
                if key in _SCHEMA_MAPS and isinstance(value, dict):
                    stack.extend(value.values())
                elif key not in ("enum", "const", "default", "examples", "required"):
                    stack.append(value)
    return found


class LMFEGrammar:
    """State is the output so far: the enforcer caches one parser state per prefix, so
    rollback is just forgetting tokens."""

    def __init__(self, compiled: LMFECompiled) -> None:
        self.compiled = compiled
        self.enforcer = compiled.new_enforcer()
        self.tokens: list[int] = []
        self.terminated = False

    def _allowed(self, prefix: Sequence[int]) -> torch.Tensor:
        return self.enforcer.get_allowed_tokens(list(prefix)).allowed_tokens

    def _ok(self, prefix: Sequence[int], tok: int) -> bool:
        if self.terminated or not 0 <= tok < self.compiled.vocab_size:
            return False
        word = int(self._allowed(prefix)[tok >> 5].item())
        return bool((word >> (tok & 31)) & 1)

    def accept_tokens(self, ids: Sequence[int]) -> bool:
        if self.validate_tokens(ids) != len(ids):
            return False
        for t in ids:
            self.tokens.append(t)
            if t in self.compiled.eos_token_ids:
                self.terminated = True
        return True

    def validate_tokens(self, ids: Sequence[int]) -> int:
        prefix = list(self.tokens)
        for n, t in enumerate(ids):
            if self.terminated or (prefix and prefix[-1] in self.compiled.eos_token_ids) \
                    or not self._ok(prefix, t):
                return n
            prefix.append(t)
        return len(ids)

    def rollback(self, n: int) -> None:
        if n:
            del self.tokens[len(self.tokens) - n:]
            self.terminated = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self._allowed(self.tokens)

    def is_terminated(self) -> bool:
        return self.terminated

    def reset(self) -> None:
        self.enforcer = self.compiled.new_enforcer()
        self.tokens.clear()
        self.terminated = False


class LMFECompiled:
    def __init__(self, parser: CharacterLevelParser, data: TokenEnforcerTokenizerData,
                 eos_token_ids: list[int], vocab_size: int, max_whitespace: int) -> None:
        self.parser = parser
        self.data = data
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.max_whitespace = max_whitespace

    def new_enforcer(self) -> TokenEnforcer:
        enforcer = TokenEnforcer(self.data, self.parser)
        # TokenEnforcer replaces the parser's config; bound whitespace runs after it does.
        self.parser.config.max_consecutive_whitespaces = self.max_whitespace
        return enforcer

    def new_grammar(self) -> LMFEGrammar:
        return LMFEGrammar(self)


class LMFEBackend:
    name = LM_FORMAT_ENFORCER
    kinds = frozenset({"json_schema", "json_object", "regex", "choice"})

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 max_whitespace: int) -> None:
        self.data = build_tokenizer_data(tokenizer, vocab_size, eos_token_ids)
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.max_whitespace = max_whitespace

    def compile(self, spec: StructuredSpec) -> LMFECompiled:
        try:
            if spec.kind == "json_schema":
                assert isinstance(spec.value, str)
                schema = json.loads(spec.value)
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema must be a JSON object")
                unenforced = unenforced_keywords(schema)
                if unenforced:
                    raise ValueError(f"{self.name} cannot enforce {sorted(unenforced)}; use "
                                     "xgrammar (or auto) for this schema")
                parser: CharacterLevelParser = JsonSchemaParser(schema)
            elif spec.kind == "json_object":
                parser = JsonSchemaParser({"type": "object"})
            elif spec.kind == "regex":
                assert isinstance(spec.value, str)
                re.compile(spec.value)
                parser = RegexParser(spec.value)
            elif spec.kind == "choice":
                parser = RegexParser("|".join(re.escape(c) for c in spec.value))
            else:
                raise ValueError(f"{self.name} does not support kind {spec.kind!r}")
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from None
        except re.error as e:
            raise ValueError(f"invalid regex: {e}") from None
        except ValueError:
            raise
        except Exception as e:  # the parsers raise assorted errors for unsupported input
            raise ValueError(f"{type(e).__name__}: {e}") from None
        compiled = LMFECompiled(parser, self.data, self.eos_token_ids, self.vocab_size,
                                self.max_whitespace)
        compiled.new_grammar().fill_bitmask(torch.zeros(1, (self.vocab_size + 31) // 32,
                                                        dtype=torch.int32), 0)  # fail early
        return compiled
