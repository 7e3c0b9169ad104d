"""lm-format-enforcer: a character-level parser walked over the tokenizer's prefix tree.

Its transformers integration does not import with transformers 5, so the tokenizer data
is built here, once per model. Supports JSON schema / object, regex and choice (as a
union of literals); EBNF grammars are xgrammar's alone. lmfe's ``TokenEnforcer`` is not
used per sequence: the same parsers and walk run here with much less work per step (see
the comment above ``state_signature``); the masks are bit-for-bit lmfe's.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import cast

import lmformatenforcer.jsonschemaparser
import numpy as np
import torch
from lmformatenforcer import JsonSchemaParser, LMFormatEnforcerException, RegexParser
from lmformatenforcer.characterlevelparser import (
    CharacterLevelParser,
    CharacterLevelParserConfig,
    ForceStopParser,
    SequenceParser,
    StringParser,
    UnionParser,
)
from lmformatenforcer.jsonschemaparser import (
    ListParsingState,
    NumberParsingState,
    ObjectParsingStage,
    ObjectParsingState,
    StringParsingState,
)
from lmformatenforcer.tokenenforcer import TokenEnforcerTokenizerData
from lmformatenforcer.tokenizerprefixtree import TokenizerPrefixTreeNode

from structured.grammar import bitmask_words
from structured.spec import COMPACT, LM_FORMAT_ENFORCER, SINGLE, StructuredSpec


class ObjectAfterComma(ObjectParsingState):
    """lmfe's object state, less the trailing comma it allows.

    lm-format-enforcer 0.11.3 (the latest) puts an object back into the stage it starts in
    after '{' when it reads ',', and there '}' may close it: ``{"a": 1,}``, which is not
    JSON, and the default model wrote it under ``json_object``. This state remembers the
    comma and offers no '}' until a key follows. It replaces lmfe's class in lmfe's own
    module (its ``get_parser`` builds every object state there), so lmfe's
    ``TokenEnforcer`` and this backend walk the same fixed parser."""

    after_comma: bool = False

    def clone(self) -> ObjectAfterComma:
        clone = ObjectAfterComma(self.schema_object, self.root)
        clone.current_stage = self.current_stage
        clone.existing_keys = self.existing_keys[:]
        clone.current_key = self.current_key
        clone.is_dictionary = self.is_dictionary
        clone.after_comma = self.after_comma
        return clone

    def add_character(self, new_character: str) -> CharacterLevelParser:
        new = super().add_character(new_character)
        if new is not self:  # not whitespace: a clone, its stage moved on
            cast(ObjectAfterComma, new).after_comma = new_character == "," and \
                cast(ObjectAfterComma, new).current_stage is _KEY_OR_END
        return new

    def get_allowed_characters(self) -> str:
        allowed = super().get_allowed_characters()
        if self.after_comma and self.current_stage is _KEY_OR_END:
            allowed = allowed.replace("}", "")
        return allowed


_KEY_OR_END = ObjectParsingStage.PARSING_KEY_OR_END
lmformatenforcer.jsonschemaparser.ObjectParsingState = ObjectAfterComma  # type: ignore[misc]


def build_tokenizer_data(tokenizer, vocab_size: int, eos_token_ids: list[int]
                         ) -> TokenEnforcerTokenizerData:
    """(id, text as it reads after another token, starts-a-word) for every regular token
    that spells whole characters.

    A byte piece of a character (``\ufffd`` when decoded alone, e.g. the first bytes of an
    emoji) is left out. lmfe reads it as a U+FFFD character the parser accepts inside a
    string; once the pieces join, the joined character is new to the parser, lmfe swaps in
    a ``ForceStopParser``, and that allows EOS mid-JSON: the default model finished
    ``{"tags":["🌱`` that way. Without the pieces such a character cannot be written at all,
    which is what ``TokenTexts`` already tells the user of a spec that needs one."""
    special = set(tokenizer.all_special_ids)
    zero = tokenizer.encode("0", add_special_tokens=False)[-1]
    regular = []
    for tid in range(min(vocab_size, len(tokenizer))):
        if tid in special:
            continue
        after_zero = tokenizer.decode([zero, tid])[1:]
        if "\ufffd" in after_zero:
            continue
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


def without_self_keys(node):
    """The schema with every ``"self"`` *keyword* dropped (property names kept).

    lm-format-enforcer 0.11.3 builds each schema object with ``JsonSchemaObject(**obj)``,
    so a ``"self"`` key collides with the constructor's own argument (TypeError). ``self``
    is no JSON Schema keyword, so dropping it changes nothing that is enforced.
    """
    if isinstance(node, list):
        return [without_self_keys(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "self":
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # names -> sub-schemas
            out[key] = {name: without_self_keys(sub) for name, sub in value.items()}
        else:
            out[key] = without_self_keys(value)
    return out


class TokenTexts:
    """Which text lm-format-enforcer can write with this tokenizer. It walks a tree of
    whole-character token texts, so a character that only byte pieces spell (``日``,
    ``🙂``, a lone combining accent U+0301) can never be written: a spec that needs one
    is refused up front instead of failing on its first token."""

    def __init__(self, data: TokenEnforcerTokenizerData) -> None:
        texts = {text for _, text, _ in data.regular_tokens}
        self.texts = texts
        self.longest = max(map(len, texts), default=1)
        self.starts = {text[0] for text in texts if text}

    def unwritable(self, text: str) -> str | None:
        """The first character of ``text`` no sequence of token texts reaches, if any."""
        if text.isascii():
            return None
        reached = [True] + [False] * len(text)
        for i in range(len(text)):
            if not reached[i]:
                continue
            for j in range(i + 1, min(len(text), i + self.longest) + 1):
                if text[i:j] in self.texts:
                    reached[j] = True
        if reached[-1]:
            return None
        last = max(i for i, ok in enumerate(reached) if ok)
        return text[last]

    def unstartable(self, text: str) -> str | None:
        """A non-ASCII character of ``text`` that no token text starts with, if any."""
        return next((ch for ch in text if not ch.isascii() and ch not in self.starts), None)


def schema_keywords(schema, skip: tuple[str, ...] = ()):
    """Every (keyword, value) of ``schema`` at any depth, sub-schemas under maps of names
    (``properties``, ``$defs``, ...) included; the values of ``skip`` keywords (data, not
    schemas) are not looked into."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            for key, value in node.items():
                yield key, value
                if key in _SCHEMA_MAPS and isinstance(value, dict):
                    stack.extend(value.values())
                elif key not in skip:
                    stack.append(value)


def literal_strings(schema) -> list[str]:
    """The strings a JSON schema makes the output spell (enum and const values)."""
    found: list[str] = []
    for key, value in schema_keywords(schema, ("enum", "const", "default", "examples",
                                               "description", "title")):
        if key in ("enum", "const"):
            values = value if isinstance(value, list) else [value]
            found.extend(v for v in values if isinstance(v, str))
    return found


def whitespace_limit(mode: str, max_whitespace: int) -> int:
    return 0 if mode == COMPACT else 1 if mode == SINGLE else max_whitespace


def unenforced_keywords(schema) -> set[str]:
    """Keywords in ``schema`` (at any depth) that lm-format-enforcer would not enforce."""
    return {key for key, _ in schema_keywords(schema, ("enum", "const", "default",
                                                       "examples", "required"))
            if key in UNENFORCED_KEYWORDS}


# ---------------------------------------------------------------------------------------
# Per-step work. lmfe's TokenEnforcer keys states by the whole token tuple, walks the
# tokenizer prefix tree for every new state (its JSON parser has no cache key), decodes the
# current word twice per token and sets mask bits one torch element at a time. Here the
# parsers and the walk are lmfe's own (the same characters explored in the same order, the
# same free-text shortcut, the same fallbacks), but:
#   * a sequence's states are a path (rollback = truncation), each state keeping its
#     children (validated proposals are reused when accepted) and its decoded word;
#   * the walk collects token ids into a list and packs the bitmask once with numpy;
#   * masks are cached by a parser-state signature (``state_signature``), shared by every
#     sequence of a compiled spec and bounded in bytes across specs.
# ---------------------------------------------------------------------------------------

MASK_CACHE_BYTES = 64 << 20  # ~10k masks of a 49k vocabulary, across all compiled specs
_KEY_VALUE_SEPARATOR = ObjectParsingStage.PARSING_KEY_VALUE_SEPARATOR


class _NoSignature(Exception):
    """A parser this module does not know: its state is not cached."""


class _Same:
    """Identity key for a shared object that lmfe does not mutate once parsers use it (schema
    objects: allOf/oneOf, which lmfe merges in place, are refused at compile; regex FSM
    contexts); holding the object keeps its id from being reused while the key lives."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj


def state_signature(parser: CharacterLevelParser) -> Hashable | None:
    """A key such that two parser states with equal keys (of one compiled spec) get the same
    allowed-token mask from lmfe's prefix-tree walk; None when the state is not understood.

    It is the parser's whole state (schema objects and regex FSMs by identity; fields lmfe
    writes but never reads, a list's parsed_string and an object's current_key, left out),
    except for three things a JSON parser carries that the walk provably never reads:

    * ``last_parsed_string`` is read only by an object in the key-value-separator stage
      when it receives ':' (the key just parsed). Such an object always has its key's
      string parser directly above it until that ':' arrives, and dropping that parser
      rewrites ``last_parsed_string`` in the very call that reads it. So while no object in
      the stack is in that stage, the stored value is dead. If one is ("key mode"), none of
      the three is dropped.
    * the text of a free-text JSON string (no enum, no pattern): a string parser reads its
      text only through its length against minLength/maxLength, its emptiness (leading
      whitespace is skipped) and, once closed, not at all; the text leaves it only into
      ``last_parsed_string`` when the parser is dropped, dead outside key mode. So outside
      key mode the text counts as its length (bounded) or its emptiness (unbounded: the
      free-text shortcut's token lists then do not depend on the length), or as nothing
      once the string is closed.
    * ``last_non_whitespace_character`` is read only by an open list consulted for its
      control characters. While the top of the stack is an open string that needs its
      closing quote, nothing below it is consulted, every character goes to that string,
      and the only way to close it is a quote, which overwrites the field first.
    """
    try:
        return _signature(parser, False)
    except _NoSignature:
        return None


def _signature(p: CharacterLevelParser, abstract: bool) -> Hashable:
    t = type(p)
    if t is JsonSchemaParser:
        return _json_signature(cast(JsonSchemaParser, p))
    if t is StringParsingState:
        s = cast(StringParsingState, p)
        content: object = s.parsed_string
        if abstract and not s.allowed_strings and s.regex_parser is None \
                and s.require_opening_quote and s.require_closing_quote and s.seen_opening_quote:
            if s.seen_closing_quote:
                content = None
            elif s.min_length is None and s.max_length is None:
                content = min(len(s.parsed_string), 1)
            else:
                content = len(s.parsed_string)
        allowed = s.allowed_strings
        if allowed is not None:
            if not all(type(a) is str for a in allowed):
                raise _NoSignature
            allowed = tuple(allowed)
        regex = None if s.regex_parser is None else _signature(s.regex_parser, abstract)
        return ("str", allowed, s.require_opening_quote, s.require_closing_quote,
                s.seen_opening_quote, s.seen_closing_quote, s.min_length, s.max_length,
                s.pattern, regex, content)
    if t is ObjectAfterComma:
        o = cast(ObjectAfterComma, p)
        # existing_keys of a dictionary matter only against its required keys
        keys = None if abstract and o.is_dictionary and not (o.schema_object.required or []) \
            else tuple(o.existing_keys)
        # current_key is only ever copied, never read, once the value starts
        return ("obj", _Same(o.schema_object), o.current_stage, keys, o.is_dictionary,
                o.after_comma)
    if t is NumberParsingState:
        n = cast(NumberParsingState, p)
        return ("num", n.allow_floating_point, n.parsed_string, n.seen_decimal_point,
                n.seen_whitespace_after_digits, n.seen_exponent, n.seen_digit)
    if t is ListParsingState:
        li = cast(ListParsingState, p)
        # a list's parsed_string is never read
        return ("list", _Same(li.list_member_type), li.min_items, li.max_items,
                li.num_items_seen, li.seen_list_opener, li.seen_list_closer)
    if t is UnionParser:
        return ("union", tuple(_signature(q, abstract) for q in cast(UnionParser, p).parsers))
    if t is SequenceParser:
        return ("seq", tuple(_signature(q, abstract) for q in cast(SequenceParser, p).parsers))
    if t is StringParser:
        return ("lit", cast(StringParser, p).target_str)
    if t is ForceStopParser:
        return ("stop", cast(ForceStopParser, p).allow_whitespace)
    if t is RegexParser:
        r = cast(RegexParser, p)
        return ("regex", _Same(r.context), r.current_state)
    raise _NoSignature


def _in_key_mode(parsers: Sequence[CharacterLevelParser]) -> bool:
    for p in parsers:
        t = type(p)
        if t is ObjectAfterComma:
            if cast(ObjectAfterComma, p).current_stage is _KEY_VALUE_SEPARATOR:
                return True
        elif (t is UnionParser or t is SequenceParser) \
                and _in_key_mode(cast(UnionParser, p).parsers):
            return True
    return False


def _json_signature(p: JsonSchemaParser) -> Hashable:
    stack = p.object_stack
    if _in_key_mode(stack):
        return ("json", True, p.num_consecutive_whitespaces, p.last_parsed_string,
                p.last_non_whitespace_character, tuple(_signature(e, False) for e in stack))
    last_char: str | None = p.last_non_whitespace_character
    top = stack[-1] if stack else None
    if type(top) is StringParsingState:
        s = cast(StringParsingState, top)
        if s.require_closing_quote and s.seen_opening_quote and not s.seen_closing_quote:
            last_char = None
    return ("json", False, p.num_consecutive_whitespaces, last_char,
            tuple(_signature(e, True) for e in stack))


class MaskCache:
    """Allowed-token masks by (compiled spec, state signature), least recently used out
    first, bounded in bytes. Thread-safe: compiles (worker threads) fill it too."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._masks: OrderedDict[Hashable, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: Hashable) -> np.ndarray | None:
        with self._lock:
            mask = self._masks.get(key)
            if mask is None:
                self.misses += 1
                return None
            self._masks.move_to_end(key)
            self.hits += 1
            return mask

    def put(self, key: Hashable, mask: np.ndarray) -> None:
        with self._lock:
            if key in self._masks:
                return
            self._masks[key] = mask
            self._bytes += mask.nbytes
            while self._bytes > self.max_bytes and self._masks:
                self._bytes -= self._masks.popitem(last=False)[1].nbytes

    def __len__(self) -> int:
        return len(self._masks)


class _State:
    """The parser after some tokens, as lmfe's OutputTensorState, plus what is derived."""

    __slots__ = ("parser", "word", "decoded", "mask", "children")

    def __init__(self, parser: CharacterLevelParser, word: tuple[int, ...],
                 decoded: str | None = None, mask: np.ndarray | None = None) -> None:
        self.parser = parser
        self.word = word  # lmfe's current_word_tokens
        self.decoded = decoded  # decoder(word), once known
        self.mask = mask
        self.children: dict[int, _State] = {}


class LMFETokens:
    """What every compiled spec of one tokenizer shares: the prefix tree, the decoder,
    numpy copies of the free-text token lists, and the mask cache."""

    def __init__(self, data: TokenEnforcerTokenizerData, eos_token_ids: list[int],
                 vocab_size: int, cache_bytes: int) -> None:
        self.data = data
        self.tree = data.tokenizer_tree
        self.decoder = data.decoder
        self.eos = list(eos_token_ids)
        self.words = bitmask_words(vocab_size)
        self.cache = MaskCache(cache_bytes)
        self._freetext: dict[tuple[int, int], np.ndarray] = {}

    def advance(self, state: _State, token: int) -> _State:
        """lmfe's ``_apply_new_characters``, decoding the word once instead of twice."""
        if token in self.tree.new_word_tokens:
            word: tuple[int, ...] = (token,)
            decoded = None
            new_characters = self.tree.tokens_to_strs[token]
        else:
            word = state.word + (token,)
            if state.decoded is None:
                state.decoded = self.decoder(list(state.word))
            decoded = self.decoder(list(word))
            new_characters = decoded[len(state.decoded):]
        parser = state.parser
        for character in new_characters:
            try:
                parser = parser.add_character(character)
            except Exception as e:
                logging.debug(f"Received an invalid character '{character}', switching to "
                              f"ForceStopParser (Exception:{e})")
                parser = ForceStopParser()
        return _State(parser, word, decoded)

    def mask(self, uid: int, state: _State, tokens: Callable[[], list[int]]) -> np.ndarray:
        if state.mask is None:
            sig = state_signature(state.parser)
            key = None if sig is None else (uid, sig)
            mask = None if key is None else self.cache.get(key)
            if mask is None:
                mask, cacheable = self._compute(state.parser, tokens)
                if cacheable and key is not None:
                    self.cache.put(key, mask)
            state.mask = mask
        return state.mask

    def _compute(self, parser: CharacterLevelParser, tokens: Callable[[], list[int]]
                 ) -> tuple[np.ndarray, bool]:
        """lmfe's ``_compute_allowed_tokens`` (its cache_key cache is replaced by ours)."""
        try:
            ids: list[int] = []
            masks: list[np.ndarray] = []
            self._collect(parser, self.tree.root, ids, masks, parser.shortcut_key())
            if parser.can_end():
                ids.extend(self.eos)
            # (lmfe's "no allowed tokens" check never fires: a TokenList is always truthy)
            return self._pack(ids, masks), True
        except LMFormatEnforcerException:
            raise
        except Exception:
            logging.basicConfig(level=logging.ERROR)  # as lmfe does
            prefix = self.decoder(tokens())
            logging.exception(f"Unknown LMFormatEnforcer Problem. Prefix: '{prefix}'\n"
                              "Terminating the parser. Please open an issue at \n"
                              "https://github.com/noamgat/lm-format-enforcer/issues with the "
                              "prefix and CharacterLevelParser parameters")
            return self._pack(list(self.eos), []), False

    def _collect(self, parser: CharacterLevelParser, node: TokenizerPrefixTreeNode,
                 ids: list[int], masks: list[np.ndarray], shortcut_key: Hashable | None
                 ) -> None:
        """lmfe's ``_collect_allowed_tokens``, collecting ids into a list."""
        ids.extend(node.tokens)
        allowed_characters = parser.get_allowed_characters()
        children = node.children
        characters_to_explore = set(children.keys()).intersection(allowed_characters)
        if isinstance(shortcut_key, tuple) and shortcut_key[0] == "json_freetext":
            assert len(shortcut_key) == 4
            _, cur_len, min_len, max_len = shortcut_key
            cache = self.tree.json_freetext_tokens
            min_remaining = min(cache.max_token_len, max(0, min_len - cur_len))
            max_allowed_len = min(cache.max_token_len, max_len - cur_len)
            masks.append(self._freetext_mask(min_remaining, max_allowed_len))
            characters_to_explore = characters_to_explore.intersection(['"'])
        for character in characters_to_explore:
            self._collect(parser.add_character(character), children[character], ids, masks,
                          None)

    def _freetext_mask(self, min_remaining: int, max_len: int) -> np.ndarray:
        """lmfe's ``JsonFreetextTokenCache.lookup_allowed_tokens``, packed with numpy (lmfe
        sets its ~50k bits one torch element at a time: ~0.2 s per new length pair)."""
        key = (min_remaining, max_len)
        mask = self._freetext.get(key)
        if mask is None:
            cache = self.tree.json_freetext_tokens
            with_quote = cache.quote_tokens_length_cache.get_indices_between_length(
                min_remaining + 1, max_len + 1)
            without_quote = cache.regular_tokens_length_cache.get_indices_between_length(
                -1, max_len)
            mask = self._freetext[key] = self._pack(with_quote + without_quote, [])
        return mask

    def _pack(self, ids: list[int], masks: list[np.ndarray]) -> np.ndarray:
        bits = np.zeros(self.words * 32, dtype=np.uint8)
        if ids:
            bits[ids] = 1
        mask = np.packbits(bits, bitorder="little").view(np.int32)
        for m in masks:
            mask |= m
        return mask  # shared by states and the cache: never written after this


def _allows(mask: np.ndarray, tok: int) -> bool:
    return bool((int(mask[tok >> 5]) >> (tok & 31)) & 1)


class LMFEGrammar:
    """One sequence: the path of states through its tokens (``path[i]`` after ``i``
    tokens), so rollback is truncation and no whole-output tuple is ever hashed."""

    def __init__(self, compiled: LMFECompiled) -> None:
        self.compiled = compiled
        self.tokens: list[int] = []
        self.terminated = False
        self.path = [compiled.root_state()]

    def _mask(self, state: _State, n: int, extra: Sequence[int] = ()) -> np.ndarray:
        return self.compiled.shared.mask(self.compiled.uid, state,
                                         lambda: self.tokens + list(extra[:n]))

    def _child(self, state: _State, tok: int) -> _State:
        child = state.children.get(tok)
        if child is None:
            child = state.children[tok] = self.compiled.shared.advance(state, tok)
        return child

    def accept_tokens(self, ids: Sequence[int]) -> bool:
        if self.validate_tokens(ids) != len(ids):
            return False
        eos = self.compiled.eos_token_ids
        for t in ids:
            self.path.append(self._child(self.path[-1], t))
            self.tokens.append(t)
            if t in eos:
                self.terminated = True
        return True

    def validate_tokens(self, ids: Sequence[int]) -> int:
        eos = self.compiled.eos_token_ids
        vocab_size = self.compiled.vocab_size
        state = self.path[-1]
        last = self.tokens[-1] if self.tokens else None
        for n, t in enumerate(ids):
            if self.terminated or last in eos or not 0 <= t < vocab_size:
                return n
            if n:
                state = self._child(state, ids[n - 1])
            if not _allows(self._mask(state, n, ids), t):
                return n
            last = t
        return len(ids)

    def rollback(self, n: int) -> None:
        if n:
            del self.tokens[len(self.tokens) - n:]
            del self.path[len(self.tokens) + 1:]
            self.terminated = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = torch.from_numpy(self._mask(self.path[-1], 0))

    def is_terminated(self) -> bool:
        return self.terminated

    def reset(self) -> None:
        self.tokens.clear()
        self.terminated = False
        self.path = [self.compiled.root_state()]


_uids = itertools.count()


class LMFECompiled:
    def __init__(self, parser: CharacterLevelParser, shared: LMFETokens,
                 eos_token_ids: list[int], vocab_size: int, max_whitespace: int) -> None:
        self.parser = parser
        self.shared = shared
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.uid = next(_uids)
        # What TokenEnforcer's constructor does to the parser, then our whitespace bound.
        parser.config = CharacterLevelParserConfig(alphabet=shared.data.tokenizer_alphabet)
        parser.config.max_consecutive_whitespaces = max_whitespace
        self._root = _State(parser, ())

    def root_state(self) -> _State:
        # Each sequence gets its own root (its children are that sequence's); the parser
        # and, once computed, the mask are shared.
        if self._root.mask is None:
            self.shared.mask(self.uid, self._root, list)
        return _State(self._root.parser, (), None, self._root.mask)

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
        self.shared = LMFETokens(self.data, self.eos_token_ids, vocab_size, MASK_CACHE_BYTES)
        self.token_texts = TokenTexts(self.data)

    def _refuse_unwritable(self, spec: StructuredSpec, schema=None) -> None:
        texts = self.token_texts
        if spec.kind == "choice" or schema is not None:
            literals = spec.value if spec.kind == "choice" else literal_strings(schema)
            bad = next(filter(None, map(texts.unwritable, literals)), None)
        elif spec.kind == "regex":
            assert isinstance(spec.value, str)
            bad = texts.unstartable(spec.value)
        else:
            bad = None
        if bad is not None:
            raise ValueError(f"{self.name} cannot write {bad!r} (U+{ord(bad):04X}): this "
                             "tokenizer spells it only in byte pieces, which lm-format-enforcer "
                             "cannot join; use llguidance, xgrammar or auto")

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
                self._refuse_unwritable(spec, schema)
                parser: CharacterLevelParser = JsonSchemaParser(without_self_keys(schema))
            elif spec.kind == "json_object":
                parser = JsonSchemaParser({"type": "object"})
            elif spec.kind == "regex":
                assert isinstance(spec.value, str)
                re.compile(spec.value)
                self._refuse_unwritable(spec)
                parser = RegexParser(spec.value)
            elif spec.kind == "choice":
                self._refuse_unwritable(spec)
                # literal parsers, not a regex alternation: interegular's FSM of 2,000
                # choices takes seconds to build, these take none
                parser = UnionParser([StringParser(c) for c in spec.value])
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
        compiled = LMFECompiled(parser, self.shared, self.eos_token_ids, self.vocab_size,
                                whitespace_limit(spec.whitespace, self.max_whitespace))
        compiled.new_grammar().fill_bitmask(torch.zeros(1, (self.vocab_size + 31) // 32,
                                                        dtype=torch.int32), 0)  # fail early
        return compiled
