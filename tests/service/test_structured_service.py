"""Structured output over gRPC on a tiny model: bad specs fail alone, bounds hold."""

from __future__ import annotations

import json
import re

import grpc
import pytest

from engine.config import EngineConfig
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from structured.manager import StructuredConfig
from tests.service.conftest import start_server, stop_server

XG = pb.STRUCTURED_BACKEND_XGRAMMAR
LLG = pb.STRUCTURED_BACKEND_LLGUIDANCE
LMFE = pb.STRUCTURED_BACKEND_LM_FORMAT_ENFORCER
# ~12 KB of patterned fields: xgrammar needs seconds to compile it (measured ~3 s).
SLOW_SCHEMA = json.dumps({"type": "object", "required": [f"f{i}" for i in range(150)],
                          "properties": {f"f{i}": {"type": "string", "pattern":
                                                   f"[a-z]{{1,{i % 20 + 1}}}[0-9]{{2,{i % 7 + 3}}}"}
                                         for i in range(150)}})


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    running, thread = start_server(
        EngineConfig(model=str(tiny_model_dir), max_model_len=256),
        structured=StructuredConfig(compile_timeout_s=0.5, max_spec_bytes=16_000))
    yield running
    stop_server(running, thread)


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as ch:
        yield pb_grpc.GenerationServiceStub(ch)


def req(so: pb.StructuredOutput, prompt="Answer:", max_new=24) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, structured_output=so,
                              stopping=pb.StoppingCriteria(max_new_tokens=max_new))


def test_model_info_lists_backends_and_kinds(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert list(info.structured_backends) == ["llguidance", "xgrammar", "lm-format-enforcer"]
    kinds = {b.name: set(b.kinds) for b in info.structured_backend_info}
    assert kinds["xgrammar"] == {"json_schema", "json_object", "regex", "choice", "grammar"}
    assert kinds["llguidance"] == kinds["xgrammar"]
    assert "grammar" not in kinds["lm-format-enforcer"]


@pytest.mark.parametrize("backend", [LLG, XG, LMFE, pb.STRUCTURED_BACKEND_UNSPECIFIED])
def test_choice_and_regex_hold_even_for_a_random_model(stub, backend):
    choices = ["alpha", "beta", "gamma delta"]
    for i in range(3):
        r = stub.Generate(req(pb.StructuredOutput(choice=pb.ChoiceList(choices=choices),
                                                  backend=backend), prompt=f"Pick {i}"))
        assert r.completions[0].text in choices
        assert r.completions[0].finish_reason == pb.FINISH_REASON_EOS
    r = stub.Generate(req(pb.StructuredOutput(regex=r"[0-9]{2}-[a-z]{3}", backend=backend)))
    assert re.fullmatch(r"[0-9]{2}-[a-z]{3}", r.completions[0].text)


def test_stream_of_a_constrained_request_matches_unary(stub):
    r = req(pb.StructuredOutput(regex=r"(ab|cd){3}x"))
    unary = stub.Generate(r).completions[0].text
    streamed = "".join(m.text for m in stub.GenerateStream(pb.GenerateStreamRequest(request=r)))
    assert streamed == unary and re.fullmatch(r"(ab|cd){3}x", unary)


BAD = [
    (pb.StructuredOutput(json_schema="{not json"), "json_schema"),
    (pb.StructuredOutput(json_schema="   "), "json_schema"),
    (pb.StructuredOutput(regex="(unclosed", backend=LMFE), "regex"),
    (pb.StructuredOutput(regex="(unclosed", backend=XG), "regex"),
    (pb.StructuredOutput(grammar="root ::= ", backend=XG), "grammar"),
    (pb.StructuredOutput(grammar='root ::= "a"', backend=LMFE),
     "backend lm-format-enforcer does not support kind 'grammar'"),
    (pb.StructuredOutput(choice=pb.ChoiceList()), "choice"),
    (pb.StructuredOutput(json_object=False), "json_object"),
    (pb.StructuredOutput(json_schema=json.dumps({"type": "integer", "maximum": 3}),
                         backend=LMFE), "cannot enforce"),
    (pb.StructuredOutput(json_schema=json.dumps({"type": "string",
                                                 "description": "x" * 20_000})), "limit"),
    (pb.StructuredOutput(json_schema=SLOW_SCHEMA, backend=XG), "longer than"),
]


def test_invalid_specs_fail_alone_inside_a_batch(stub):
    good = [req(pb.StructuredOutput(choice=pb.ChoiceList(choices=["yes", "no"]))),
            pb.GenerateRequest(prompt="free text", stopping=pb.StoppingCriteria(max_new_tokens=5))]
    items = good + [req(so) for so, _ in BAD]
    resp = stub.GenerateBatch(pb.GenerateBatchRequest(requests=items))
    assert resp.results[0].response.completions[0].text in ("yes", "no")
    free = resp.results[1]
    assert free.WhichOneof("outcome") == "response"
    assert free.response.usage.completion_tokens > 0 and free.response.completions[0].text
    for r, (_, needle) in zip(resp.results[2:], BAD, strict=True):
        assert r.WhichOneof("outcome") == "error", needle
        assert r.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert needle in r.error.message, r.error.message
        assert "structured_output" in r.error.message


def test_compile_cache_reuses_one_factory(server, stub, monkeypatch):
    so = server.server.servicer.structured
    built: list[str] = []  # counted per spec: background accelerations may run meanwhile
    build = so._build

    def counting(spec):
        built.append(spec.value)
        return build(spec)

    monkeypatch.setattr(so, "_build", counting)
    hits = so.stats.cache_hits
    for _ in range(3):
        stub.Generate(req(pb.StructuredOutput(regex=r"z{2}[0-9]", backend=XG)))
    assert built.count(r"z{2}[0-9]") == 1
    assert so.stats.cache_hits - hits >= 2


def test_min_new_tokens_yields_to_a_grammar_that_can_only_end(stub):
    r = req(pb.StructuredOutput(choice=pb.ChoiceList(choices=["yes", "no"])))
    r.stopping.min_new_tokens = 10
    c = stub.Generate(r).completions[0]
    assert c.text in ("yes", "no")
    assert c.finish_reason == pb.FINISH_REASON_EOS


def test_ignore_eos_with_structured_output_is_invalid_argument(stub):
    r = req(pb.StructuredOutput(regex="[a-z]+"))
    r.stopping.ignore_eos = True
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(r)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ignore_eos" in e.value.details()


def test_response_names_the_backend_and_model_info_counts_it(stub):
    so = pb.StructuredOutput(regex=r"[0-9]{3}", backend=LLG)
    before = {b.name: b for b in stub.GetModelInfo(pb.GetModelInfoRequest())
              .structured_backend_info}["llguidance"]
    r = stub.Generate(req(so))
    assert r.structured_backend == "llguidance"
    assert stub.Generate(req(pb.StructuredOutput(regex=r"[0-9]{3}", backend=XG))
                         ).structured_backend == "xgrammar"
    assert stub.Generate(pb.GenerateRequest(prompt="x", stopping=pb.StoppingCriteria(
        max_new_tokens=2))).structured_backend == ""
    after = {b.name: b for b in stub.GetModelInfo(pb.GetModelInfoRequest())
             .structured_backend_info}["llguidance"]
    assert after.requests == before.requests + 1
    assert after.compiles >= 1 and after.compile_seconds_total > 0
    assert after.compile_seconds_max <= after.compile_seconds_total


def test_whitespace_mode_reaches_the_grammar(server, stub):
    so = pb.StructuredOutput(json_object=True, whitespace=pb.STRUCTURED_WHITESPACE_COMPACT)
    stub.Generate(req(so, max_new=4))
    cache = server.server.servicer.structured._cache
    assert any(key[:2] == ("auto", "json_object") and key[3] == "compact" for key in cache)
    bad = req(pb.StructuredOutput(json_object=True, whitespace=99))
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_output.whitespace" in e.value.details()


def test_an_output_failing_its_schema_check_is_reported_with_its_text(server, stub):
    """What a lenient (partly enforced) grammar's failed output looks like to clients:
    finish reason ERROR naming the problem, the text kept, the call itself OK."""
    schema = json.dumps({"enum": ["yes", "no"]})
    r = req(pb.StructuredOutput(json_schema=schema, backend=LLG))
    assert stub.Generate(r).completions[0].finish_reason == pb.FINISH_REASON_EOS
    so = server.server.servicer.structured
    factory = next(e.future.result() for key, e in so._cache.items()
                   if key[0] == "llguidance" and key[2] == schema)
    factory.check_output = lambda text: f"structured_output: forced failure for {text}"
    try:
        c = stub.Generate(r).completions[0]
        assert c.finish_reason == pb.FINISH_REASON_ERROR and c.text in ('"yes"', '"no"')
        assert c.error == f"structured_output: forced failure for {c.text}"
        last = list(stub.GenerateStream(pb.GenerateStreamRequest(request=r)))[-1]
        assert last.finish_reason == pb.FINISH_REASON_ERROR
        assert last.error.startswith("structured_output: forced failure")
    finally:
        factory.check_output = None


def test_a_grammar_and_a_processor_that_leave_no_token_are_invalid_argument(server, stub):
    """``1{4}`` needs token "1" four times and ``no_repeat_window`` bans it after the first:
    the second position has no token left. It used to draw a token nothing allowed from
    that row (the error then blamed the grammar for it), or, sampled in one step with a
    top-p mate, crash the engine loop (the server then answered UNAVAILABLE to everyone)."""
    doomed = req(pb.StructuredOutput(regex="1{4}", backend=XG))
    doomed.processors.append(pb.ProcessorRef(name="no_repeat_window", args_json='{"window": 2}'))
    doomed.sampling.CopyFrom(pb.SamplingParameters(temperature=0.7, seed=1))
    mate = req(pb.StructuredOutput(regex="[a-z]{3,8}"), prompt="Name:", max_new=10)
    mate.sampling.CopyFrom(pb.SamplingParameters(temperature=0.9, top_p=0.8, seed=4))
    batch = stub.GenerateBatch(pb.GenerateBatchRequest(requests=[doomed, mate]))
    bad, good = batch.results
    assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "no token can follow output token 1" in bad.error.message
    assert good.response.completions[0].text == stub.Generate(mate).completions[0].text
    with pytest.raises(grpc.RpcError) as e:
        list(stub.GenerateStream(pb.GenerateStreamRequest(request=doomed)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.fullmatch("[a-z]{3,8}", stub.Generate(mate).completions[0].text)
    assert server.stats.kv_blocks_used == 0
