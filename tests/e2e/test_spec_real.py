"""Speculative decoding on the real model: greedy output unchanged, structured output
still valid and identical, for n-gram lookup (both scorers) and a self-draft."""

from __future__ import annotations

import json

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from specdecode.config import SpeculativeConfig
from specdecode.worker import speculator_for
from structured.spec import LM_FORMAT_ENFORCER, XGRAMMAR, StructuredSpec
from tests.conftest import SLOW
from tests.e2e.test_structured_real import chat, factory, supported, validator
from tests.engine.test_engine import run_to_completion

COPY_PROMPTS = [
    "Repeat this list exactly, changing only the third item to 'pears': apples, bananas, "
    "cherries, dates, figs, grapes.",
    "Rewrite this code with the function renamed to add_numbers:\n\ndef add(a, b):\n"
    "    result = a + b\n    return result\n",
    "Tell me a short story about a dragon.",
]


@pytest.fixture(scope="module")
def ngram_engine(real_engine):
    spec = SpeculativeConfig(method="ngram", num_spec_tokens=4, ngram_min=1, ngram_max=3)
    return LLMEngine(EngineConfig(model="default", max_model_len=1024, runner="torch"),
                     share_weights=real_engine, speculator=speculator_for(spec))


def test_greedy_output_is_unchanged_by_ngram_and_self_draft_speculation(real_engine,
                                                                       ngram_engine):
    arrivals = {0: [(f"r{i}", chat(real_engine, p), SamplingParams(max_new_tokens=64))
                    for i, p in enumerate(COPY_PROMPTS)]}
    want = {k: v[0].token_ids for k, v in run_to_completion(real_engine, arrivals).items()}
    got = {k: v[0].token_ids for k, v in run_to_completion(ngram_engine, arrivals).items()}
    assert got == want
    assert ngram_engine.stats().spec.accepted > 0
    multi = LLMEngine(EngineConfig(model="default", max_model_len=1024, runner="torch"),
                      share_weights=real_engine, speculator=speculator_for(SpeculativeConfig(
                          method="ngram", num_spec_tokens=8, scorer="multi_token")))
    got = {k: v[0].token_ids for k, v in run_to_completion(multi, arrivals).items()}
    assert got == want
    assert multi.stats().spec.accepted > 0
    self_draft = LLMEngine(EngineConfig(model="default", max_model_len=1024, runner="torch"),
                           share_weights=real_engine, speculator=speculator_for(
                               SpeculativeConfig(method="draft", draft_model="self:12",
                                                 num_spec_tokens=3)))
    first = {0: arrivals[0][:1]}
    drafted = run_to_completion(self_draft, first)["r0"][0].token_ids
    assert drafted == want["r0"]
    assert self_draft.stats().spec.steps > 0  # (early layers guess poorly: few accepted)


@pytest.mark.parametrize("backend", [XGRAMMAR, pytest.param(
    LM_FORMAT_ENFORCER, marks=pytest.mark.skipif(not SLOW, reason=(
        "GENSERVE_SLOW: the same path as xgrammar's (~25 s); lm-format-enforcer's "
        "validate/accept/rollback under proposals is checked in tests/structured")))])
def test_structured_output_with_speculation_validates_and_equals_plain(
        real_engine, ngram_engine, structured_outputs, backend):
    picks = supported(backend)[:6]
    arrivals = {0: [(name, chat(real_engine, prompt), SamplingParams(
        max_new_tokens=120, logits_processors=[factory(structured_outputs, StructuredSpec(
            "json_schema", json.dumps(schema), backend))]))
        for name, schema, prompt in picks]}
    want = run_to_completion(real_engine, arrivals)
    got = run_to_completion(ngram_engine, arrivals)
    for name, schema, _ in picks:
        assert got[name][0].token_ids == want[name][0].token_ids, name
        if got[name][0].finish_reason.value == "eos":
            validator(schema).validate(json.loads(got[name][0].text))
    assert sum(c[0].finish_reason.value == "eos" for c in got.values()) >= 4
