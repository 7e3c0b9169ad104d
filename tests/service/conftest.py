"""A real genserve gRPC server on 127.0.0.1 (ephemeral port), over either engine.

Service tests are engine-agnostic: ``engine_kind`` runs each module once on the fake echo
engine (fast, deterministic, see ``fake_engine.py``) and once on the real ``AsyncEngine``
over a tiny random model.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest

from engine.async_engine import AsyncEngine, in_own_thread
from engine.config import EngineConfig
from genserve.v1 import generation_pb2_grpc as pb_grpc
from service.server import GenServer, ServerConfig
from service.validation import ServiceLimits
from tests.service.fake_engine import FakeEngine

ENGINE_KINDS = ("fake", "real")
MAX_MODEL_LEN = 256


@dataclass
class RunningServer:
    address: str
    server: GenServer
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread | None = None  # the loop's thread

    def call(self, coro_fn, timeout: float = 30.0):
        """Run ``coro_fn()`` on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)

    @property
    def stats(self):
        return self.server.engine.stats()


def wait_until(pred, timeout: float = 10.0) -> bool:
    """Poll ``pred`` until it holds (True) or ``timeout`` seconds pass (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


def new_loop() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    """An event loop in a daemon thread: the server runs there, the test calls it. Once
    stopped (``loop.stop``) the thread closes it, so no test leaves its selector open."""
    loop = asyncio.new_event_loop()

    def run() -> None:
        try:
            loop.run_forever()
        finally:
            loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return loop, thread


def start_server(engine, limits: ServiceLimits | None = None, structured_outputs=None,
                 **server_kw) -> tuple[RunningServer, threading.Thread]:
    """Serve ``engine`` (an engine not yet started, or an EngineConfig for a real one).

    ``server_kw`` go to ServerConfig (``structured=None`` turns structured output off);
    ``structured_outputs``, a StructuredOutputs built once, saves seconds per server.
    """
    loop, thread = new_loop()
    server_kw.setdefault("compile_decode_step", False)  # seconds per server: not here
    config = ServerConfig(host="127.0.0.1", port=0, limits=limits or ServiceLimits(
        max_batch_size=32, max_n=4), **server_kw)

    async def boot():  # grpc.aio objects belong to the loop they are created on
        built = engine
        if isinstance(engine, EngineConfig):
            # in a thread that ends (not asyncio's executor, whose threads outlive the
            # test): a live thread that ran torch keeps an OpenMP team, and with more
            # OpenMP threads than cores libgomp stops spin-waiting, so every later torch
            # op in this process ran 1.6-1.8x slower (engine/async_engine.in_own_thread)
            built = await in_own_thread(AsyncEngine.from_config, engine)
        server = GenServer(config, built)
        server.servicer.structured = structured_outputs
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(boot(), loop).result(120)
    return RunningServer(f"127.0.0.1:{server.port}", server, loop, thread), thread


def stop_server(running: RunningServer, thread: threading.Thread | None = None) -> None:
    running.call(running.server.drain)
    running.loop.call_soon_threadsafe(running.loop.stop)
    if thread or running.thread:
        (thread or running.thread).join(10)


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def engine_kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def make_engine(engine_kind, tiny_model_dir, tokenizer) -> Callable[..., object]:
    """``make_engine(**EngineConfig fields)`` -> a not-yet-started engine of the kind."""

    def make(**config_kw):
        config_kw.setdefault("max_model_len", MAX_MODEL_LEN)
        config = EngineConfig(model=str(tiny_model_dir), **config_kw)
        if engine_kind == "fake":
            return FakeEngine(tokenizer, config)
        return AsyncEngine.from_config(config)

    return make


@pytest.fixture(scope="session")
def structured_outputs(tokenizer):
    """Built once (it costs seconds): grammar compilation for every server in the session."""
    from structured.manager import StructuredConfig, StructuredOutputs

    outputs = StructuredOutputs(tokenizer, len(tokenizer), [tokenizer.eos_token_id],
                                StructuredConfig(prestart_workers=False))
    yield outputs
    outputs.close()


@pytest.fixture(scope="module")
def grpc_server(make_engine, structured_outputs):
    running, _ = start_server(make_engine(max_waiting=64), structured_outputs=structured_outputs)
    yield running
    stop_server(running)


@pytest.fixture
def stub(grpc_server):
    with grpc.insecure_channel(grpc_server.address) as channel:
        yield pb_grpc.GenerationServiceStub(channel)
