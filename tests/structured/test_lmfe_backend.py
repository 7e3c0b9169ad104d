"""The lm-format-enforcer backend against lmfe's own TokenEnforcer, mask for mask.

The backend runs lmfe's parsers and prefix-tree walk itself (one decode per token, numpy
bitmasks, masks cached by parser-state signature across sequences). Random walks through
every schema the backend accepts, with speculative-style validation and rollback, must see
exactly the masks a fresh TokenEnforcer per sequence computes, as the backend used to.
"""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch
from lmformatenforcer import JsonSchemaParser, RegexParser, TokenEnforcer

from structured.lmfe_backend import LMFEBackend, MaskCache, state_signature, unenforced_keywords
from structured.spec import LM_FORMAT_ENFORCER, StructuredSpec
from tests.conftest import SLOW
from tests.e2e.schemas import SCHEMAS

S, I = "string", "integer"  # noqa: E741

EXTRA_SCHEMAS = {
    "dictionary": {"type": "object", "additionalProperties": {"type": S}},
    "dictionary_required": {"type": "object", "required": ["a"]},
    "root_any_of_objects": {"anyOf": [
        {"type": "object", "properties": {"a": {"type": S}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": I}}, "required": ["b"]}]},
    "array_of_any_of": {"type": "array", "maxItems": 3, "items": {"anyOf": [
        {"type": S}, {"type": "number"}, {"type": "object", "properties": {
            "k": {"type": "boolean"}}}]}},
    "root_string_min": {"type": S, "minLength": 3},
    "root_string_max": {"type": S, "maxLength": 5},
    "root_pattern": {"type": S, "pattern": "^[a-c]{2,4}-[0-9]+$"},
    "strings_everywhere": {"type": "object", "properties": {
        "a": {"type": S}, "b": {"type": "array", "items": {"type": S}},
        "c": {"type": "object", "additionalProperties": {"type": "array",
                                                         "items": {"type": S}}}}},
}


@pytest.fixture(scope="module")
def backend(tokenizer) -> LMFEBackend:
    return LMFEBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id], 12)


def specs() -> list[tuple[str, StructuredSpec]]:
    out = [(name, StructuredSpec("json_schema", json.dumps(schema), LM_FORMAT_ENFORCER))
           for name, schema, _ in SCHEMAS if not unenforced_keywords(schema)]
    out += [(name, StructuredSpec("json_schema", json.dumps(schema), LM_FORMAT_ENFORCER))
            for name, schema in EXTRA_SCHEMAS.items()]
    out += [("json_object", StructuredSpec("json_object", "", LM_FORMAT_ENFORCER)),
            ("regex", StructuredSpec("regex", r"\(\d{3}\) \d{3}-\d{4}|[A-Z][a-z]+( [a-z]+){2,4}\.",
                                     LM_FORMAT_ENFORCER)),
            ("choice", StructuredSpec("choice", ("positive", "negative", "neutral"),
                                      LM_FORMAT_ENFORCER))]
    return out


class Reference:
    """What the backend did before: one TokenEnforcer per sequence over the spec's parser."""

    def __init__(self, backend: LMFEBackend, spec: StructuredSpec) -> None:
        if spec.kind == "json_schema":
            self.parser = JsonSchemaParser(json.loads(spec.value))
        elif spec.kind == "json_object":
            self.parser = JsonSchemaParser({"type": "object"})
        elif spec.kind == "regex":
            self.parser = RegexParser(spec.value)
        else:
            self.parser = RegexParser("|".join(re.escape(c) for c in spec.value))
        self.backend = backend

    def enforcer(self) -> TokenEnforcer:
        enforcer = TokenEnforcer(self.backend.data, self.parser)
        self.parser.config.max_consecutive_whitespaces = self.backend.max_whitespace
        return enforcer


def ref_validate(enforcer: TokenEnforcer, eos: frozenset[int], vocab: int, tokens: list[int],
                 terminated: bool, ids: list[int]) -> int:
    """The backend's former validate_tokens, over a reference enforcer."""
    prefix = list(tokens)
    for n, t in enumerate(ids):
        if terminated or (prefix and prefix[-1] in eos) or not 0 <= t < vocab:
            return n
        word = int(enforcer.get_allowed_tokens(list(prefix)).allowed_tokens[t >> 5].item())
        if not (word >> (t & 31)) & 1:
            return n
        prefix.append(t)
    return len(ids)


def allowed_ids(mask: torch.Tensor) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask.numpy().view(np.uint8), bitorder="little"))


def structural_tokens(backend: LMFEBackend) -> np.ndarray:
    strs = backend.data.tokenizer_tree.tokens_to_strs
    return np.array(sorted(t for t, s in strs.items() if any(c in s for c in '"{}[],:\\\n ')))


def pick(rng: random.Random, allowed: np.ndarray, structural: np.ndarray, eos: int,
         step: int) -> int:
    if eos in allowed and rng.random() < (0.05 if step < 30 else 0.3):
        return eos
    choices = allowed[allowed != eos]
    preferred = np.intersect1d(choices, structural, assume_unique=True)
    if len(preferred) and rng.random() < 0.6:
        choices = preferred
    if not len(choices):
        return eos
    return int(choices[rng.randrange(len(choices))])


@pytest.mark.parametrize("name,spec", specs(), ids=[n for n, _ in specs()])
def test_masks_equal_lmfe_token_enforcer_over_random_walks(backend, name, spec):
    rng = random.Random(name)
    compiled = backend.compile(spec)
    ref = Reference(backend, spec)
    eos_id = backend.eos_token_ids[0]
    eos, vocab = compiled.eos_token_ids, compiled.vocab_size
    structural = structural_tokens(backend)
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    grammar = compiled.new_grammar()
    for seq in range(5 if SLOW else 2):  # walks per spec (see tests/conftest.py)
        if seq:
            grammar.reset()  # pooled grammars are reset, not rebuilt
        enforcer = ref.enforcer()
        tokens: list[int] = []
        terminated = False
        for step in range(60):
            expected = enforcer.get_allowed_tokens(list(tokens)).allowed_tokens
            grammar.fill_bitmask(bitmask, 0)
            assert torch.equal(bitmask[0], expected), (name, seq, tokens)
            allowed = allowed_ids(expected)
            if terminated or not len(allowed):
                break
            if rng.random() < 0.3:  # speculative proposals: some allowed, some not
                proposals, probe = [], list(tokens)
                for _ in range(rng.randint(1, 4)):
                    mask = enforcer.get_allowed_tokens(list(probe)).allowed_tokens
                    ok = allowed_ids(mask)
                    t = (pick(rng, ok, structural, eos_id, step) if len(ok) and rng.random() < 0.8
                         else rng.randrange(vocab + 2))
                    proposals.append(t)
                    if t in eos or not len(ok):
                        break
                    probe.append(t)
                n = grammar.validate_tokens(proposals)
                assert n == ref_validate(enforcer, eos, vocab, tokens, terminated, proposals)
                if rng.random() < 0.5 and n:  # some accepted, as the verifier would
                    m = rng.randint(1, n)
                    assert grammar.accept_tokens(proposals[:m])
                    tokens += proposals[:m]
                    terminated = any(t in eos for t in tokens)
                    continue
                if n < len(proposals):  # a rejected token changes nothing
                    assert not grammar.accept_tokens(proposals)
            if tokens and rng.random() < 0.1:  # rollback, then go on differently
                k = rng.randint(1, min(3, len(tokens)))
                grammar.rollback(k)
                del tokens[len(tokens) - k:]
                terminated = False
                continue
            t = pick(rng, allowed, structural, eos_id, step)
            assert grammar.accept_tokens([t])
            tokens.append(t)
            terminated = t in eos
            assert grammar.is_terminated() == terminated
        if terminated:
            assert not grammar.accept_tokens([eos_id]) and grammar.validate_tokens([0]) == 0


def _walk(backend, compiled, text_tokens: list[int]):
    g = compiled.new_grammar()
    assert g.accept_tokens(text_tokens)
    return g


def test_free_text_states_share_one_cached_mask(backend, tokenizer):
    spec = StructuredSpec("json_schema", json.dumps(
        {"type": "object", "properties": {"story": {"type": S}}, "required": ["story"]}),
        LM_FORMAT_ENFORCER)
    compiled = backend.compile(spec)
    a = _walk(backend, compiled, tokenizer.encode('{"story": "Once upon a time',
                                                  add_special_tokens=False))
    b = _walk(backend, compiled, tokenizer.encode('{"story": "The cat sat on',
                                                  add_special_tokens=False))
    sig_a, sig_b = (state_signature(g.path[-1].parser) for g in (a, b))
    assert sig_a is not None and sig_a == sig_b
    bm = torch.zeros(2, (compiled.vocab_size + 31) // 32, dtype=torch.int32)
    a.fill_bitmask(bm, 0)
    hits = backend.shared.cache.hits
    b.fill_bitmask(bm, 1)
    assert backend.shared.cache.hits == hits + 1 and torch.equal(bm[0], bm[1])


def test_dictionary_keys_are_part_of_the_signature(backend, tokenizer):
    """While a key is parsed its text (and the previous string's) is live: no sharing."""
    compiled = backend.compile(StructuredSpec("json_object", "", LM_FORMAT_ENFORCER))
    a = _walk(backend, compiled, tokenizer.encode('{"ab', add_special_tokens=False))
    b = _walk(backend, compiled, tokenizer.encode('{"cd', add_special_tokens=False))
    assert state_signature(a.path[-1].parser) != state_signature(b.path[-1].parser)


def test_mask_cache_is_bounded_in_bytes():
    cache = MaskCache(max_bytes=3 * 400)
    for i in range(10):
        cache.put(i, np.full(100, i, dtype=np.int32))
    assert len(cache) == 3 and cache.get(0) is None and cache.get(9)[0] == 9


@pytest.mark.parametrize("kind, value, char", [
    ("choice", ("日本",), "日"), ("choice", ("🙂",), "🙂"), ("choice", ("\u0301",), "\u0301"),
    ("choice", ("e\u0301",), "\u0301"), ("regex", "\u0301", "\u0301"),
    ("json_schema", json.dumps({"enum": ["\u0301"]}), "\u0301"),
])
def test_text_only_byte_pieces_spell_is_refused_up_front(backend, kind, value, char):
    """lm-format-enforcer walks whole-character token texts: a character this tokenizer
    spells only in byte pieces could never be written (it used to fail on the first
    token), so the spec is refused when it is compiled, naming the character."""
    with pytest.raises(ValueError, match=f"cannot write .*U\\+{ord(char):04X}"):
        backend.compile(StructuredSpec(kind, value, LM_FORMAT_ENFORCER))


def test_non_ascii_text_that_tokens_spell_whole_is_served(backend, tokenizer):
    compiled = backend.compile(StructuredSpec("choice", ("é", "naïve café"), LM_FORMAT_ENFORCER))
    grammar = compiled.new_grammar()
    tokens = tokenizer.encode("naïve café", add_special_tokens=False)
    assert grammar.accept_tokens(tokens + [tokenizer.eos_token_id])
    assert grammar.is_terminated()


def test_a_characters_byte_pieces_are_never_allowed_so_eos_cannot_cut_a_string(backend,
                                                                              tokenizer):
    """lmfe reads a byte piece as U+FFFD inside a string; when the pieces joined into an
    emoji, its parser fell back to a force stop that allowed EOS, and the real model
    finished ``{"tags":["🌱`` with EOS. The pieces are out of every mask now."""
    spec = StructuredSpec("json_schema", json.dumps({
        "type": "object", "required": ["tags"], "properties": {
            "tags": {"type": "array", "items": {"type": S}, "minItems": 1}}}),
        LM_FORMAT_ENFORCER)
    compiled = backend.compile(spec)
    grammar = _walk(backend, compiled, tokenizer.encode('{"tags": ["',
                                                        add_special_tokens=False))
    bitmask = torch.zeros(1, (compiled.vocab_size + 31) // 32, dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 0)
    allowed = allowed_ids(bitmask[0])
    assert len(allowed) > 1000  # free text inside the string
    assert not [t for t in allowed if "\ufffd" in tokenizer.decode([int(t)])]
    pieces = tokenizer.encode("🌱", add_special_tokens=False)
    assert "\ufffd" in tokenizer.decode(pieces[:1])  # the emoji is byte pieces here
    assert grammar.validate_tokens(pieces) == 0
    eos = backend.eos_token_ids[0]
    assert grammar.validate_tokens([eos]) == 0
    assert grammar.accept_tokens(tokenizer.encode('ok"]}', add_special_tokens=False))
    assert grammar.validate_tokens([eos]) == 1


@pytest.mark.parametrize("kind,schema", [
    ("json_object", None),
    ("json_schema", {"type": "object", "properties": {"a": {"type": I}, "b": {"type": I}}}),
    ("json_schema", {"type": "object", "additionalProperties": {"type": I}}),
], ids=["json_object", "optional_keys", "dictionary"])
def test_an_object_takes_no_closing_brace_after_a_comma(backend, tokenizer, kind, schema):
    """lmfe 0.11.3 lets '}' follow ',' in an object (``{"a": 1,}``, not JSON): the
    default model wrote it under json_object. A key must follow the comma."""
    spec = StructuredSpec(kind, json.dumps(schema) if schema else "", LM_FORMAT_ENFORCER)
    compiled = backend.compile(spec)
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    grammar = _walk(backend, compiled, enc('{"a": 1,'))
    bitmask = torch.zeros(1, (compiled.vocab_size + 31) // 32, dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 0)
    closing = [t for t in allowed_ids(bitmask[0])
               if tokenizer.decode([int(t)]).lstrip().startswith("}")]
    assert not closing  # ('"}' may start a key named "}")
    assert grammar.validate_tokens(enc("}")) == 0 and grammar.validate_tokens(enc(" }")) == 0
    assert grammar.accept_tokens(enc(' "b": 2}'))
    assert grammar.validate_tokens(backend.eos_token_ids) == 1
    for text in ('{}', '{"a": 1}'):  # a brace right after '{' or a value still closes
        g = _walk(backend, compiled, enc(text))
        assert g.validate_tokens(backend.eos_token_ids) == 1
