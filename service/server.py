"""The gRPC server: generation service, health, reflection, warm-up, graceful drain,
Prometheus metrics over HTTP and optional TLS / mTLS."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from engine.async_engine import AsyncEngine, in_own_thread
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from fmaas import generation_pb2_grpc as tgis_grpc
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from service.metrics import Metrics
from service.processor_plugins import PluginContext, PluginRegistry
from service.rpc_guard import RpcGuard
from service.servicer import GenerationServicer, ServerState
from service.tgis_params import TgisOptions
from service.tgis_servicer import SERVICE_NAME as FMAAS_SERVICE_NAME
from service.tgis_servicer import FmaasServicer
from service.validation import ServiceLimits, seed_sampling
from specdecode.config import SpeculativeConfig
from specdecode.worker import speculator_for
from structured.manager import StructuredConfig, StructuredOutputs

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Grammar-compile workers spawn once the server has had no request in flight this long
# (their imports must not share the cores with the first requests), polled this often.
PRESTART_IDLE_S = 1.0
PRESTART_POLL_S = 0.25
# How long no call must be in flight before a drain stops the server: longer than the
# loop takes to dispatch a call gRPC accepted before its GOAWAY, even on a loaded machine.
DISPATCH_SETTLE_S = 0.5
# At most this long between NOT_SERVING and GOAWAY while calls still arrive (clients that
# do not watch health keep sending until the GOAWAY).
MOVE_AWAY_MAX_S = 2.0


async def wait_until_idle(idle: Callable[[], bool], for_s: float, poll_s: float,
                          clock: Callable[[], float] = time.monotonic) -> None:
    """Return once ``idle()`` has held at every poll for ``for_s`` seconds in a row."""
    since = clock()
    while True:
        await asyncio.sleep(poll_s)
        if not idle():
            since = clock()
        elif clock() - since >= for_s:
            return


@dataclass
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 50051
    drain_grace_s: float = 30.0
    limits: ServiceLimits = field(default_factory=ServiceLimits)
    engine: EngineConfig = field(default_factory=EngineConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # method None = off
    # Compile the decode step: on CPU in the background once SERVING (steps run eagerly
    # until the graphs are ready), CUDA graphs before SERVING; EngineConfig.enforce_eager
    # still wins; tests turn it off.
    compile_decode_step: bool = True
    processor_plugins: list[str] = field(default_factory=list)  # module:Class, beyond builtins
    structured: StructuredConfig | None = field(default_factory=StructuredConfig)  # None = off
    metrics_port: int | None = None  # Prometheus /metrics over HTTP on host; None = off, 0 = any
    tls_cert: str | None = None  # PEM server certificate chain; with tls_key: TLS
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_client_ca: str | None = None  # PEM CA bundle: require and verify client certs (mTLS)
    # plaintext grpc.health.v1 only, on its own port: the kubelet's native gRPC probe cannot
    # speak TLS; None = off, 0 = any free port
    health_port: int | None = None
    served_model_name: str | None = None  # the model id clients see; None = the model's
    seed: int | None = None  # seeds the seeds picked for unseeded sampled requests
    fmaas: bool = True  # also serve the TGIS API (fmaas.GenerationService) on the same port
    tgis: TgisOptions = field(default_factory=TgisOptions)
    # OTLP/gRPC collector for request spans (vLLM's --otlp-traces-endpoint); None = no
    # tracing at all (no tracer provider, no exporter, no per-call work)
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both a certificate and its key (--tls-cert, --tls-key)")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise OSError(f"cannot read the {what} {path!r}: {e.strerror or e}") from e


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the config's PEM files (None = plaintext); a client CA makes
    the server require and verify a client certificate (mTLS)."""
    if not config.tls_cert or not config.tls_key:
        return None
    chain = _read(config.tls_cert, "TLS certificate")
    key = _read(config.tls_key, "TLS key")
    client_ca = _read(config.tls_client_ca, "TLS client CA") if config.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


class GenServer:
    """Owns the grpc.aio server and the engine's lifecycle.

    Health stays NOT_SERVING until the model is loaded *and* one warm-up generation ran,
    so a Kubernetes readiness/startup probe only routes traffic to a warm replica.
    """

    def __init__(self, config: ServerConfig, engine: AsyncEngine | None = None) -> None:
        self.config = config
        self.engine = engine
        self.state = ServerState()
        self.health = HealthServicer()
        self.metrics = Metrics()
        self.metrics.add_engine_collector(self._engine_stats, lambda: self.state.in_flight)
        self.metrics_port = 0
        self.servicer = GenerationServicer(None, config.limits, self.state,  # engine: when warm
                                           self.metrics)
        self.servicer.served_model_name = config.served_model_name
        if config.otlp_traces_endpoint:
            from service.tracing import RequestTracer  # opentelemetry only when asked for

            self.servicer.tracer = RequestTracer.otlp(config.otlp_traces_endpoint)
        if config.seed is not None:
            seed_sampling(config.seed)
        self.server = grpc.aio.server(interceptors=[RpcGuard(self.metrics)], options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ])
        pb_grpc.add_GenerationServiceServicer_to_server(self.servicer, self.server)
        self.services = [SERVICE_NAME]  # health names them; reflection lists them
        if config.fmaas:
            tgis_grpc.add_GenerationServiceServicer_to_server(
                FmaasServicer(self.servicer, config.tgis), self.server)
            self.services.append(FMAAS_SERVICE_NAME)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (*self.services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.server)
        self.port = 0
        self.health_server: grpc.aio.Server | None = None
        self.health_port = 0
        self._stopped = asyncio.Event()
        self._forced = False
        self.exit_code = 0  # 1 once a tensor-parallel worker is lost
        self._owns_structured = False  # built here (not handed in): closed on stop
        self._drain_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self.compile_thread: threading.Thread | None = None
        self._prestart_task: asyncio.Task | None = None

    def _engine_stats(self):
        """For the metrics scrape (another thread): the engine's ints, once it exists."""
        engine = self.engine
        return engine.stats() if engine is not None else None

    async def _set_health(self, status) -> None:
        for name in ("", *self.services):
            await self.health.set(name, status)

    async def start(self) -> int:
        """Listen at once (health answers NOT_SERVING), then load, warm up, go SERVING.

        A drain that begins while loading wins: the server never turns SERVING after it.
        """
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.config.host}:{self.config.port}"
        credentials = server_credentials(self.config)
        if credentials is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, credentials)
        if not self.port:
            raise OSError(f"cannot bind {address}")
        await self.server.start()
        log.info("listening on %s:%d (%s)", self.config.host, self.port,
                 "plaintext" if credentials is None else
                 "mTLS" if self.config.tls_client_ca else "TLS")
        if self.config.health_port is not None:
            await self._start_health_port()
        if self.config.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.serve(self.config.host,
                                                       self.config.metrics_port)
                log.info("metrics on http://%s:%d/metrics", self.config.host,
                         self.metrics_port)
            except OSError as e:  # metrics are auxiliary: serve the model without them
                log.error("metrics disabled: cannot listen on %s:%d: %s", self.config.host,
                          self.config.metrics_port, e)
        if self.engine is None:
            start = time.perf_counter()
            engine = await in_own_thread(AsyncEngine.from_config, self.config.engine,
                                             speculator_for(self.config.speculative))
            log.info("engine ready in %.1fs: %s, max_model_len=%d, runner=%s (%s)",
                     time.perf_counter() - start, engine.info.model_id,
                     engine.info.max_model_len, engine.info.runner, engine.info.quantization)
            if self.state.draining:
                return self.port
            self.engine = engine
        compile_now = (self.config.compile_decode_step
                       and not self.config.engine.enforce_eager
                       and self.engine.info.runner == "torch")  # llama.cpp: nothing to build
        if not self.engine.is_running:
            if compile_now and (self.engine.device_type == "cuda"
                                or self.config.engine.tensor_parallel_size > 1):
                # CUDA graphs capture in seconds, and a capture must not race the step
                # loop's kernels on the device; with tensor parallelism the compile's
                # warm-up forwards take part in the ranks' collectives, which must not
                # interleave with a step's: before serving.
                start = time.perf_counter()
                await in_own_thread(self.engine.compile)
                log.info("decode step captured in %.1fs", time.perf_counter() - start)
                compile_now = False
            self.engine.start()
        self._watch_task = asyncio.create_task(self._watch_engine())
        self.servicer.registry = PluginRegistry(
            PluginContext(self.engine.tokenizer, self.engine.info.vocab_size),
            self.config.processor_plugins)
        log.info("processor plugins: %s", ", ".join(sorted(self.servicer.registry.plugins)))
        # The grammar backends' vocabulary tables build while the warm-up generation runs.
        await asyncio.gather(self._build_structured(), self.warm_up())
        if self.servicer.structured is not None:
            self.servicer.structured.observers.append(self.metrics)
        if self.state.draining:
            return self.port
        self.servicer.engine = self.engine
        self.metrics.model_name = self.config.served_model_name or self.engine.info.model_id
        self.engine.on_step = self.metrics.on_step
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("SERVING")
        if (self._owns_structured and self.servicer.structured is not None
                and self.config.structured and self.config.structured.prestart_workers):
            self._prestart_task = asyncio.create_task(self._prestart_when_idle())
        if compile_now:
            self._compile_in_background()
        return self.port

    async def _prestart_when_idle(self) -> None:
        """Spawn the grammar-compile workers once no request has been in flight for
        ``PRESTART_IDLE_S``: their imports (torch, transformers, xgrammar,
        lm-format-enforcer: seconds of CPU each) took the serving cores while the first
        requests waited (batch 1 ran ~0.7x steady state for ~20 s on 2 cores). A compile
        that needs a worker sooner spawns it then."""
        assert self.engine is not None and self.servicer.structured is not None
        engine = self.engine
        await wait_until_idle(lambda: engine.idle and not self.state.draining,
                              PRESTART_IDLE_S, PRESTART_POLL_S)
        if not self.state.draining:
            log.info("no request for %.1fs: starting the grammar-compile workers",
                     PRESTART_IDLE_S)
            self.servicer.structured.prestart()

    def _compile_in_background(self) -> None:
        """Compiling takes 20-45 s on a small CPU: serve eagerly meanwhile instead of
        holding SERVING back. A daemon thread, so shutdown never waits on a compile; a
        process still compiling after its drain ends through ``exit_status``."""
        engine = self.engine
        assert engine is not None

        def build() -> None:
            start = time.perf_counter()
            log.info("compiling the decode step in the background (serving eagerly meanwhile)")
            try:
                report = engine.compile()
            except Exception:  # the compiled step is an optimisation: keep serving eagerly
                log.exception("compiling the decode step failed; decode steps stay eager")
                return
            log.info("decode step compiled in %.1fs: %s rows now compiled%s",
                     time.perf_counter() - start, ", ".join(report.ready) or "no",
                     " (natively: nothing to compile)" if any(
                         g.status == "native" for g in report.graphs) else "")

        self.compile_thread = threading.Thread(target=build, name="genserve-compile",
                                               daemon=True)
        self.compile_thread.start()

    @property
    def compiling(self) -> bool:
        """The background decode-step compile is still running."""
        return self.compile_thread is not None and self.compile_thread.is_alive()

    async def _watch_engine(self) -> None:
        """A crashed engine loop can serve nothing: stop routing traffic here at once."""
        assert self.engine is not None and self.engine.died is not None
        await self.engine.died.wait()
        log.error("engine loop died: health NOT_SERVING; restart the server")
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.engine.lost_worker:  # the model is gone: exit non-zero to be restarted
            log.error("a tensor-parallel worker was lost: shutting down (exit status 1)")
            self.exit_code = 1
            self._drain_task = asyncio.ensure_future(self.drain())

    async def _build_structured(self) -> None:
        if self.config.structured is None or self.servicer.structured is not None:
            return
        assert self.engine is not None
        info = self.engine.info
        # Compile workers spawn once SERVING: their imports would slow the start-up.
        self.servicer.structured = await in_own_thread(
            StructuredOutputs, self.engine.tokenizer, info.vocab_size, info.eos_token_ids,
            replace(self.config.structured, prestart_workers=False))
        self._owns_structured = True

    async def warm_up(self) -> None:
        assert self.engine is not None
        start = time.perf_counter()
        ids = self.engine.tokenizer("Hello")["input_ids"] or [0]
        async for _ in self.engine.generate("warm-up", ids, SamplingParams(max_new_tokens=4)):
            pass
        log.info("warm-up generation took %.2fs", time.perf_counter() - start)

    async def drain(self) -> None:
        """SIGTERM: NOT_SERVING, GOAWAY at once (clients move to other replicas; new calls
        are refused), in-flight calls finish within the grace; those still running near
        its end are ended with finish reason ABORTED, so their clients get what was
        generated and a reason, not an error."""
        if self.state.draining:
            return
        grace = self.config.drain_grace_s
        log.info("draining: finishing in-flight work within %.0fs", grace)
        self.state.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + grace
        margin = min(2.0, grace / 4)
        # Clients that watch health (round_robin with a healthCheckConfig, as genserve's
        # Python client) stop picking this replica on NOT_SERVING; until new calls stop
        # coming, keep accepting them. gRPC's stop cancels (CANCELLED, not retried) any
        # call its core holds undispatched at that moment or receives before the client
        # reads the GOAWAY; clients that do not watch health meet that race after the wait.
        await self._wait_moved_away(min(time.monotonic() + MOVE_AWAY_MAX_S,
                                        deadline - margin))
        stopping = asyncio.ensure_future(self.server.stop(grace=grace))  # GOAWAY now
        await self._wait_settled(deadline - margin)
        if self.state.in_flight and self.engine is not None and not self._forced:
            log.warning("grace running out: ending %d in-flight calls (ABORTED)",
                        self.state.in_flight)
            self.engine.abort_all()
            await self._wait_in_flight(deadline)
        self.state.closing = True
        if self.state.in_flight:
            log.warning("cancelling %d in-flight calls", self.state.in_flight)
        # Only quick calls (health watches, Tokenize) can remain: a short grace suffices.
        await self.server.stop(grace=0 if self._forced else
                               min(1.0, max(0.0, deadline - time.monotonic())))
        await stopping
        if self.health_server is not None:
            await self.health_server.stop(grace=0)
        if self._watch_task is not None:
            self._watch_task.cancel()
        if self._prestart_task is not None:
            self._prestart_task.cancel()
        if self.engine is not None:
            await self.engine.shutdown()
        if self.servicer.structured is not None:
            with contextlib.suppress(ValueError):
                self.servicer.structured.observers.remove(self.metrics)
            if self._owns_structured:
                self.servicer.structured.close()  # kills running compiles: never waited on
        await asyncio.to_thread(self.metrics.stop)
        tracer = self.servicer.tracer
        if tracer is not None and not await asyncio.to_thread(tracer.shutdown):  # flush
            log.warning("trace spans not all exported: the OTLP collector at %s did "
                            "not answer in time", self.config.otlp_traces_endpoint)
        self._stopped.set()
        log.info("stopped")

    async def _start_health_port(self) -> None:
        """``grpc.health.v1`` alone, plaintext, sharing the main port's health states."""
        self.health_server = grpc.aio.server(interceptors=[RpcGuard(self.metrics)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
        address = f"{self.config.host}:{self.config.health_port}"
        self.health_port = self.health_server.add_insecure_port(address)
        if not self.health_port:
            raise OSError(f"cannot bind the health port {address}")
        await self.health_server.start()
        log.info("health checks (plaintext) on %s:%d", self.config.host, self.health_port)

    async def _wait_settled(self, until: float) -> None:
        """Until no call has been in flight for ``DISPATCH_SETTLE_S``: a call gRPC accepted
        before its GOAWAY reaches the servicer only when the loop dispatches it (late on a
        busy loop), and the final stop would cancel it undispatched (CANCELLED)."""
        quiet_since = time.monotonic()
        while time.monotonic() < until and not self._forced:
            if self.state.in_flight:
                await self._wait_in_flight(until)
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= DISPATCH_SETTLE_S:
                return
            await asyncio.sleep(0.05)

    async def _wait_moved_away(self, until: float) -> None:
        """Until no generation call has started for ``DISPATCH_SETTLE_S``."""
        while time.monotonic() < until and not self._forced:
            if time.monotonic() - self.state.last_call_at >= DISPATCH_SETTLE_S:
                return
            await asyncio.sleep(0.05)

    async def _wait_in_flight(self, until: float) -> None:
        while self.state.in_flight and time.monotonic() < until and not self._forced:
            await asyncio.sleep(0.05)

    def on_signal(self) -> None:
        """First SIGTERM/SIGINT drains gracefully; a second one cancels in-flight calls."""
        if self.state.draining:
            log.info("second signal: stopping now")
            self._forced = True
            return
        self._drain_task = asyncio.ensure_future(self.drain())

    async def wait(self) -> None:
        await self._stopped.wait()


async def serve(config: ServerConfig) -> GenServer:
    """Run until a signal drains the server (even mid start-up); a failed start re-raises.
    Returns the stopped server: pass it to ``exit_status`` once the event loop is closed."""
    server = GenServer(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.on_signal)
    starting = asyncio.create_task(server.start())
    stopped = asyncio.create_task(server.wait())
    await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if starting.done() and starting.exception() is not None and not server.state.draining:
        await server.drain()
        error = starting.exception()
        assert error is not None
        raise error
    await stopped
    if not starting.done():
        starting.cancel()
    elif not starting.cancelled() and starting.exception() is not None:
        log.info("start-up interrupted by the shutdown: %s", starting.exception())
    return server


def exit_status(server: GenServer | None, code: int) -> int:
    """``code``, for the process to exit with once ``serve`` returned; but while the
    background decode-step compile still runs, the process ends here, ``os._exit(code)``
    after flushing the logs, instead of returning into the interpreter's shutdown.

    Why: at shutdown CPython ends each daemon thread that wants the GIL back with
    ``pthread_exit``. The compile thread keeps entering torch calls that release the GIL
    (pybind11 ``gil_scoped_release``); caught inside one, it takes the GIL back in that
    guard's noexcept destructor, the forced unwind reaches it, C++ calls ``std::terminate``
    and the process aborts (SIGABRT, "terminate called without an active exception")
    after a clean drain. Stopping the compile instead cannot bound the shutdown: one graph
    is a single ``torch.compile`` call of 10-30 s that nothing interrupts, and its result
    would be dropped anyway. By now the drain has answered or ended every call and closed
    the ports, the engine and the grammar workers, so skipping the interpreter's shutdown
    loses nothing: inductor's compile workers kill themselves once their parent is gone,
    and a compile cut short leaves its cache as a SIGKILL would (entries are written to a
    temporary file and renamed). The same after a lost tensor-parallel worker: the broken
    group's native threads must not keep a process that has to be restarted alive."""
    if server is None or not (server.compiling or server.exit_code):
        return code
    if server.exit_code:  # a lost tensor-parallel group: no native thread may hold us up
        log.info("exiting with status %d", code)
    else:
        log.info("exiting with the background decode-step compile unfinished (%d)", code)
    logging.shutdown()  # flushes every handler
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
