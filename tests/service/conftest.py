"""A real genserve gRPC server on 127.0.0.1 (ephemeral port) over a tiny random model."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import grpc
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from genserve.v1 import generation_pb2_grpc as pb_grpc
from service.server import GenServer, ServerConfig
from service.validation import ServiceLimits


@dataclass
class RunningServer:
    address: str
    server: GenServer
    loop: asyncio.AbstractEventLoop

    def call(self, coro_fn, timeout: float = 30.0):
        """Run ``coro_fn()`` on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)

    @property
    def stats(self):
        return self.server.engine.stats()


def start_server(engine_config: EngineConfig, limits: ServiceLimits | None = None,
                 **server_kw) -> tuple[RunningServer, threading.Thread]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    config = ServerConfig(host="127.0.0.1", port=0, limits=limits or ServiceLimits(
        max_batch_size=32, max_n=4), engine=engine_config, **server_kw)

    async def boot():
        engine = await asyncio.to_thread(AsyncEngine.from_config, engine_config)
        server = GenServer(config, engine)
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(boot(), loop).result(120)
    return RunningServer(f"127.0.0.1:{server.port}", server, loop), thread


def stop_server(running: RunningServer, thread: threading.Thread) -> None:
    running.call(running.server.drain)
    running.loop.call_soon_threadsafe(running.loop.stop)
    thread.join(10)


@pytest.fixture(scope="module")
def grpc_server(tiny_model_dir):
    running, thread = start_server(EngineConfig(model=str(tiny_model_dir), max_model_len=256,
                                                max_waiting=64))
    yield running
    stop_server(running, thread)


@pytest.fixture
def stub(grpc_server):
    with grpc.insecure_channel(grpc_server.address) as channel:
        yield pb_grpc.GenerationServiceStub(channel)
