"""A grammar backend's own limits through both APIs: a spec past them is served (its
output valid) or refused with INVALID_ARGUMENT naming the limit, never INTERNAL, never
stopped with ERROR after a token; the TGIS service answers with the native code."""

from __future__ import annotations

import json
import re

import grpc
import pytest

from engine.config import EngineConfig
from fmaas import generation_pb2 as tgis
from fmaas import generation_pb2_grpc as tgis_grpc
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from service.validation import MAX_JSON_DEPTH
from structured.manager import StructuredConfig
from tests.service.conftest import start_server, stop_server
from tests.structured.test_backend_limits import LIMIT, SIZES, options

BACKENDS = {"auto": pb.STRUCTURED_BACKEND_UNSPECIFIED,
            "llguidance": pb.STRUCTURED_BACKEND_LLGUIDANCE,
            "xgrammar": pb.STRUCTURED_BACKEND_XGRAMMAR,
            "lm-format-enforcer": pb.STRUCTURED_BACKEND_LM_FORMAT_ENFORCER}
MAX_NEW = 12


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    running, thread = start_server(
        EngineConfig(model=str(tiny_model_dir), max_model_len=256),
        structured=StructuredConfig(compile_timeout_s=4.0, compile_max_rss_mb=1536,
                                    max_spec_bytes=1 << 20))
    yield running
    stop_server(running, thread)


@pytest.fixture(scope="module")
def stubs(server):
    with grpc.insecure_channel(server.address) as ch:
        yield pb_grpc.GenerationServiceStub(ch), tgis_grpc.GenerationServiceStub(ch)


def spec_fields(kind: str, n: int) -> dict:
    if kind == "choice":
        return {"choice": list(options(n))}
    if kind == "grammar":
        return {"grammar": "root ::= " + " | ".join(map(json.dumps, options(n)))}
    return {"regex": "a{1000000}"}


def native_code(stub, kind: str, n: int, backend: int) -> grpc.StatusCode:
    fields = spec_fields(kind, n)
    if kind == "choice":
        fields["choice"] = pb.ChoiceList(choices=fields["choice"])
    req = pb.GenerateRequest(prompt="Pick one:", structured_output=pb.StructuredOutput(
        backend=backend, **fields), stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW))
    try:
        c = stub.Generate(req, timeout=120).completions[0]
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        assert LIMIT.search(e.details()) and "structured_output" in e.details(), e.details()
        return e.code()
    assert_valid(kind, n, c.text, c.finish_reason == pb.FINISH_REASON_EOS,
                 c.finish_reason == pb.FINISH_REASON_LENGTH)
    return grpc.StatusCode.OK


def tgis_code(fm, kind: str, n: int) -> grpc.StatusCode:
    fields = spec_fields(kind, n)
    if kind == "choice":
        fields["choice"] = tgis.DecodingParameters.StringChoices(choices=fields["choice"])
    params = tgis.Parameters(decoding=tgis.DecodingParameters(**fields),
                             stopping=tgis.StoppingCriteria(max_new_tokens=MAX_NEW))
    try:
        (r,) = fm.Generate(tgis.BatchedGenerationRequest(
            requests=[tgis.GenerationRequest(text="Pick one:")], params=params),
            timeout=120).responses
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        assert LIMIT.search(e.details()), e.details()
        return e.code()
    assert_valid(kind, n, r.text, r.stop_reason == tgis.EOS_TOKEN,
                 r.stop_reason == tgis.MAX_TOKENS)
    return grpc.StatusCode.OK


def assert_valid(kind: str, n: int, text: str, ended: bool, at_length: bool) -> None:
    if kind == "regex":
        assert at_length and re.fullmatch("a+", text), text
    else:
        assert ended and text in set(options(n)), text


@pytest.mark.parametrize("kind, n", [("choice", n) for n in SIZES]
                         + [("grammar", n) for n in SIZES] + [("regex", 0)])
def test_backend_limits_answer_the_same_through_both_services(stubs, kind, n):
    native, fm = stubs
    codes = {name: native_code(native, kind, n, b) for name, b in BACKENDS.items()}
    if kind != "grammar":  # AUTO serves these at once (xgrammar's time bounds a grammar)
        assert codes["auto"] == grpc.StatusCode.OK
    assert tgis_code(fm, kind, n) == codes["auto"]
    assert native_code(native, kind, n, BACKENDS["auto"]) == codes["auto"]  # and again


@pytest.mark.parametrize("choices", [["日本"], ["🙂"], ["\u0301"], ["e\u0301"]])
def test_lm_format_enforcer_refuses_text_it_cannot_write(stubs, choices):
    native, _ = stubs
    req = pb.GenerateRequest(prompt="x", structured_output=pb.StructuredOutput(
        choice=pb.ChoiceList(choices=choices), backend=BACKENDS["lm-format-enforcer"]),
        stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW))
    with pytest.raises(grpc.RpcError) as e:
        native.Generate(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot write" in e.value.details()
    req.structured_output.backend = BACKENDS["auto"]  # the other backends write it
    c = native.Generate(req, timeout=60).completions[0]
    assert c.text in choices and c.finish_reason == pb.FINISH_REASON_EOS


def nested_schema(levels: int) -> str:
    schema: dict = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return json.dumps(schema)


def test_json_schema_depth_limit_is_the_same_through_both_services(stubs):
    native, fm = stubs
    deep = nested_schema(MAX_JSON_DEPTH + 1)
    with pytest.raises(grpc.RpcError) as e:
        native.Generate(pb.GenerateRequest(prompt="x", structured_output=pb.StructuredOutput(
            json_schema=deep)), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_output.json_schema is nested deeper than 64" in e.value.details()
    params = tgis.Parameters(decoding=tgis.DecodingParameters(json_schema=deep))
    with pytest.raises(grpc.RpcError) as e:
        fm.Generate(tgis.BatchedGenerationRequest(
            requests=[tgis.GenerationRequest(text="x")], params=params), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("json_schema is nested deeper than 64")
    params = tgis.Parameters(decoding=tgis.DecodingParameters(
        json_schema=nested_schema(MAX_JSON_DEPTH)), stopping=tgis.StoppingCriteria(
        max_new_tokens=4))
    fm.Generate(tgis.BatchedGenerationRequest(  # 64 levels: within the limit
        requests=[tgis.GenerationRequest(text="x")], params=params), timeout=60)
