"""Raw bytes no stub would send: every string field of every request of every service
(ours, TGIS's, health, reflection) with invalid UTF-8, garbage and truncated messages,
each answered INVALID_ARGUMENT naming the problem, never UNKNOWN or INTERNAL."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from engine.config import EngineConfig
from fmaas import generation_pb2 as tgis
from genserve.v1 import generation_pb2 as pb
from tests.service.conftest import start_server, stop_server
from tests.service.fake_engine import FakeEngine

Code = grpc.StatusCode
MARK = "QZQZ"  # replaced on the wire by 4 bytes that are not UTF-8
BAD = b"\xff\xfe\xfd\xfc"

SERVICES = [pb.DESCRIPTOR.services_by_name["GenerationService"],
            tgis.DESCRIPTOR.services_by_name["GenerationService"],
            health_pb2.DESCRIPTOR.services_by_name["Health"],
            reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]]
CLASSES = {m.DESCRIPTOR.full_name: m for mod in (pb, tgis, health_pb2, reflection_pb2)
           for m in vars(mod).values() if hasattr(m, "DESCRIPTOR") and hasattr(m, "FromString")}


def _string_paths(desc, prefix=(), depth=0):
    """Paths (field-name tuples) of every string field reachable in ``desc``."""
    for f in desc.fields:
        if f.type == FieldDescriptor.TYPE_STRING:
            yield (*prefix, f.name)
        elif (f.type == FieldDescriptor.TYPE_MESSAGE and depth < 3
              and not f.message_type.GetOptions().map_entry):
            yield from _string_paths(f.message_type, (*prefix, f.name), depth + 1)


def _with_bad_string(cls, path) -> bytes:
    msg = cls()
    target = msg
    for name in path[:-1]:
        field = target.DESCRIPTOR.fields_by_name[name]
        target = (getattr(target, name).add() if field.is_repeated
                  else getattr(target, name))
    leaf = target.DESCRIPTOR.fields_by_name[path[-1]]
    if leaf.is_repeated:
        getattr(target, path[-1]).append(MARK)
    else:
        setattr(target, path[-1], MARK)
    data = msg.SerializeToString()
    assert data.count(MARK.encode()) == 1
    return data.replace(MARK.encode(), BAD)


CASES = []
for service in SERVICES:
    for method in service.methods:
        cls = CLASSES[method.input_type.full_name]
        rpc = f"/{service.full_name}/{method.name}"
        kind = (method.client_streaming, method.server_streaming)
        for path in _string_paths(method.input_type):
            CASES.append(pytest.param(rpc, kind, _with_bad_string(cls, path), path[-1],
                                      id=f"{service.name}.{method.name}:{'.'.join(path)}"))
        CASES.append(pytest.param(rpc, kind, b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",
                                  "", id=f"{service.full_name}.{method.name}:garbage"))


@pytest.fixture(scope="module")
def server(tiny_model_dir, tokenizer):
    engine = FakeEngine(tokenizer, EngineConfig(model=str(tiny_model_dir)))
    running, _ = start_server(engine, structured=None)
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address) as ch:
        yield ch


def _call(channel, rpc: str, kind: tuple[bool, bool], data: bytes):
    if kind == (False, False):
        return channel.unary_unary(rpc)(data, timeout=10)
    if kind == (False, True):
        return list(channel.unary_stream(rpc)(data, timeout=10))
    return list(channel.stream_stream(rpc)(iter([data]), timeout=10))


def test_every_service_string_field_is_covered():
    assert len(CASES) > 40  # request_id, prompt, chat, stops, schemas, TGIS texts, ...


@pytest.mark.parametrize(("rpc", "kind", "data", "field"), CASES)
def test_undecodable_request_is_invalid_argument(channel, rpc, kind, data, field):
    with pytest.raises(grpc.RpcError) as e:
        _call(channel, rpc, kind, data)
    assert e.value.code() == Code.INVALID_ARGUMENT, e.value.details()
    assert "is not a valid" in e.value.details()
    if field:
        assert f"{field}: not valid UTF-8" in e.value.details()


def test_truncated_request_names_the_field(channel):
    data = pb.GenerateRequest(prompt="hello", stopping=pb.StoppingCriteria(
        stop_sequences=["abc"])).SerializeToString()
    with pytest.raises(grpc.RpcError) as e:
        channel.unary_unary("/genserve.v1.GenerationService/Generate")(data[:-2], timeout=10)
    assert e.value.code() == Code.INVALID_ARGUMENT
    assert "stopping" in e.value.details() and "truncated" in e.value.details()


def test_the_server_keeps_serving_after_bad_bytes(channel):
    from genserve.v1 import generation_pb2_grpc as pb_grpc

    resp = pb_grpc.GenerationServiceStub(channel).Generate(
        pb.GenerateRequest(prompt="still here", stopping=pb.StoppingCriteria(max_new_tokens=2)),
        timeout=10)
    assert resp.usage.completion_tokens == 2
