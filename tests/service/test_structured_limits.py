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
from structured.processor import GrammarFactory
from tests.service.conftest import start_server, stop_server
from tests.structured.test_backend_limits import LIMIT, SIZES, options, warm_workers

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
                                    max_spec_bytes=1 << 20, compile_workers=2))
    warm_workers(running.server.servicer.structured)
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


# Which backend serves which size is tests/structured/test_backend_limits.py's; here the
# sizes whose answers differ per backend: 2,000 (llguidance refuses a grammar, the rest
# serve) and 50,000 (compile time limits refuse, AUTO's too for a grammar).
SERVICE_SIZES = tuple(n for n in SIZES if n >= 2000)


@pytest.mark.parametrize("kind, n", [("choice", n) for n in SERVICE_SIZES]
                         + [("grammar", n) for n in SERVICE_SIZES] + [("regex", 0)])
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


ROW_LIMIT = "Parser Error: Current row has 2001 items; max is 2000"


class LimitMidOutput:
    """A real grammar that meets llguidance's row limit once it has accepted ``after``
    tokens: what a limit the build's probe did not reach looks like."""

    def __init__(self, inner, after: int) -> None:
        self.inner, self.after, self.accepted = inner, after, 0

    def accept_tokens(self, ids) -> bool:
        ok = self.inner.accept_tokens(ids)
        self.accepted += len(ids) if ok else 0
        return ok

    def rollback(self, n: int) -> None:
        self.inner.rollback(n)
        self.accepted -= n

    def fill_bitmask(self, bitmask, row: int) -> None:
        if self.accepted >= self.after:
            raise RuntimeError(ROW_LIMIT)
        self.inner.fill_bitmask(bitmask, row)

    def validate_tokens(self, ids) -> int:
        return self.inner.validate_tokens(ids)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def reset(self) -> None:
        self.inner.reset()
        self.accepted = 0


@pytest.fixture
def limit_mid_output(monkeypatch):
    """Every grammar made while the test runs fails after 3 output tokens (a digit is a
    token: `[0-9]{8}` needs 8)."""
    create, release = GrammarFactory.create, GrammarFactory.release

    def failing_create(self):
        proc = create(self)
        proc.grammar = LimitMidOutput(proc.grammar, 3)
        return proc

    def unwrapping_release(self, proc):
        proc.grammar = proc.grammar.inner  # only real grammars go back to the pool
        release(self, proc)

    monkeypatch.setattr(GrammarFactory, "create", failing_create)
    monkeypatch.setattr(GrammarFactory, "release", unwrapping_release)


def test_a_limit_met_mid_output_is_invalid_argument_through_both_services(
        stubs, limit_mid_output):
    """Issue 27: a backend limit or error state that appears only after tokens were sent is
    the request's fault (INVALID_ARGUMENT naming the field and the limit), never INTERNAL;
    a stream gets its tokens, an ERROR finish with the reason, then that status."""
    native, fm = stubs
    req = pb.GenerateRequest(prompt="x", structured_output=pb.StructuredOutput(
        regex="[0-9]{8}"), stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW))
    with pytest.raises(grpc.RpcError) as e:
        native.Generate(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.fullmatch(r"structured_output\.regex: \S+ could not go on after 3 output "
                        r"tokens: " + re.escape(ROW_LIMIT), e.value.details()), e.value.details()
    (item,) = native.GenerateBatch(pb.GenerateBatchRequest(requests=[req]), timeout=60).results
    assert item.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert item.error.message == e.value.details()

    msgs = []
    with pytest.raises(grpc.RpcError) as e:
        for m in native.GenerateStream(pb.GenerateStreamRequest(request=req), timeout=60):
            msgs.append(m)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sum(len(m.token_ids) for m in msgs) == 3
    assert msgs[-1].finish_reason == pb.FINISH_REASON_ERROR and ROW_LIMIT in msgs[-1].error

    params = tgis.Parameters(decoding=tgis.DecodingParameters(regex="[0-9]{8}"),
                             stopping=tgis.StoppingCriteria(max_new_tokens=MAX_NEW))
    tgis_req = tgis.BatchedGenerationRequest(requests=[tgis.GenerationRequest(text="x")],
                                             params=params)
    with pytest.raises(grpc.RpcError) as e:
        fm.Generate(tgis_req, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("regex: ") and ROW_LIMIT in e.value.details()
    stream = []
    with pytest.raises(grpc.RpcError) as e:
        for m in fm.GenerateStream(tgis.SingleGenerationRequest(
                request=tgis.GenerationRequest(text="x"), params=params), timeout=60):
            stream.append(m)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stream[-1].stop_reason == tgis.ERROR and stream[-1].generated_token_count == 3
