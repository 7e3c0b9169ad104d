"""A real ``genserve serve`` process, as deployed, and gRPC clients timed against it."""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.measure import Row, pct, prompts
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc


def grpc_clients(address: str, clients: int, per_client: int, new: int) -> Row:
    ttfts: list[float] = []
    tpots: list[float] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
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

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    return Row(f"genserve gRPC, {clients} concurrent clients", clients * per_client * new / dt,
               statistics.median(ttfts), pct(ttfts, 0.99), statistics.median(tpots))


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    log: Path
    serving_s: float  # process start -> health SERVING
    compiled_s: float | None = None  # process start -> background compile done


def start_server_process(model: str, port: int, log_path: Path, runner: str = "torch",
                         extra: Sequence[str] = ()) -> ServerProcess:
    """The real ``genserve serve`` in its own process, as deployed: the bench's client
    threads must not share the server's GIL. Timed to SERVING; then (torch runner, not
    ``--enforce-eager``) waits until the decode step compiled in the background (its log
    line), so every row measures the same step."""
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
    while (runner == "torch" and "--enforce-eager" not in extra
           and time.monotonic() < deadline):
        text = log_path.read_text()
        if any(s in text for s in ("decode step compiled", "decode steps stay eager",
                                   "decode step captured")):  # captured: CUDA
            server.compiled_s = time.perf_counter() - t0
            break
        time.sleep(0.5)
    return server


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
