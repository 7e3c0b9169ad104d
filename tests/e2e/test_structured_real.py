"""Structured output on the real model: every finished output parses and validates."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from engine.sampling_params import SamplingParams
from structured.spec import LLGUIDANCE, LM_FORMAT_ENFORCER, XGRAMMAR, StructuredSpec
from tests.conftest import SLOW
from tests.e2e.schemas import SCHEMAS
from tests.engine.test_engine import run_to_completion

BACKENDS = [LLGUIDANCE, XGRAMMAR, LM_FORMAT_ENFORCER]
MAX_NEW = 160


def chat(engine, text: str) -> list[int]:
    enc = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"])


def factory(so, spec: StructuredSpec):
    return asyncio.run(so.factory(spec))


def validator(schema: dict):
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def supported(backend: str) -> list[tuple[str, dict, str]]:
    """The suite minus schemas the backend refuses (lm-format-enforcer: unenforced
    keywords such as numeric bounds and formats; those refusals are tested below)."""
    from structured.lmfe_backend import unenforced_keywords

    if backend != LM_FORMAT_ENFORCER:
        return SCHEMAS
    return [s for s in SCHEMAS if not unenforced_keywords(s[1])]


def suite_for(backend: str) -> list[tuple[str, dict, str]]:
    """What the JSON-schema suite runs: every supported schema on llguidance (``auto``'s
    first choice) and under GENSERVE_SLOW; every other one on the other backends (the
    suite's 40 outputs take 20-45 s a backend here, and each backend's masks are checked
    schema by schema in tests/structured)."""
    schemas = supported(backend)
    return schemas if SLOW or backend == LLGUIDANCE else schemas[::2]


def test_lmfe_refuses_schemas_it_cannot_enforce_naming_the_keyword(structured_outputs):
    schema = json.dumps(SCHEMAS[1][1])  # integer with minimum/maximum
    with pytest.raises(ValueError, match=r"lm-format-enforcer cannot enforce.*maximum"):
        factory(structured_outputs, StructuredSpec("json_schema", schema, LM_FORMAT_ENFORCER))
    # auto picks llguidance, which enforces it
    f = factory(structured_outputs, StructuredSpec("json_schema", schema))
    assert f.backend == LLGUIDANCE and not f.lenient
    assert len(supported(LM_FORMAT_ENFORCER)) >= 30 and len(SCHEMAS) >= 40


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_schema_suite_outputs_validate(default_engine, structured_outputs, backend):
    suite = suite_for(backend)
    arrivals = {0: []}
    for name, schema, what in suite:
        f = factory(structured_outputs, StructuredSpec("json_schema", json.dumps(schema),
                                                       backend))
        prompt = chat(default_engine, f"Give {what} as JSON matching this schema: "
                                   f"{json.dumps(schema)}")
        arrivals[0].append((name, prompt, SamplingParams(max_new_tokens=MAX_NEW,
                                                         logits_processors=[f])))
    res = run_to_completion(default_engine, arrivals)
    finished, cut = 0, []
    for name, schema, _ in suite:
        c = res[name][0]
        if c.finish_reason.value == "length":
            cut.append((name, c.text[-80:]))
            continue  # cut short by max_new_tokens: reported as LENGTH, may be incomplete
        assert c.finish_reason.value == "eos", (name, c.finish_reason)
        finished += 1
        validator(schema).validate(json.loads(c.text))
    assert finished >= 0.85 * len(suite), f"only {finished}/{len(suite)} finished: {cut}"
    assert default_engine.scheduler.allocator.num_used == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_choice_and_json_object(default_engine, structured_outputs, backend):
    cases = [
        ("regex_phone", StructuredSpec("regex", r"\(\d{3}\) \d{3}-\d{4}", backend),
         "Write a US phone number.", lambda t: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", t)),
        ("regex_words", StructuredSpec("regex", r"[A-Z][a-z]+( [a-z]+){2,4}\.", backend),
         "Write one short sentence.", lambda t: re.fullmatch(r"[A-Z][a-z]+( [a-z]+){2,4}\.", t)),
        ("choice", StructuredSpec("choice", ("positive", "negative", "neutral"), backend),
         "Sentiment of 'I love this!'?", lambda t: t in ("positive", "negative", "neutral")),
        ("json_object", StructuredSpec("json_object", "", backend),
         "Reply with a JSON object with keys make and year for one car.",
         lambda t: isinstance(json.loads(t), dict)),
    ]
    arrivals = {0: [(n, chat(default_engine, q), SamplingParams(
        max_new_tokens=MAX_NEW, logits_processors=[factory(structured_outputs, spec)]))
        for n, spec, q, _ in cases]}
    res = run_to_completion(default_engine, arrivals)
    for name, _, _, check in cases:
        c = res[name][0]
        assert c.finish_reason.value == "eos", (name, c.text)
        assert check(c.text), (name, c.text)


@pytest.mark.parametrize("backend", [LLGUIDANCE, XGRAMMAR])
def test_ebnf_grammar(default_engine, structured_outputs, backend):
    grammar = r'''
root ::= greeting " " name "!"
greeting ::= "Hello" | "Hi" | "Good morning"
name ::= [A-Z] [a-z]+
'''
    spec = StructuredSpec("grammar", grammar, backend)
    res = run_to_completion(default_engine, {0: [("g", chat(default_engine, "Greet Alice."),
                                               SamplingParams(max_new_tokens=30, logits_processors=[
                                                   factory(structured_outputs, spec)]))]})
    text = res["g"][0].text
    assert re.fullmatch(r"(Hello|Hi|Good morning) [A-Z][a-z]+!", text), text


def test_a_batch_mixing_free_rows_schemas_and_backends(real_engine, structured_outputs):
    free_prompt = chat(real_engine, "Say something nice.")
    alone = run_to_completion(real_engine, {0: [("free", free_prompt,
                                                 SamplingParams(max_new_tokens=24))]})
    arrivals = {0: [("free", free_prompt, SamplingParams(max_new_tokens=24))]}
    picks = [s for s in SCHEMAS if s[0] in ("person", "enum", "nested", "ref_array")]
    for i, (name, schema, what) in enumerate(picks):
        backend = BACKENDS[i % 3]
        f = factory(structured_outputs, StructuredSpec("json_schema", json.dumps(schema),
                                                       backend))
        arrivals[0].append((f"{name}-{backend}", chat(real_engine, f"Give {what} as JSON."),
                            SamplingParams(max_new_tokens=MAX_NEW, logits_processors=[f])))
    res = run_to_completion(real_engine, arrivals)
    assert res["free"][0].token_ids == alone["free"][0].token_ids
    finished = 0
    for i, (name, schema, _) in enumerate(picks):
        c = res[f"{name}-{BACKENDS[i % 3]}"][0]
        if c.finish_reason.value == "length":  # a small model may ramble inside a string
            continue
        assert c.finish_reason.value == "eos", (name, c.finish_reason)
        validator(schema).validate(json.loads(c.text))
        finished += 1
    assert finished >= len(picks) - 1, {k: (v[0].finish_reason, v[0].text[-60:])
                                         for k, v in res.items()}


def test_constrained_greedy_output_is_identical_with_preemption(structured_outputs,
                                                                real_engine):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    schema = next(s for name, s, _ in SCHEMAS if name == "playlist")
    prompts = [chat(real_engine, f"Give playlist number {i} as JSON.") for i in range(4)]

    def run(engine):
        arrivals = {0: [(f"r{i}", p, SamplingParams(max_new_tokens=80, logits_processors=[
            factory(structured_outputs, StructuredSpec("json_schema", json.dumps(schema),
                                                       backend))]))
            for i, p in enumerate(prompts) for backend in BACKENDS[i % 2:i % 2 + 1]]}
        res = run_to_completion(engine, arrivals)
        return [res[f"r{i}"][0].token_ids for i in range(len(prompts))]

    plain = run(real_engine)
    # The same weights with a KV cache too small for all four at once (24 blocks).
    tight = LLMEngine(EngineConfig(kv_cache_memory=24 * real_engine.runner.kv_cache.spec
                                   .bytes_per_block), share_weights=real_engine)
    preempted = run(tight)
    assert tight.scheduler.num_preemptions > 0
    assert preempted == plain
