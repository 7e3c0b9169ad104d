"""grpc.health.v1 ``Watch``: NOT_SERVING -> SERVING once warm, SERVING -> NOT_SERVING on drain."""

from __future__ import annotations

import asyncio
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.config import EngineConfig
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from service.server import SERVICE_NAME, GenServer, ServerConfig
from tests.service.conftest import new_loop, wait_until
from tests.service.fake_engine import FakeEngine

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING



def test_watch_sees_warm_up_and_drain(tokenizer, tiny_model_dir):
    release = threading.Event()

    class SlowWarmUp(GenServer):
        async def warm_up(self):
            await asyncio.to_thread(release.wait, 30)
            await super().warm_up()

    loop, thread = new_loop()
    engine = FakeEngine(tokenizer, EngineConfig(model=str(tiny_model_dir), max_model_len=256))

    async def make():  # grpc.aio objects belong to the loop they are created on
        return SlowWarmUp(ServerConfig(host="127.0.0.1", port=0, structured=None,
                                       drain_grace_s=30), engine)

    server = asyncio.run_coroutine_threadsafe(make(), loop).result(10)
    started = asyncio.run_coroutine_threadsafe(server.start(), loop)
    try:
        assert wait_until(lambda: server.port != 0)
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            watches = {name: health.Watch(health_pb2.HealthCheckRequest(service=name),
                                          timeout=60)
                       for name in ("", SERVICE_NAME)}
            for watch in watches.values():
                assert next(watch).status == NOT_SERVING  # listening, not warm yet
            release.set()
            started.result(30)
            for watch in watches.values():
                assert next(watch).status == SERVING

            # drain with a call in flight: NOT_SERVING at once, the call still finishes
            stub = pb_grpc.GenerationServiceStub(ch)
            in_flight = stub.Generate.future(pb.GenerateRequest(
                prompt="a long answer", stopping=pb.StoppingCriteria(
                    max_new_tokens=200, min_new_tokens=200)), timeout=60)
            assert wait_until(lambda: server.state.in_flight == 1)
            drained = asyncio.run_coroutine_threadsafe(server.drain(), loop)
            for watch in watches.values():
                assert next(watch).status == NOT_SERVING
            assert not in_flight.done()
            assert in_flight.result(60).usage.completion_tokens == 200
            drained.result(60)
            for watch in watches.values():  # the stream ends when the server stops
                try:
                    extra = list(watch)
                except grpc.RpcError as e:
                    assert e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
                else:
                    assert all(m.status == NOT_SERVING for m in extra)
    finally:
        release.set()
        if not server._stopped.is_set():
            asyncio.run_coroutine_threadsafe(server.drain(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_health_goes_not_serving_when_the_engine_loop_dies(tiny_model_dir):
    """A crashed engine can serve nothing: the in-flight call fails UNAVAILABLE and the
    probes see NOT_SERVING, so Kubernetes restarts the pod instead of routing to it."""
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import LLMEngine
    from tests.service.conftest import start_server, stop_server

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=256))
    step, armed = engine.step, threading.Event()

    def crashing():
        if armed.is_set():
            raise RuntimeError("boom")
        return step()

    engine.step = crashing  # type: ignore[method-assign]
    running, thread = start_server(AsyncEngine(engine), structured=None)
    try:
        with grpc.insecure_channel(running.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            check = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
            assert health.Check(check).status == SERVING
            armed.set()
            stub = pb_grpc.GenerationServiceStub(ch)
            try:
                stub.Generate(pb.GenerateRequest(prompt="hi"), timeout=30)
                raise AssertionError("the call should fail")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE and "boom" in e.details()
            assert wait_until(lambda: health.Check(check).status == NOT_SERVING)
            assert health.Check(health_pb2.HealthCheckRequest()).status == NOT_SERVING
    finally:
        stop_server(running, thread)


def test_the_server_serves_at_once_and_compiles_the_decode_step_in_the_background(
        tiny_model_dir):
    from engine.async_engine import AsyncEngine
    from tests.service.conftest import start_server, stop_server

    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_model_dir), max_model_len=256,
                                                  max_num_seqs=2, decode_buckets=[1, 2]))
    running, thread = start_server(engine, structured=None, compile_decode_step=True)
    request = pb.GenerateRequest(prompt="hi", output=pb.OutputOptions(return_token_ids=True),
                                 stopping=pb.StoppingCriteria(max_new_tokens=8, ignore_eos=True))
    try:
        compile_thread = running.server.compile_thread
        assert compile_thread is not None
        with grpc.insecure_channel(running.address) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            during = stub.Generate(request, timeout=120)  # served while compiling
            compile_thread.join(300)
            assert not compile_thread.is_alive()
            assert engine.engine.runner.decode_graphs is not None  # swapped in when ready
            after = stub.Generate(request, timeout=60)
        assert during.usage.completion_tokens == 8
        assert list(after.completions[0].token_ids) == list(during.completions[0].token_ids)
    finally:
        stop_server(running, thread)
