"""Prometheus metrics: scraped over HTTP and parsed, on the fake engine and a tiny model."""

from __future__ import annotations

import urllib.request
import uuid

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from service.metrics import Metrics
from service.server import GenServer, ServerConfig
from tests.service.conftest import start_server, stop_server, wait_until

Code = grpc.StatusCode


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """Every sample of ``/metrics``: (sample name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)



def req(prompt="Hello world", max_new=6, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, stopping=pb.StoppingCriteria(
        max_new_tokens=max_new, min_new_tokens=max_new), **kw)


@pytest.fixture(scope="module")
def server(make_engine, structured_outputs):
    running, _ = start_server(make_engine(max_waiting=64), structured_outputs=structured_outputs,
                              metrics_port=0)
    assert running.server.metrics_port > 0
    yield running
    stop_server(running)


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerationServiceStub(channel)


def test_metrics_are_off_by_default_and_registries_are_per_server():
    assert ServerConfig().metrics_port is None
    a, b = Metrics(), Metrics()  # no "Duplicated timeseries" from a shared registry
    a.requests.labels("Generate", "OK").inc()
    assert b.registry.get_sample_value(
        "genserve_requests_total", {"rpc": "Generate", "code": "OK"}) == 0
    assert a.registry.get_sample_value(
        "genserve_requests_total", {"rpc": "Generate", "code": "OK"}) == 1


def test_generate_moves_request_token_and_latency_metrics(server, stub):
    port = server.server.metrics_port
    before = scrape(port)
    resp = stub.Generate(req(max_new=6))
    after = scrape(port)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("genserve_requests_total", rpc="Generate", code="OK") == 1
    assert delta("genserve_prompt_tokens_total") == resp.usage.prompt_tokens > 0
    assert delta("genserve_generation_tokens_total") == resp.usage.completion_tokens == 6
    assert delta("genserve_time_to_first_token_seconds_count") == 1
    assert delta("genserve_time_to_first_token_seconds_sum") > 0
    assert delta("genserve_time_per_output_token_seconds_count") == 5  # tokens after the first
    assert delta("genserve_request_duration_seconds_count", rpc="Generate") == 1
    # every RPC is listed before its first call
    for rpc in ("Generate", "GenerateBatch", "GenerateStream", "Tokenize", "GetModelInfo"):
        assert ("genserve_requests_total", frozenset({"rpc": rpc, "code": "OK"}.items())) \
            in after


def test_error_codes_stream_batch_and_small_rpcs(server, stub):
    port = server.server.metrics_port
    before = scrape(port)
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(req(sampling=pb.SamplingParameters(top_p=1.5)))
    assert e.value.code() == Code.INVALID_ARGUMENT
    msgs = list(stub.GenerateStream(pb.GenerateStreamRequest(request=req(max_new=4))))
    assert msgs[-1].usage.completion_tokens == 4
    batch = stub.GenerateBatch(pb.GenerateBatchRequest(requests=[
        req("one", max_new=3), req("two", sampling=pb.SamplingParameters(top_p=2.0)),
        req("three", max_new=2)]))
    assert batch.results[1].error.code == Code.INVALID_ARGUMENT.value[0]
    with pytest.raises(grpc.RpcError):
        stub.GenerateBatch(pb.GenerateBatchRequest())
    stub.Tokenize(pb.TokenizeRequest(text="hello"))
    stub.GetModelInfo(pb.GetModelInfoRequest())
    after = scrape(port)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("genserve_requests_total", rpc="Generate", code="INVALID_ARGUMENT") == 1
    assert delta("genserve_requests_total", rpc="Generate", code="OK") == 0
    assert delta("genserve_requests_total", rpc="GenerateStream", code="OK") == 1
    assert delta("genserve_requests_total", rpc="GenerateBatch", code="OK") == 1
    assert delta("genserve_requests_total", rpc="GenerateBatch", code="INVALID_ARGUMENT") == 1
    assert delta("genserve_batch_items_total", code="OK") == 2
    assert delta("genserve_batch_items_total", code="INVALID_ARGUMENT") == 1
    assert delta("genserve_requests_total", rpc="Tokenize", code="OK") == 1
    assert delta("genserve_requests_total", rpc="GetModelInfo", code="OK") == 1
    assert delta("genserve_generation_tokens_total") == 4 + 3 + 2
    assert delta("genserve_time_to_first_token_seconds_count") == 3  # stream + 2 batch items


def test_deadline_and_cancel_are_counted(server, stub):
    port = server.server.metrics_port
    before = scrape(port)
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(req(max_new=240), timeout=0.3)
    assert e.value.code() == Code.DEADLINE_EXCEEDED
    call = stub.GenerateStream(pb.GenerateStreamRequest(request=req(max_new=240)))
    next(call)
    call.cancel()

    def delta(name, **labels):
        return value(scrape(port), name, **labels) - value(before, name, **labels)

    assert wait_until(lambda: delta("genserve_requests_total", rpc="Generate",
                                  code="DEADLINE_EXCEEDED") == 1)
    assert wait_until(lambda: delta("genserve_requests_total", rpc="GenerateStream",
                                  code="CANCELLED") == 1)
    assert wait_until(lambda: value(scrape(port), "genserve_in_flight_requests") == 0)


def test_engine_gauges_follow_a_running_request(server, stub):
    port = server.server.metrics_port
    idle = scrape(port)
    assert value(idle, "genserve_kv_cache_blocks") > 0
    assert 0 <= value(idle, "genserve_kv_cache_usage_ratio") <= 1
    for name in ("genserve_spec_steps_total", "genserve_spec_proposed_tokens_total",
                 "genserve_spec_accepted_tokens_total", "genserve_spec_emitted_tokens_total",
                 "genserve_spec_acceptance_rate", "genserve_preemptions_total",
                 "genserve_waiting_sequences"):
        assert (name, frozenset()) in idle, name
    future = stub.Generate.future(req(max_new=240))
    try:
        assert wait_until(lambda: value(scrape(port), "genserve_running_sequences") == 1)
        busy = scrape(port)
        assert value(busy, "genserve_kv_cache_usage_ratio") > 0
        assert value(busy, "genserve_kv_cache_blocks_used") > 0
        assert value(busy, "genserve_in_flight_requests") == 1
        # an aborted request from an earlier test leaves the count at once
        assert value(busy, "genserve_engine_requests") == 1
    finally:
        future.cancel()
    assert wait_until(lambda: value(scrape(port), "genserve_running_sequences") == 0)
    assert wait_until(lambda: value(scrape(port), "genserve_kv_cache_blocks_used") == 0)


def test_structured_compile_time_and_cache_hits(server, stub):
    port = server.server.metrics_port
    before = scrape(port)
    # a spec no other test compiled: one miss (and compile), then a hit
    choices = [f"yes-{uuid.uuid4().hex[:6]}", "no"]
    r = req(max_new=16, structured_output=pb.StructuredOutput(
        choice=pb.ChoiceList(choices=choices), backend=pb.STRUCTURED_BACKEND_XGRAMMAR))
    r.stopping.min_new_tokens = 0
    for _ in range(2):
        assert stub.Generate(r).completions[0].text in choices
    after = scrape(port)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("genserve_structured_cache_misses_total", backend="xgrammar") == 1
    assert delta("genserve_structured_cache_hits_total", backend="xgrammar") == 1
    assert delta("genserve_structured_compile_seconds_count", backend="xgrammar") == 1
    assert delta("genserve_structured_compile_seconds_sum", backend="xgrammar") > 0


def test_two_servers_in_one_process_count_separately(make_engine, server, stub):
    other, _ = start_server(make_engine(), structured=None, metrics_port=0)
    try:
        assert other.server.metrics_port not in (0, server.server.metrics_port)
        with grpc.insecure_channel(other.address) as ch:
            pb_grpc.GenerationServiceStub(ch).Tokenize(pb.TokenizeRequest(text="x"))
        mine = value(scrape(server.server.metrics_port), "genserve_requests_total",
                     rpc="Tokenize", code="OK")
        theirs = value(scrape(other.server.metrics_port), "genserve_requests_total",
                       rpc="Tokenize", code="OK")
        assert theirs == 1
        stub.Tokenize(pb.TokenizeRequest(text="x"))
        assert value(scrape(server.server.metrics_port), "genserve_requests_total",
                     rpc="Tokenize", code="OK") == mine + 1
        assert value(scrape(other.server.metrics_port), "genserve_requests_total",
                     rpc="Tokenize", code="OK") == 1
    finally:
        port = other.server.metrics_port
        stop_server(other)
    with pytest.raises(OSError):  # the drain stopped its HTTP server
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_metrics_answer_while_the_model_loads():
    """Before an engine exists: request counters, no engine gauges, and UNAVAILABLE counted."""
    import asyncio

    from tests.service.conftest import new_loop

    loop, thread = new_loop()

    async def make():
        server = GenServer(ServerConfig(host="127.0.0.1", port=0, metrics_port=0,
                                        structured=None))
        server.port = server.server.add_insecure_port("127.0.0.1:0")
        await server.server.start()
        server.metrics_port = server.metrics.serve("127.0.0.1", 0)
        return server

    server = asyncio.run_coroutine_threadsafe(make(), loop).result(10)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch, \
                pytest.raises(grpc.RpcError) as e:
            pb_grpc.GenerationServiceStub(ch).Generate(req())
        assert e.value.code() == Code.UNAVAILABLE
        # the client can see the status a moment before the server's call bookkeeping ends
        assert wait_until(lambda: value(scrape(server.metrics_port), "genserve_requests_total",
                                      rpc="Generate", code="UNAVAILABLE") == 1)
        samples = scrape(server.metrics_port)
        assert ("genserve_running_sequences", frozenset()) not in samples
        assert value(samples, "genserve_in_flight_requests") == 0
    finally:
        asyncio.run_coroutine_threadsafe(server.drain(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_scrape_output_is_valid_exposition_text(server):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics") as r:
        text = r.read().decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"genserve_requests", "genserve_time_to_first_token_seconds",
            "genserve_kv_cache_usage_ratio", "genserve_spec_acceptance_rate"} <= names


def _types(port: int) -> dict[str, str]:
    """Family name -> type (a counter's bare-named twin, untyped, does not count)."""
    return {name: "counter" if "counter" in kinds else kinds.pop()
            for name, kinds in all_types(port).items()}


def all_types(port: int) -> dict[str, set[str]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, set[str]] = {}
    for f in text_string_to_metric_families(text):
        out.setdefault(f.name, set()).add(f.type)
    return out


# vLLM's core serving metrics under our prefix (README "Metrics": the mapping)
VLLM_SHAPED = {
    "genserve_num_requests_running": "gauge", "genserve_num_requests_waiting": "gauge",
    "genserve_request_success": "counter",
    "genserve_e2e_request_latency_seconds": "histogram",
    "genserve_request_queue_time_seconds": "histogram",
    "genserve_request_prefill_time_seconds": "histogram",
    "genserve_request_decode_time_seconds": "histogram",
    "genserve_request_inference_time_seconds": "histogram",
    "genserve_request_prompt_tokens": "histogram",
    "genserve_request_generation_tokens": "histogram",
    "genserve_iteration_tokens": "histogram",
    "genserve_time_to_first_token_seconds": "histogram",
    "genserve_time_per_output_token_seconds": "histogram",
    "genserve_kv_cache_usage_ratio": "gauge", "genserve_preemptions": "counter",
    "genserve_prompt_tokens": "counter", "genserve_generation_tokens": "counter",
}
GRPC = {"grpc_server_started": "counter", "grpc_server_handled": "counter",
        "grpc_server_handling_seconds": "histogram", "grpc_server_msg_received": "counter",
        "grpc_server_msg_sent": "counter"}
PROCESS = {"process_cpu_seconds": "counter", "process_resident_memory_bytes": "gauge",
           "python_gc_collections": "counter", "python_info": "gauge"}


def test_standard_metric_names_and_types(server, stub):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub.Generate(req())
    with grpc.insecure_channel(server.address) as ch:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
    types = _types(server.server.metrics_port)
    for name, kind in {**VLLM_SHAPED, **GRPC, **PROCESS}.items():
        assert types.get(name) == kind, (name, types.get(name))


def test_request_level_metrics_follow_a_generate(server, stub, engine_kind):
    port = server.server.metrics_port
    model = server.server.metrics.model_name
    assert model == server.server.engine.info.model_id
    before = scrape(port)
    stub.Generate(req(max_new=5))
    stub.Generate(req(max_new=3))
    after = scrape(port)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("genserve_request_success_total", model_name=model,
                 finished_reason="length") == 2
    assert delta("genserve_request_generation_tokens_count", model_name=model) == 2
    assert delta("genserve_request_generation_tokens_sum", model_name=model) == 8
    assert delta("genserve_request_prompt_tokens_count", model_name=model) == 2
    if engine_kind == "real":  # the fake engine reports no stage times or steps
        for stage in ("e2e_request_latency", "request_queue_time", "request_prefill_time",
                      "request_decode_time", "request_inference_time"):
            assert delta(f"genserve_{stage}_seconds_count", model_name=model) == 2, stage
        assert delta("genserve_iteration_tokens_count", model_name=model) >= 8
        assert delta("genserve_iteration_tokens_sum", model_name=model) >= 8


def test_grpc_metrics_count_every_service_and_code(server, stub):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = server.server.metrics_port
    before = scrape(port)
    stub.Generate(req())
    with pytest.raises(grpc.RpcError):
        stub.Generate(pb.GenerateRequest(prompt=""))
    # a client behind the engine gets several steps' tokens in one message, so the count
    # of messages is what this client received, not the 3 tokens
    received = len(list(stub.GenerateStream(pb.GenerateStreamRequest(request=req(max_new=3)))))
    with grpc.insecure_channel(server.address) as ch:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
    after = scrape(port)
    svc = "genserve.v1.GenerationService"

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    unary = dict(grpc_type="unary", grpc_service=svc, grpc_method="Generate")
    assert delta("grpc_server_started_total", **unary) == 2
    assert delta("grpc_server_handled_total", **unary, grpc_code="OK") == 1
    assert delta("grpc_server_handled_total", **unary, grpc_code="INVALID_ARGUMENT") == 1
    assert delta("grpc_server_handling_seconds_count", **unary) == 2
    stream = dict(grpc_type="server_stream", grpc_service=svc, grpc_method="GenerateStream")
    assert delta("grpc_server_handled_total", **stream, grpc_code="OK") == 1
    assert received >= 1 and delta("grpc_server_msg_sent_total", **stream) == received
    health = dict(grpc_type="unary", grpc_service="grpc.health.v1.Health",
                  grpc_method="Check")
    assert delta("grpc_server_handled_total", **health, grpc_code="OK") == 1


def test_grafana_dashboard_queries_metrics_the_server_exports(server, stub):
    """deploy/grafana-dashboard.json: every metric its queries name is scraped from a live
    server (a renamed metric would leave a panel empty)."""
    import json
    import re
    from pathlib import Path

    stub.Generate(req())
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "deploy" /
                            "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(dashboard["templating"]["list"][1]["query"])
    names = {m for e in exprs for m in re.findall(
        r"\b((?:genserve|grpc_server|process|python)_[a-z_]+)\b", e)}
    assert len(names) >= 18
    families = set(_types(server.server.metrics_port))
    for name in names:
        base = re.sub(r"_(bucket|total|sum|count)$", "", name)
        assert base in families, name


# TGIS's metric names and types (IBM text-generation-inference's router), served beside ours
TGIS = {"tgi_request_count": "counter", "tgi_request_input_count": "counter",
        "tgi_request_success": "counter", "tgi_request_failure": "counter",
        "tgi_request_input_length": "histogram", "tgi_request_max_new_tokens": "histogram",
        "tgi_request_generated_tokens": "histogram", "tgi_request_total_tokens": "histogram",
        "tgi_request_duration": "histogram", "tgi_request_queue_duration": "histogram",
        "tgi_request_inference_duration": "histogram",
        "tgi_request_mean_time_per_token_duration": "histogram",
        "tgi_queue_size": "gauge", "tgi_batch_current_size": "gauge",
        "tgi_batch_inference_duration": "histogram"}


def test_tgis_metric_names_count_calls_inputs_tokens_and_failures(server, stub, engine_kind):
    from fmaas import generation_pb2 as tgis
    from fmaas import generation_pb2_grpc as tgis_grpc

    port = server.server.metrics_port
    before = scrape(port)
    single = stub.Generate(req("Hello world", max_new=6))
    batch = stub.GenerateBatch(pb.GenerateBatchRequest(requests=[
        req("one", max_new=3), req("two", sampling=pb.SamplingParameters(top_p=2.0)),
        req("three", max_new=2)]))
    streamed = list(stub.GenerateStream(pb.GenerateStreamRequest(request=req(max_new=4))))
    with pytest.raises(grpc.RpcError):
        stub.Generate(pb.GenerateRequest(prompt=""))
    with grpc.insecure_channel(server.address) as ch:
        tgis_grpc.GenerationServiceStub(ch).Generate(tgis.BatchedGenerationRequest(
            requests=[tgis.GenerationRequest(text="a b"), tgis.GenerationRequest(text="c")],
            params=tgis.Parameters(stopping=tgis.StoppingCriteria(
                max_new_tokens=2, min_new_tokens=2))), timeout=60)
    after = scrape(port)
    types = _types(port)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    for name, kind in TGIS.items():
        assert types.get(name) == kind, (name, types.get(name))
    # TGIS writes each counter twice, bare and with _total: dashboards query either
    for name in ("tgi_request_count", "tgi_request_input_count", "tgi_request_success",
                 "tgi_request_failure"):
        assert all_types(port)[name] == {"counter", "unknown"}, name
    assert value(after, "tgi_request_count", kind="single") == value(
        after, "tgi_request_count_total", kind="single") > 0
    assert value(after, "tgi_request_failure", err="validation") == value(
        after, "tgi_request_failure_total", err="validation") > 0
    assert delta("tgi_request_count_total", kind="single") == 2  # the invalid one too
    assert delta("tgi_request_count_total", kind="batch") == 2  # ours and TGIS's
    assert delta("tgi_request_count_total", kind="stream") == 1
    assert delta("tgi_request_input_count_total") == 1 + 3 + 1 + 1 + 2
    assert delta("tgi_request_failure_total", err="validation") == 2  # batch item + empty
    # every answered request ran to its max_new_tokens (min_new_tokens = max_new_tokens)
    assert delta("tgi_request_success_total", stop_reason="MAX_TOKENS") == 6
    generated = 6 + 3 + 2 + 4 + 2 + 2
    assert delta("tgi_request_generated_tokens_count") == 6
    assert delta("tgi_request_generated_tokens_sum") == generated
    assert delta("tgi_request_max_new_tokens_sum") == generated
    prompts = (single.usage.prompt_tokens + streamed[-1].usage.prompt_tokens
               + sum(r.response.usage.prompt_tokens for r in batch.results
                     if r.HasField("response")))
    assert delta("tgi_request_input_length_sum") > prompts  # + the two TGIS prompts
    assert delta("tgi_request_total_tokens_sum") == (
        delta("tgi_request_input_length_sum") + generated)
    assert delta("tgi_request_duration_count") == 5
    assert delta("tgi_request_duration_sum") > 0
    assert value(after, "tgi_queue_size") == 0 and value(after, "tgi_batch_current_size") == 0
    if engine_kind == "real":  # the fake engine reports no stage times
        for name in ("queue", "inference", "mean_time_per_token"):
            assert delta(f"tgi_request_{name}_duration_count") == 6, name
        inference = delta("tgi_request_inference_duration_sum")
        assert inference > 0
        per_token = delta("tgi_request_mean_time_per_token_duration_sum")
        assert 0 < per_token < inference
        for method in ("prefill", "next_token"):  # every engine step, by what it computed
            assert delta("tgi_batch_inference_duration_count", method=method) > 0, method
            assert delta("tgi_batch_inference_duration_sum", method=method) > 0, method
