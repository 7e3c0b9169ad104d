"""A full waiting queue refuses at once (RESOURCE_EXHAUSTED), whatever the refused call
would have cost to parse: the bound is checked before tokenizing or compiling anything,
on the event loop, while the engine thread keeps decoding the requests that fill it."""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import threading
import time

import grpc
import pytest

from engine.config import EngineConfig
from fmaas import generation_pb2 as tgis
from fmaas import generation_pb2_grpc as tgis_grpc
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from service.limits import ServiceLimits
from tests.service.conftest import start_server, stop_server, wait_until

Code = grpc.StatusCode
REFUSAL_BOUND_S = 0.050  # issue 27: a full queue answers within 50 ms
SEATS, WAITING = 4, 2
CONTEXT = 16384


def _long() -> pb.GenerateRequest:
    """Occupies a seat (or a queue slot) for far longer than the test runs."""
    return pb.GenerateRequest(prompt="Tell me a long story", stopping=pb.StoppingCriteria(
        max_new_tokens=CONTEXT - 100, min_new_tokens=CONTEXT - 100))



def _read_until_cancelled(stream) -> None:
    with contextlib.suppress(grpc.RpcError):
        for _ in stream:
            pass


@pytest.fixture(scope="module")
def long_context_model(tiny_model_dir, tmp_path_factory):
    """The tiny model with a context long enough that its requests outlast the module."""
    d = tmp_path_factory.mktemp("long_context") / "model"
    shutil.copytree(tiny_model_dir, d)
    config = json.loads((d / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def full_server(long_context_model, structured_outputs):
    """A real engine whose seats and waiting queue are taken by streams it keeps decoding
    (read by the client as they come, as a real client would)."""
    running, _ = start_server(
        EngineConfig(model=str(long_context_model), max_model_len=CONTEXT, max_num_seqs=SEATS,
                     max_waiting=WAITING),
        ServiceLimits(max_new_tokens=CONTEXT), structured_outputs=structured_outputs)
    channel = grpc.insecure_channel(running.address)
    stub = pb_grpc.GenerationServiceStub(channel)
    streams = [stub.GenerateStream(pb.GenerateStreamRequest(request=_long()))
               for _ in range(SEATS + WAITING)]
    readers = [threading.Thread(target=_read_until_cancelled, args=(s,), daemon=True)
               for s in streams]
    for r in readers:
        r.start()
    assert wait_until(lambda: running.stats.num_requests_running == SEATS
                       and running.stats.num_requests_waiting == WAITING, 30), running.stats
    yield running, channel
    for s in streams:
        s.cancel()
    channel.close()
    stop_server(running)


def _refusal_times(call, attempts: int = 9) -> list[float]:
    times = []
    for _ in range(attempts):
        start = time.perf_counter()
        with pytest.raises(grpc.RpcError) as e:
            call()
        times.append(time.perf_counter() - start)
        assert e.value.code() == Code.RESOURCE_EXHAUSTED, e.value.details()
        assert "waiting queue is full" in e.value.details()
    return times


def _assert_fast(running, times: list[float]) -> None:
    """Refused within the bound (the median of a few: this machine is shared), and under
    a queue that was full all along: the refused calls left no trace in it."""
    assert statistics.median(times) < REFUSAL_BOUND_S, [round(t * 1000, 1) for t in times]
    assert running.stats.num_requests_waiting == WAITING


def test_a_full_queue_refuses_generate_within_50_ms(full_server):
    running, channel = full_server
    stub = pb_grpc.GenerationServiceStub(channel)
    plain = pb.GenerateRequest(prompt="Hello there", stopping=pb.StoppingCriteria(
        max_new_tokens=8))
    _assert_fast(running, _refusal_times(lambda: stub.Generate(plain, timeout=10)))
    stream = pb.GenerateStreamRequest(request=plain)
    _assert_fast(running, _refusal_times(lambda: list(stub.GenerateStream(stream, timeout=10))))


def test_a_full_queue_refuses_before_tokenizing_or_compiling(full_server):
    """A long prompt (tokenized off the loop) and a schema nobody compiled yet are refused
    as fast as a short plain prompt: neither cost is paid for a call that cannot run."""
    running, channel = full_server
    stub = pb_grpc.GenerationServiceStub(channel)
    # ~100k tokens of text, tokenized off the loop before the last 1000 are kept (100s of ms)
    long_prompt = pb.GenerateRequest(prompt="word " * 100_000, truncate_input_tokens=1000)
    _assert_fast(running, _refusal_times(lambda: stub.Generate(long_prompt, timeout=10)))
    stats = running.server.servicer.structured.stats
    compiles = stats.compiles
    schemas = iter(range(100))

    def fresh_schema() -> pb.GenerateRequest:  # a new schema each time: no cache hit
        name = f"f{next(schemas)}"
        schema = json.dumps({"type": "object", "properties": {name: {"type": "integer"}},
                             "required": [name]})
        return pb.GenerateRequest(prompt="JSON:", structured_output=pb.StructuredOutput(
            json_schema=schema))

    _assert_fast(running, _refusal_times(lambda: stub.Generate(fresh_schema(), timeout=10)))
    assert stats.compiles == compiles


def test_a_full_queue_refuses_batch_items_and_tgis_calls_within_50_ms(full_server):
    running, channel = full_server
    stub = pb_grpc.GenerationServiceStub(channel)
    items = pb.GenerateBatchRequest(requests=[pb.GenerateRequest(prompt="Hi")] * 2)
    times = []
    for _ in range(9):
        start = time.perf_counter()
        batch = stub.GenerateBatch(items, timeout=10)
        times.append(time.perf_counter() - start)
        assert [r.error.code for r in batch.results] == [Code.RESOURCE_EXHAUSTED.value[0]] * 2
    _assert_fast(running, times)
    fmaas = tgis_grpc.GenerationServiceStub(channel)
    call = tgis.BatchedGenerationRequest(requests=[tgis.GenerationRequest(text="Hi")])
    _assert_fast(running, _refusal_times(lambda: fmaas.Generate(call, timeout=10)))
