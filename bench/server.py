"""A real ``genserve serve`` process, as deployed, and gRPC clients timed against it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.measure import Row, pct, prompts
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from service.server import PRESTART_IDLE_S


def _timed_clients(address: str, clients: int,
                   call: Callable[[pb_grpc.GenerationServiceStub, int], None]) -> float:
    """Seconds for ``clients`` threads, each on its own channel, to run ``call(stub, c)``.
    Channels connect before the clock starts and every client starts at once, as a load
    generator does (ghz, wrk): the row times serving, not 32 TCP and HTTP/2 handshakes made
    in the timed window (on 2 cores those ran beside the first prefill). A client's error
    is raised here."""
    start = threading.Barrier(clients + 1)
    errors: list[BaseException] = []

    def client(c: int) -> None:
        try:
            with grpc.insecure_channel(address) as ch:
                grpc.channel_ready_future(ch).result(timeout=60)
                stub = pb_grpc.GenerationServiceStub(ch)
                start.wait()
                call(stub, c)
        except BaseException as e:  # handed to the caller below
            errors.append(e)
            start.abort()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):  # a client failed: raised below
        start.wait(timeout=120)
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def grpc_clients(address: str, clients: int, per_client: int, new: int) -> Row:
    """``clients`` concurrent clients (``_timed_clients``), each streaming ``per_client``
    requests one after another."""
    ttfts: list[float] = []
    tpots: list[float] = []
    lock = threading.Lock()

    def stream(stub: pb_grpc.GenerationServiceStub, c: int) -> None:
        for k in range(per_client):
            req = pb.GenerateRequest(
                prompt=prompts(clients * per_client)[c * per_client + k],
                stopping=pb.StoppingCriteria(max_new_tokens=new, min_new_tokens=new))
            t0 = time.perf_counter()
            first = None
            for msg in stub.GenerateStream(pb.GenerateStreamRequest(request=req),
                                           timeout=600):
                if first is None and msg.token_ids:
                    first = time.perf_counter()
            end = time.perf_counter()
            assert first is not None, "the stream produced no tokens"
            with lock:
                ttfts.append(first - t0)
                tpots.append((end - first) / (new - 1))

    dt = _timed_clients(address, clients, stream)
    return Row(f"genserve gRPC, {clients} concurrent clients", clients * per_client * new / dt,
               statistics.median(ttfts), pct(ttfts, 0.99), statistics.median(tpots))


def grpc_unary_clients(address: str, clients: int, new: int) -> Row:
    """``clients`` concurrent clients (``_timed_clients``), one unary ``Generate`` each: the
    whole output comes back in one message, as batch jobs call."""

    def generate(stub: pb_grpc.GenerationServiceStub, c: int) -> None:
        out = stub.Generate(pb.GenerateRequest(
            prompt=prompts(clients)[c],
            stopping=pb.StoppingCriteria(max_new_tokens=new, min_new_tokens=new)),
            timeout=600)
        assert out.usage.completion_tokens == new, out.usage

    dt = _timed_clients(address, clients, generate)
    return Row(f"genserve gRPC, {clients} concurrent unary Generate", clients * new / dt)


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    log: Path
    serving_s: float  # process start -> health SERVING
    compiled_s: float | None = None  # process start -> background compile done

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM (the server drains), killed if it has not exited in ``timeout``."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_server_process(model: str, port: int, log_path: Path, runner: str = "torch",
                         extra: Sequence[str] = (), quiet: bool = True) -> ServerProcess:
    """The real ``genserve serve`` in its own process, as deployed: the bench's client
    threads must not share the server's GIL. Timed to SERVING; then, with ``quiet``, waits
    until its background work is done, so every row measures the same server: (torch
    runner, not ``--enforce-eager``) the decode step compiled (its log line), and the
    grammar-compile workers, which spawn once it has idled ``PRESTART_IDLE_S``, imported."""
    t0 = time.perf_counter()
    log_file = log_path.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--model", model, "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "INFO", "--runner", runner, *extra],
        stdout=log_file, stderr=subprocess.STDOUT)
    server: ServerProcess | None = None
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and server is None:
            if proc.poll() is not None:
                raise RuntimeError(f"genserve serve exited during start-up (log: {log_path})")
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    server = ServerProcess(proc, log_path, time.perf_counter() - t0)
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    if server is None:
        proc.kill()
        raise TimeoutError("genserve serve did not become SERVING in 300 s")
    while (quiet and runner == "torch" and "--enforce-eager" not in extra
           and time.monotonic() < deadline):
        text = log_path.read_text()
        if any(s in text for s in ("decode step compiled", "decode steps stay eager",
                                   "decode step captured")):  # captured: CUDA
            server.compiled_s = time.perf_counter() - t0
            break
        time.sleep(0.5)
    if quiet:
        time.sleep(PRESTART_IDLE_S + 1.0)  # the compile workers spawn, then idle again
        wait_quiet(proc.pid)
    return server


def _tree_cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` and its children (the compile workers it spawns), from /proc."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(entry.name) == pid or int(fields[1]) == pid:  # fields[1]: the parent's pid
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def wait_quiet(pid: int, window_s: float = 1.0, busy_share: float = 0.1,
               limit_s: float = 120.0) -> None:
    """Wait until the server's process tree idles: after SERVING its grammar-compile
    workers still import torch and the backends for several seconds (nice 5, yet on 2
    cores a first row measured beside them read 26 tok/s where the next read 83)."""
    if not Path(f"/proc/{pid}").exists():  # no /proc: not Linux, nothing to read
        return
    deadline = time.monotonic() + limit_s
    before = _tree_cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(window_s)
        now = _tree_cpu_seconds(pid)
        if now - before < busy_share * window_s:
            return
        before = now


def cli_generate_seconds(address: str) -> float:
    """Wall time of ``genserve generate`` (a fresh process: imports, channel, one call)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "service.cli", "generate", "--address", address,
                    "--max-new-tokens", "8", "Hello"], check=True, capture_output=True)
    return time.perf_counter() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
