"""A real ``genserve serve`` process on the tiny model, for tests of what only a whole
process shows (signals, logs on stdout, compile workers)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(ch: grpc.Channel) -> int | None:
    try:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                    timeout=1).status
    except grpc.RpcError:
        return None


def serve(model_dir: Path, log: Path, *args: str) -> tuple[subprocess.Popen, int]:
    """Start ``genserve serve`` on a free port (small context and KV cache), output to
    ``log``; returns the process and its port."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{REPO}:{REPO / 'protos'}"}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--model", str(model_dir),
             "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
             "--kv-cache-memory", "16MiB", *args],
            cwd=REPO, env=env, stdout=out, stderr=out)
    return proc, port


def wait_serving(proc: subprocess.Popen, ch: grpc.Channel, log: Path,
                 timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while health(ch) != health_pb2.HealthCheckResponse.SERVING:
        assert proc.poll() is None and time.monotonic() < end, log.read_text()
        time.sleep(0.2)
