"""The llguidance backend: every kind, whitespace modes, EOS, rollback, and refusals."""

from __future__ import annotations

import json

import pytest
import torch

from structured.grammar import bitmask_words
from structured.llguidance_backend import LLGuidanceBackend, UnsupportedSpec
from structured.lmfe_backend import LMFEBackend
from structured.spec import COMPACT, FLEXIBLE, SINGLE, StructuredSpec
from structured.xgrammar_backend import XGrammarBackend

PERSON = json.dumps({"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False})


@pytest.fixture(scope="module")
def llg(tokenizer):
    return LLGuidanceBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id], 4)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def accepts_all(backend, tokenizer, spec: StructuredSpec, text: str) -> bool:
    grammar = backend.compile(spec).new_grammar()
    return grammar.validate_tokens(ids(tokenizer, text)) == len(ids(tokenizer, text))


def test_json_schema_output_is_accepted_token_by_token_then_eos(llg, tokenizer):
    grammar = llg.compile(StructuredSpec("json_schema", PERSON)).new_grammar()
    tokens = ids(tokenizer, '{"name": "Ann", "age": 41}')
    eos = tokenizer.eos_token_id
    assert grammar.validate_tokens(tokens + [eos]) == len(tokens) + 1
    assert grammar.accept_tokens(tokens)
    bitmask = torch.zeros(1, bitmask_words(len(tokenizer)), dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 0)
    allowed = (bitmask[0].view(torch.uint8).unsqueeze(1)
               >> torch.arange(8, dtype=torch.uint8)) & 1
    assert allowed.flatten().nonzero().flatten().tolist() == [eos]  # only the end is left
    assert grammar.accept_tokens([eos]) and grammar.is_terminated()


def test_rejected_tokens_leave_the_state_unchanged_and_rollback_restores(llg, tokenizer):
    grammar = llg.compile(StructuredSpec("json_schema", PERSON)).new_grammar()
    head = ids(tokenizer, '{"name": "Ann"')
    assert grammar.accept_tokens(head)
    assert not grammar.accept_tokens(ids(tokenizer, ', "color"'))  # not in the schema
    assert grammar.validate_tokens(ids(tokenizer, ', "age": 3}')) == len(
        ids(tokenizer, ', "age": 3}'))
    grammar.rollback(len(head))
    assert grammar.validate_tokens(ids(tokenizer, "[")) == 0
    assert grammar.validate_tokens(head) == len(head)
    grammar.reset()
    assert grammar.accept_tokens(head)


@pytest.mark.parametrize(("kind", "value", "good", "bad"), [
    ("regex", r"[0-9]{2}-[a-z]{3}", "12-abc", "1-abc"),
    ("choice", ("alpha", "beta gamma"), "beta gamma", "beta delta"),
    ("json_object", "", '{"a": [1, 2]}', "[1, 2]"),
    ("grammar", 'root ::= "x" digits\ndigits ::= [0-9]+', "x42", "y42"),  # our GBNF dialect
    ("grammar", 'start: "x" NUMBER\n%import common.NUMBER', "x42", "x"),  # Lark
])
def test_every_kind(llg, tokenizer, kind, value, good, bad):
    spec = StructuredSpec(kind, value)
    assert accepts_all(llg, tokenizer, spec, good)
    grammar = llg.compile(spec).new_grammar()
    bad_ids = ids(tokenizer, bad)
    n = grammar.validate_tokens(bad_ids + [tokenizer.eos_token_id])
    assert n < len(bad_ids) + 1


@pytest.mark.parametrize("make", [LLGuidanceBackend, XGrammarBackend, LMFEBackend])
def test_whitespace_modes(tokenizer, make):
    backend = make(tokenizer, len(tokenizer), [tokenizer.eos_token_id], 4)
    compact, spaced, newlines = ('{"name":"Ann","age":4}', '{"name": "Ann", "age": 4}',
                                 '{\n"name": "Ann",\n"age": 4\n}')
    long_run = '{"name":"Ann",' + " " * 6 + '"age":4}'

    def ok(mode: str, text: str) -> bool:
        return accepts_all(backend, tokenizer, StructuredSpec("json_schema", PERSON,
                                                              whitespace=mode), text)

    assert ok(COMPACT, compact) and not ok(COMPACT, spaced)
    assert ok(SINGLE, compact) and ok(SINGLE, spaced) and ok(SINGLE, newlines)
    assert not ok(SINGLE, '{"name":  "Ann", "age": 4}')
    assert ok(FLEXIBLE, spaced) and ok(FLEXIBLE, newlines)
    assert not ok(FLEXIBLE, long_run)  # bounded by max_whitespace (4 here)


@pytest.mark.parametrize(("kind", "value", "why"), [
    ("json_schema", '{"$ref": "#/$defs/missing"}', "does not exist"),
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "string"}},
                                "required": ["a", "b"], "additionalProperties": False}),
     "unsatisfiable"),
    ("json_schema", '{"$ref": "#"}', "admits no output"),
    ("json_schema", "{not json", "not valid JSON"),
    ("regex", "(?=a)a", "look-around"),
    ("regex", "(unclosed", "regex"),
    ("grammar", "root ::= nothing", "nothing"),
])
def test_specs_wrong_in_themselves_are_refused_not_unsupported(llg, kind, value, why):
    with pytest.raises(ValueError, match=why) as err:
        llg.compile(StructuredSpec(kind, value))
    assert not isinstance(err.value, UnsupportedSpec)


def test_unsupported_keyword_is_served_leniently_and_says_what_it_ignored(llg, tokenizer):
    compiled = llg.compile(StructuredSpec("json_schema", json.dumps(
        {"type": "object", "properties": {"a": {"not": {"type": "string"}}}})))
    assert compiled.lenient_ignored and "not" in compiled.lenient_ignored[0]
    assert compiled.new_grammar().validate_tokens(ids(tokenizer, '{"a": 1}')) > 0


def test_a_top_level_self_key_compiles(llg, tokenizer):
    schema = json.dumps({"type": "object", "self": {"href": "x"},
                         "properties": {"self": {"type": "string"}}, "required": ["self"]})
    assert accepts_all(llg, tokenizer, StructuredSpec("json_schema", schema), '{"self": "me"}')
    lmfe = LMFEBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id], 4)
    assert accepts_all(lmfe, tokenizer, StructuredSpec("json_schema", schema),
                       '{"self": "me"}')
