"""OpenTelemetry tracing: one ``llm_request`` span per engine request, continuing the
caller's ``traceparent``, on the real engine over a tiny model (the fake engine reports
no stage times)."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from fmaas import generation_pb2 as tgis
from fmaas import generation_pb2_grpc as tgis_grpc
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from service import tracing
from service.server import ServerConfig
from service.tracing import RequestTracer
from tests.service.conftest import start_server, stop_server

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"


@pytest.fixture(scope="module")
def engine_kind() -> str:
    return "real"


@pytest.fixture(scope="module")
def traced(make_engine):
    """A server whose tracer records into memory instead of exporting over OTLP."""
    running, _ = start_server(make_engine(max_waiting=64), structured=None)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    running.server.servicer.tracer = RequestTracer(provider)
    yield running, exporter
    stop_server(running)


@pytest.fixture
def spans(traced):
    _, exporter = traced
    exporter.clear()
    return exporter


@pytest.fixture
def stub(traced):
    with grpc.insecure_channel(traced[0].address) as channel:
        yield pb_grpc.GenerationServiceStub(channel)


def req(prompt="Hello world", max_new=6, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, stopping=pb.StoppingCriteria(
        max_new_tokens=max_new, min_new_tokens=max_new), **kw)


def test_generate_span_continues_the_callers_traceparent(stub, spans):
    start = time.time_ns()
    resp = stub.Generate(req(max_new=6, sampling=pb.SamplingParameters(temperature=0.7,
                                                                        top_p=0.9, seed=1)),
                         metadata=[("traceparent", TRACEPARENT)])
    end = time.time_ns()
    (span,) = spans.get_finished_spans()
    assert span.name == "llm_request" and span.kind is SpanKind.SERVER
    assert span.context.trace_id == TRACE_ID
    assert span.parent is not None and span.parent.span_id == PARENT_ID
    assert span.parent.is_remote
    a = span.attributes
    assert a[tracing.REQUEST_ID] == resp.request_id
    assert a[tracing.USAGE_PROMPT_TOKENS] == resp.usage.prompt_tokens > 0
    assert a[tracing.USAGE_COMPLETION_TOKENS] == resp.usage.completion_tokens == 6
    assert a[tracing.REQUEST_MAX_TOKENS] == 6 and a[tracing.REQUEST_N] == 1
    assert a[tracing.RESPONSE_FINISH_REASONS] == ("length",)
    assert a[tracing.REQUEST_TEMPERATURE] == pytest.approx(0.7)
    assert a[tracing.REQUEST_TOP_P] == pytest.approx(0.9)
    e2e = a[tracing.LATENCY_E2E]
    assert 0 <= a[tracing.LATENCY_TIME_IN_QUEUE] < a[tracing.LATENCY_TIME_TO_FIRST_TOKEN] < e2e
    assert a[tracing.LATENCY_PREFILL] > 0 and a[tracing.LATENCY_DECODE] > 0
    assert a[tracing.LATENCY_PREFILL] + a[tracing.LATENCY_DECODE] == pytest.approx(
        a[tracing.LATENCY_INFERENCE])
    # the span covers the request's time in the engine, within the call
    assert start - 5_000_000 <= span.start_time < span.end_time <= end + 5_000_000
    assert (span.end_time - span.start_time) / 1e9 == pytest.approx(e2e, abs=2e-3)


def test_each_batch_item_stream_and_tgis_input_gets_its_own_span(stub, spans, traced):
    batch = stub.GenerateBatch(pb.GenerateBatchRequest(requests=[
        req("one", max_new=3), req("two", sampling=pb.SamplingParameters(top_p=2.0)),
        req("three", max_new=2)]), metadata=[("traceparent", TRACEPARENT)])
    list(stub.GenerateStream(pb.GenerateStreamRequest(request=req(max_new=4)),
                             metadata=[("traceparent", TRACEPARENT)]))
    with grpc.insecure_channel(traced[0].address) as ch:
        tgis_grpc.GenerationServiceStub(ch).Generate(tgis.BatchedGenerationRequest(
            requests=[tgis.GenerationRequest(text="a b")],
            params=tgis.Parameters(stopping=tgis.StoppingCriteria(
                max_new_tokens=5, min_new_tokens=5))), metadata=[("traceparent", TRACEPARENT)])
    got = spans.get_finished_spans()
    # the invalid batch item never reached the engine: no span
    assert sorted(s.attributes[tracing.USAGE_COMPLETION_TOKENS] for s in got) == [2, 3, 4, 5]
    assert {s.context.trace_id for s in got} == {TRACE_ID}
    assert {s.attributes[tracing.RESPONSE_FINISH_REASONS] for s in got} == {("length",)}
    assert {s.parent.span_id for s in got} == {PARENT_ID}
    assert len({s.context.span_id for s in got}) == 4
    ids = {s.attributes[tracing.REQUEST_ID] for s in got}
    assert {r.response.request_id for r in batch.results if r.HasField("response")} <= ids


def test_a_call_without_traceparent_starts_a_new_trace(stub, spans):
    stub.Generate(req(max_new=2))
    stub.Generate(req(max_new=2), metadata=[("traceparent", "00-garbage-01")])
    got = spans.get_finished_spans()
    assert len(got) == 2
    assert all(s.parent is None and s.context.trace_id != TRACE_ID for s in got)


def test_without_an_endpoint_nothing_is_traced(make_engine, monkeypatch):
    recorded = []
    monkeypatch.setattr(RequestTracer, "record", lambda *a: recorded.append(a))
    assert ServerConfig().otlp_traces_endpoint is None
    running, _ = start_server(make_engine(max_waiting=64), structured=None)
    try:
        assert running.server.servicer.tracer is None
        with grpc.insecure_channel(running.address) as ch:
            pb_grpc.GenerationServiceStub(ch).Generate(
                req(max_new=2), metadata=[("traceparent", TRACEPARENT)])
    finally:
        stop_server(running)
    assert recorded == []


class Collector(otlp_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps what it is sent."""

    def __init__(self) -> None:
        self.requests: list[otlp.ExportTraceServiceRequest] = []
        self.got = threading.Event()

    def Export(self, request, context):
        self.requests.append(request)
        self.got.set()
        return otlp.ExportTraceServiceResponse()


def test_otlp_endpoint_exports_the_span_to_a_collector(make_engine):
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    otlp_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        running, _ = start_server(make_engine(max_waiting=64), structured=None,
                                  otlp_traces_endpoint=f"http://127.0.0.1:{port}")
        try:
            with grpc.insecure_channel(running.address) as ch:
                resp = pb_grpc.GenerationServiceStub(ch).Generate(
                    req(max_new=3), metadata=[("traceparent", TRACEPARENT)])
        finally:
            stop_server(running)  # the drain flushes the batched spans
        assert collector.got.wait(10)
    finally:
        server.stop(0)
    spans = [s for r in collector.requests for rs in r.resource_spans
             for ss in rs.scope_spans for s in ss.spans]
    (span,) = [s for s in spans if s.name == "llm_request"]
    assert span.trace_id == TRACE_ID.to_bytes(16, "big")
    assert span.parent_span_id == PARENT_ID.to_bytes(8, "big")
    attrs = {a.key: a.value for a in span.attributes}
    assert attrs[tracing.REQUEST_ID].string_value == resp.request_id
    assert attrs[tracing.USAGE_COMPLETION_TOKENS].int_value == 3
    resource = {a.key: a.value.string_value
                for r in collector.requests for rs in r.resource_spans
                for a in rs.resource.attributes}
    assert resource["service.name"] == "genserve"


def test_an_unreachable_collector_fails_no_request_and_holds_the_drain_briefly(make_engine):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    running, _ = start_server(make_engine(max_waiting=64), structured=None,
                              otlp_traces_endpoint=f"http://127.0.0.1:{dead}")
    try:
        with grpc.insecure_channel(running.address) as ch:
            for _ in range(2):
                resp = pb_grpc.GenerationServiceStub(ch).Generate(
                    req(max_new=2), metadata=[("traceparent", TRACEPARENT)])
                assert resp.usage.completion_tokens == 2
    finally:
        start = time.monotonic()
        stop_server(running)
        # the exporter would retry for ~10 s; the drain gives the flush 3 s
        assert time.monotonic() - start < 6
