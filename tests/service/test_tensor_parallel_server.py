"""A ``genserve serve --tensor-parallel-size 2`` process: it serves, a killed worker turns
health NOT_SERVING and the server exits non-zero (never hangs), SIGTERM drains and leaves no
worker behind (GENSERVE_SLOW: a second server; the cheap test of the same path is the
runner tests' fixture teardown, which closes the workers the way the drain does)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from tests.conftest import SLOW
from tests.service.serve_process import serve, wait_serving

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and " Z " not in Path(
        f"/proc/{pid}/stat").read_text()


def _start(model_dir: Path, log: Path) -> tuple[subprocess.Popen, grpc.Channel, list[int]]:
    proc, port = serve(model_dir, log, "--runner", "torch", "--tensor-parallel-size", "2",
                       "--enforce-eager", "--no-structured-output", "--metrics-port", "0")
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        wait_serving(proc, ch, log)
        reply = pb_grpc.GenerationServiceStub(ch).Generate(pb.GenerateRequest(
            prompt="Hello there", stopping=pb.StoppingCriteria(max_new_tokens=4),
            output=pb.OutputOptions(return_token_ids=True)), timeout=60)
        assert len(reply.completions[0].token_ids) == 4
        workers = _children(proc.pid)
        assert len(workers) == 1, log.read_text()
    except BaseException:
        ch.close()
        proc.kill()  # its worker follows (it watches its parent)
        proc.wait()
        raise
    return proc, ch, workers


def test_a_killed_worker_turns_health_not_serving_and_the_server_exits_non_zero(
        tiny_model_dir, tmp_path):
    log = tmp_path / "serve.log"
    proc, ch, workers = _start(tiny_model_dir, log)
    try:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(),
                                                     timeout=60)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        os.kill(workers[0], signal.SIGKILL)  # idle server: noticed between steps
        seen = []
        with contextlib.suppress(grpc.RpcError):  # the stream ends as the server stops
            seen.extend(r.status for r in watch)
        assert proc.wait(timeout=30) == 1, log.read_text()
        assert NOT_SERVING in seen, seen
        text = log.read_text()
        assert "tensor-parallel worker" in text and "exit status 1" in text, text
    finally:
        ch.close()
        if proc.poll() is None:
            proc.kill()


@pytest.mark.skipif(not SLOW, reason="GENSERVE_SLOW: a second "
                    "TP server; the drain's worker shutdown is covered by the runner tests")
def test_sigterm_drains_and_leaves_no_worker_behind(tiny_model_dir, tmp_path):
    log = tmp_path / "serve.log"
    proc, ch, workers = _start(tiny_model_dir, log)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
        assert not any(_alive(w) for w in workers), log.read_text()
    finally:
        ch.close()
        if proc.poll() is None:
            proc.kill()
