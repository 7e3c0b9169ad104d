"""A real ``genserve serve`` process meets a runaway grammar compile: health and other
requests keep answering, and SIGTERM exits within the grace with no compile left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import grpc
from grpc_health.v1 import health_pb2

from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from tests.service.serve_process import health, serve, wait_serving

RUNAWAY = pb.StructuredOutput(regex=r"(a{1,200}){1,200}",
                              backend=pb.STRUCTURED_BACKEND_LM_FORMAT_ENFORCER)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def _running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_compiling(pid: int, cpu_s: float, timeout: float) -> None:
    """Until one of ``pid``'s children (the compile workers) has computed ``cpu_s``: the
    runaway compile is under way (its worker imported, deep in the FSM)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(_cpu_seconds(c) >= cpu_s for c in _children(pid)):
            return
        time.sleep(0.2)
    raise AssertionError(f"no compile worker computed {cpu_s} s within {timeout} s")


def test_runaway_compile_never_stalls_the_server_or_its_shutdown(tiny_model_dir, tmp_path):
    log = tmp_path / "serve.log"
    proc, port = serve(tiny_model_dir, log, "--drain-grace-seconds", "5", "--enforce-eager",
                       "--structured-compile-timeout", "300",
                       "--structured-accelerate-after", "0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            wait_serving(proc, ch, log)
            stub = pb_grpc.GenerationServiceStub(ch)
            outcome: list[grpc.StatusCode] = []

            def hostile() -> None:
                try:
                    stub.Generate(pb.GenerateRequest(prompt="a", structured_output=RUNAWAY),
                                  timeout=120)
                    outcome.append(grpc.StatusCode.OK)
                except grpc.RpcError as e:
                    outcome.append(e.code())

            thread = threading.Thread(target=hostile)
            thread.start()
            _wait_compiling(proc.pid, cpu_s=5.0, timeout=60)
            assert thread.is_alive(), outcome
            start = time.perf_counter()
            assert health(ch) == health_pb2.HealthCheckResponse.SERVING
            r = stub.Generate(pb.GenerateRequest(
                prompt="hello", stopping=pb.StoppingCriteria(max_new_tokens=4)), timeout=60)
            assert r.usage.completion_tokens == 4
            assert time.perf_counter() - start < 30
            workers = _children(proc.pid)
            assert workers  # the compile runs in a worker process, not in the server
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0, log.read_text()  # grace 5 s: the compile is killed
            thread.join(30)
            assert outcome and outcome[0] != grpc.StatusCode.OK
        time.sleep(1)
        alive = [p for p in workers if _running(p)]
        assert not alive, f"compile workers left running: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
