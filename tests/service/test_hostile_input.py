"""Requests built to hurt the server: over-deep JSON, huge prompts, oversized processor
arguments, absurd temperatures. Each is refused up front (INVALID_ARGUMENT naming what is
wrong) or served correctly, and the server keeps answering everyone else meanwhile."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.config import EngineConfig
from fmaas import generation_pb2 as tgis
from fmaas import generation_pb2_grpc as tgis_grpc
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from service.validation import ServiceLimits, json_depth
from tests.service.conftest import start_server, stop_server
from tests.service.fake_engine import FakeEngine

Code = grpc.StatusCode
HUGE = "word " * 4_000_000  # 20 MB


@pytest.fixture(scope="module")
def server(tiny_model_dir, tokenizer, structured_outputs):
    engine = FakeEngine(tokenizer, EngineConfig(model=str(tiny_model_dir)))
    running, _ = start_server(engine, ServiceLimits(max_input_chars=2_000_000),
                              structured_outputs=structured_outputs)
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address, options=[
            ("grpc.max_send_message_length", 64 * 2**20)]) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.GenerationServiceStub(channel)


def _refused(call, *needles: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == Code.INVALID_ARGUMENT, e.value.details()
    for needle in needles:
        assert needle in e.value.details()


def test_json_depth_ignores_brackets_in_strings():
    assert json_depth('{"a": [1, {"b": "[[[{{{"}]}') == 3
    assert json_depth('"\\\\"') == 0 and json_depth('["\\"]"]') == 1


def test_over_deep_processor_args_are_refused(stub):
    deep = '{"phrases": ' + "[" * 3000 + "]" * 3000 + "}"
    _refused(lambda: stub.Generate(pb.GenerateRequest(prompt="hi", processors=[
        pb.ProcessorRef(name="banned_phrases", args_json=deep)]), timeout=10),
        "processors[0].args_json is nested deeper than 64")


def test_over_deep_schema_is_refused(stub):
    schema = '{"type": "object", "properties": {"a": ' * 500 + "{}" + "}}" * 500
    _refused(lambda: stub.Generate(pb.GenerateRequest(
        prompt="hi", structured_output=pb.StructuredOutput(json_schema=schema)), timeout=10),
        "structured_output.json_schema is nested deeper")


def test_processor_list_and_phrase_sizes_are_bounded(stub):
    refs = [pb.ProcessorRef(name="no_repeat_window", args_json='{"window": 2}')] * 17
    _refused(lambda: stub.Generate(pb.GenerateRequest(prompt="hi", processors=refs),
                                   timeout=10), "processors has 17 entries")
    long = json.dumps({"phrases": ["x" * 10_000] * 256})
    _refused(lambda: stub.Generate(pb.GenerateRequest(prompt="hi", processors=[
        pb.ProcessorRef(name="banned_phrases", args_json=long)]), timeout=10),
        "longer than 65536")
    one = json.dumps({"phrases": ["x" * 300]})
    _refused(lambda: stub.Generate(pb.GenerateRequest(prompt="hi", processors=[
        pb.ProcessorRef(name="banned_phrases", args_json=one)]), timeout=10),
        "at most 256 characters")


def test_huge_prompts_and_texts_are_refused_at_once(channel, stub):
    fm = tgis_grpc.GenerationServiceStub(channel)
    calls = [
        (lambda: stub.Generate(pb.GenerateRequest(prompt=HUGE), timeout=10), "prompt has"),
        (lambda: stub.Tokenize(pb.TokenizeRequest(text=HUGE), timeout=10), "text has"),
        (lambda: stub.Generate(pb.GenerateRequest(chat=pb.ChatMessages(messages=[
            pb.ChatMessage(role="user", content=HUGE)])), timeout=10), "chat.messages has"),
        (lambda: fm.Generate(tgis.BatchedGenerationRequest(
            requests=[tgis.GenerationRequest(text=HUGE)]), timeout=10), "text has"),
        (lambda: fm.Tokenize(tgis.BatchedTokenizeRequest(
            requests=[tgis.TokenizeRequest(text=HUGE)]), timeout=10), "requests[0].text has"),
    ]
    for call, needle in calls:
        start = time.perf_counter()
        _refused(call, needle, "--max-input-chars")
        assert time.perf_counter() - start < 5  # refused before tokenising


def test_a_big_allowed_prompt_does_not_stall_health(channel, stub):
    big = "word " * 380_000  # 1.9 MB: tokenised (off the event loop), then truncated
    health = health_pb2_grpc.HealthStub(channel)
    result: dict = {}

    def generate():
        result["resp"] = stub.Generate(pb.GenerateRequest(
            prompt=big, truncate_input_tokens=16, stopping=pb.StoppingCriteria(
                max_new_tokens=2)), timeout=60)

    worker = threading.Thread(target=generate)
    worker.start()
    latencies = []
    while worker.is_alive():
        start = time.perf_counter()
        health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        latencies.append(time.perf_counter() - start)
        time.sleep(0.01)
    worker.join()
    assert result["resp"].usage.prompt_tokens == 16
    assert latencies and max(latencies) < 1.0


def test_denormal_temperature_is_greedy(stub):
    greedy = stub.Generate(pb.GenerateRequest(prompt="Once upon", stopping=pb.StoppingCriteria(
        max_new_tokens=6)), timeout=10)
    tiny = stub.Generate(pb.GenerateRequest(
        prompt="Once upon", sampling=pb.SamplingParameters(temperature=1e-40),
        stopping=pb.StoppingCriteria(max_new_tokens=6)), timeout=10)
    assert tiny.completions[0].text == greedy.completions[0].text
    assert not tiny.HasField("seed")
