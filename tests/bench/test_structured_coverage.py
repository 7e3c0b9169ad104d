"""The coverage bench's compliance logic (bench.structured_coverage), so a broken
measurement is caught: a toy grammar with a known language, then every backend the server
builds on tiny hand-written schemas whose valid and invalid instances have a known verdict.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import pytest
import torch

from bench.structured_coverage import (
    DATA,
    SchemaResult,
    bit,
    check_instance,
    load_sample,
    serialise,
    summarise,
)

EOS = 0
WORDS = 1  # a 32-token toy vocabulary


class ToyGrammar:
    """Accepts exactly the token sequences in ``words`` (then EOS); can be told to lie in its
    mask about one token, to check that disagreements are seen."""

    def __init__(self, words: list[list[int]], mask_lies_about: int | None = None) -> None:
        self.words = words
        self.out: list[int] = []
        self.lie = mask_lies_about

    def _allowed(self) -> set[int]:
        n = len(self.out)
        nxt = {w[n] for w in self.words if w[:n] == self.out and len(w) > n}
        if self.out in self.words:
            nxt.add(EOS)
        return nxt

    def accept_tokens(self, ids: Sequence[int]) -> bool:
        if self.validate_tokens(ids) != len(ids):
            return False
        self.out += list(ids)
        return True

    def validate_tokens(self, ids: Sequence[int]) -> int:
        saved, n = list(self.out), 0
        for t in ids:
            if t not in self._allowed():
                break
            self.out.append(t)
            n += 1
        self.out = saved
        return n

    def rollback(self, n: int) -> None:
        del self.out[len(self.out) - n:]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        allowed = self._allowed() ^ ({self.lie} if self.lie is not None else set())
        value = sum(1 << t for t in allowed)
        bitmask[row, 0] = value - (1 << 32) if value >= 1 << 31 else value

    def is_terminated(self) -> bool:
        return False

    def reset(self) -> None:
        self.out = []


def check(words, ids, valid, **kw):
    return check_instance(ToyGrammar(words, **kw), ids, valid, [EOS], WORDS)


def test_bit_reads_int32_rows_including_the_sign_bit():
    row = torch.tensor([[-(1 << 31) | 0b101]], dtype=torch.int32).numpy()[0]
    assert [bit(row, t) for t in (0, 1, 2, 31)] == [True, False, True, True]


def test_toy_grammar_verdicts():
    words = [[3, 4, 5], [3, 6]]
    ok = check(words, [3, 4, 5], True)
    assert (ok.accepted, ok.can_end, ok.grammar_accepts, ok.correct) == (3, True, True, True)
    assert len(ok.mask_s) == 3 and ok.disagreement == -1
    # a valid instance refused mid-way: over-constraint
    over = check(words, [3, 7], True)
    assert (over.accepted, over.grammar_accepts, over.correct) == (1, False, False)
    # an invalid one rejected at its second token: correct
    assert check(words, [3, 7], False).correct
    # an invalid one that is a strict prefix: every token accepted, but no EOS at the end
    prefix = check(words, [3, 4], False)
    assert (prefix.accepted, prefix.can_end, prefix.correct) == (2, False, True)
    # an invalid one the grammar takes whole: under-constraint
    assert not check(words, [3, 6], False).correct


def test_mask_and_accept_must_agree():
    # the mask forbids a token the grammar would accept: refused (generation could not
    # emit it), and the disagreement is recorded
    r = check([[3, 4]], [3, 4], True, mask_lies_about=4)
    assert (r.accepted, r.correct, r.disagreement) == (1, False, 1)
    # the mask allows a token the grammar then refuses
    r = check([[3, 4]], [3, 9], False, mask_lies_about=9)
    assert (r.accepted, r.correct, r.disagreement) == (1, True, 1)


# Tiny schemas every backend supports exactly: (schema, valid instances, invalid instances).
SCHEMAS = {
    "object": ({"type": "object", "properties": {"name": {"type": "string"},
                                                 "n": {"type": "integer"}},
                "required": ["name", "n"], "additionalProperties": False},
               [{"name": "x y", "n": 3}, {"name": "", "n": -12}],
               [{"name": "x"}, {"name": "x", "n": "3"}, {"name": "x", "n": 3, "z": 1},
                [1]]),
    "enum": ({"enum": ["red", "green", "blue"]},
             ["red", "blue"],
             ["re", "yellow", "Red", 1]),
    "array": ({"type": "array", "items": {"type": "boolean"}},
              [[], [True, False, True]],
              [[1], {"a": True}, [True, "false"]]),
}


@pytest.fixture(scope="module")
def structured(tokenizer):
    from structured.manager import StructuredOutputs

    so = StructuredOutputs(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    yield so
    so.close()


def test_every_backend_on_tiny_schemas(structured, tokenizer):
    from structured.grammar import bitmask_words
    from structured.spec import AUTO, StructuredSpec

    words = bitmask_words(len(tokenizer))
    wrong = []
    for backend in [*structured.backends, AUTO]:
        for name, (schema, valid, invalid) in SCHEMAS.items():
            spec = StructuredSpec("json_schema", json.dumps(schema), backend)
            factory = asyncio.run(structured.factory(spec))
            for value, expected in [(v, True) for v in valid] + [(v, False) for v in invalid]:
                ids = tokenizer.encode(serialise(value), add_special_tokens=False)
                proc = factory.create()
                r = check_instance(proc.grammar, ids, expected, [tokenizer.eos_token_id],
                                   words)
                factory.release(proc)
                if not r.correct or r.disagreement >= 0:
                    wrong.append((backend, name, value, r))
    assert not wrong


def test_summary_counts():
    rows = [SchemaResult("a", "s", "served", "xgrammar", 0.01, valid_total=2, valid_ok=2,
                         invalid_total=3, invalid_ok=2),
            SchemaResult("b", "s", "timeout", ttfm_s=12.0),
            SchemaResult("c", "s", "refused", error="no")]
    s = summarise("xgrammar", rows, [10.0, 20.0], limit=10.0)
    assert (s["served"], s["status"]) == (1, {"served": 1, "timeout": 1, "refused": 1})
    assert s["ttfm_s"]["max"] == 10.0 and s["ttfm_s"]["n"] == 2  # a timeout counts as the limit
    assert (s["valid"]["accepted"], s["invalid"]["rejected"]) == (2, 2)
    assert (s["schemas_under_constrained"], s["schemas_fully_compliant"]) == (1, 0)


def test_sample_matches_its_manifest():
    manifest = json.loads((DATA / "manifest.json").read_text())
    items = load_sample()
    assert len(items) == len(manifest["files"]) >= 200
    assert sum(len(it.tests) for it in items) == sum(f["valid"] + f["invalid"]
                                                      for f in manifest["files"])
    quick = load_sample(n=30, seed=0)
    assert len(quick) == 30 and len({it.subset for it in quick}) >= 15


# Properties declared b, a (both required; c optional, in an array of objects declared y, x):
# grammars emit and accept that order only.
ORDERED = {"type": "object",
           "properties": {"b": {"type": "integer"}, "a": {"type": "integer"},
                          "c": {"type": "array", "items": {
                              "type": "object", "properties": {"y": {"type": "integer"},
                                                               "x": {"type": "integer"}}}}},
           "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def ordered_backends(structured):
    """Backends that fix the key order (lm-format-enforcer accepts any order)."""
    from structured.spec import LLGUIDANCE, XGRAMMAR, StructuredSpec

    out = {}
    for name in (LLGUIDANCE, XGRAMMAR):
        if name in structured.backends:
            spec = StructuredSpec("json_schema", json.dumps(ORDERED), name)
            out[name] = asyncio.run(structured.factory(spec))
    assert out
    return out


def test_valid_instance_is_retried_with_keys_in_the_grammars_order(ordered_backends,
                                                                   tokenizer):
    from bench.structured_coverage import check_value, in_grammar_order
    from structured.grammar import bitmask_words

    words, eos = bitmask_words(len(tokenizer)), [tokenizer.eos_token_id]

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    for name, factory in ordered_backends.items():
        def fresh(factory=factory):
            return factory.create().grammar

        def run(value, valid):
            return check_value(fresh, encode, value, valid, eos, words)

        # refused as serialised, accepted reordered (nested objects too)
        value = {"a": 1, "c": [{"x": 1, "y": 2}, {"x": 3}], "b": 2}
        assert serialise(in_grammar_order(fresh(), encode, value)) == \
            '{"b":2,"a":1,"c":[{"y":2,"x":1},{"x":3}]}', name
        strict, reordered = run(value, True)
        assert (strict.grammar_accepts, reordered) == (False, True), name
        # already in order: accepted strictly, not retried
        strict, reordered = run({"b": 2, "a": 1}, True)
        assert (strict.grammar_accepts, reordered) == (True, None), name
        # a required key missing: no order helps (even if the data called it valid)
        assert in_grammar_order(fresh(), encode, {"a": 1}) is None, name
        strict, reordered = run({"a": 1}, True)
        assert (strict.grammar_accepts, reordered) == (False, False), name
        # invalid instances are never reordered, so never accepted by reordering
        strict, reordered = run({"a": 1, "b": "2"}, False)
        assert (strict.correct, reordered) == (True, None), name
        strict, reordered = run({"a": 1, "b": 2, "z": 0}, False)
        assert (strict.correct, reordered) == (True, None), name
        assert in_grammar_order(fresh(), encode, {"a": 1, "b": 2, "z": 0}) is None, name


def test_in_grammar_order_leaves_the_grammar_as_it_was_when_it_fails(ordered_backends,
                                                                     tokenizer):
    from bench.structured_coverage import in_grammar_order

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    for name, factory in ordered_backends.items():
        g = factory.create().grammar
        assert in_grammar_order(g, encode, {"b": 1, "a": "x"}) is None, name
        # rolled back to the start: a good value still goes through from here
        assert in_grammar_order(g, encode, {"a": 1, "b": 2}) == {"b": 2, "a": 1}, name
