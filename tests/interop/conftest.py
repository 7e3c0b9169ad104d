"""Interop tests: the Go, Java and Node example clients (clients/) against real servers.

Each language's client is built once per session with ``clients/build.sh LANG`` (what
``make clients`` runs). A language whose toolchain is missing is skipped loudly (a
warning plus a skip telling to run ``make interop-deps``); with
``GENSERVE_REQUIRE_INTEROP=1`` (set by ``.ci/run``) a missing toolchain fails instead.
Servers are real ``genserve serve`` processes on local ports, started once per module.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
LANGS = ("go", "java", "node")

# What each language's build needs, as `make interop-deps` installs it.
TOOLCHAINS = {
    "go": ["protoc", "protoc-gen-go", "protoc-gen-go-grpc", "go>=1.21"],
    # Maven offline from Debian's repository: grpc-java and the plugins the pom pins
    "java": ["protoc", "java", "mvn", "/usr/bin/grpc_java_plugin",
             *(f"/usr/share/maven-repo/{a}" for a in (
                 "io/grpc/grpc-netty/1.41.3", "io/netty/netty-codec-http2/debian",
                 "org/apache/geronimo/specs/geronimo-annotation_1.3_spec/1.3",
                 "org/apache/maven/plugins/maven-compiler-plugin/3.10.1",
                 "org/apache/maven/plugins/maven-dependency-plugin/3.5.0",
                 "org/apache/maven/plugins/maven-surefire-plugin/2.22.3",
                 "org/codehaus/mojo/exec-maven-plugin/3.1.0",
                 "org/codehaus/mojo/build-helper-maven-plugin/3.3.0"))],
    "node": ["node", "npm"],
}
COMMANDS = {
    "go": [str(REPO / "clients/go/bin/genserve-client")],
    "java": [str(REPO / "clients/java/build/genserve-client")],
    "node": ["node", str(REPO / "clients/node/genserve-client.js")],
}


def go_binary() -> str | None:
    """The Go toolchain clients/build.sh uses ($GO, bookworm-backports' Go 1.23, or go on
    the PATH) if it is Go >= 1.21, which the vendored dependencies need; else None."""
    go = os.environ.get("GO") or next(
        (g for g in ("/usr/lib/go-1.23/bin/go", shutil.which("go")) if g and Path(g).exists()),
        None)
    if go is None:
        return None
    version = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True,
                             env={**os.environ, "GOTOOLCHAIN": "local"}).stdout
    m = re.match(r"go1\.(\d+)", version.strip())
    return go if m and int(m.group(1)) >= 21 else None


def _present(tool: str) -> bool:
    if tool == "go>=1.21":
        return go_binary() is not None
    return Path(tool).exists() if tool.startswith("/") else shutil.which(tool) is not None


def _missing(lang: str) -> list[str]:
    return [t for t in TOOLCHAINS[lang] if not _present(t)]


_built: dict[str, str | None] = {}  # lang -> None (built) or why it was skipped


def build_client(lang: str) -> list[str]:
    """Build ``lang``'s client once per session; its command line. Skips loudly if the
    toolchain is absent; a build that fails with the toolchain present is a failure."""
    if lang not in _built:
        missing = _missing(lang)
        if missing:
            _built[lang] = (f"{lang} client not tested: {', '.join(missing)} not found; "
                            "run `make interop-deps` (as root) to install the toolchains")
        else:
            proc = subprocess.run([str(REPO / "clients/build.sh"), lang], cwd=REPO,
                                  capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, (
                f"clients/build.sh {lang} failed:\n{proc.stdout}\n{proc.stderr}")
            _built[lang] = None
    reason = _built[lang]
    if reason is not None:
        if os.environ.get("GENSERVE_REQUIRE_INTEROP") == "1":
            pytest.fail(f"GENSERVE_REQUIRE_INTEROP=1 but {reason}")
        warnings.warn(reason, stacklevel=2)
        pytest.skip(reason)
    return COMMANDS[lang]


def require_some_toolchain() -> None:
    """Skip (loudly) before starting servers when no client could be built at all."""
    if all(_missing(lang) for lang in LANGS):
        build_client(LANGS[0])


@pytest.fixture(params=LANGS)
def client(request) -> list[str]:
    """The command line of one language's built example client."""
    return build_client(request.param)


def run_client(command: list[str], *args: str, env: dict | None = None,
               timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*command, *args], capture_output=True, text=True,
                          encoding="utf-8", timeout=timeout,
                          env={**os.environ, **(env or {})})


_RESULT = re.compile(r"^(generate|batch)\[(\d+)\] (?:ok )?finish=(\w+) "
                     r"completion_tokens=(\d+) text=(\".*\")$")


@dataclass
class Result:
    index: int
    finish: str
    completion_tokens: int
    text: str


def parse_results(stdout: str, kind: str) -> dict[int, Result]:
    """``generate[i] ...`` / ``batch[i] ok ...`` lines, by index."""
    out = {}
    for line in stdout.splitlines():
        m = _RESULT.match(line)
        if m and m.group(1) == kind:
            out[int(m.group(2))] = Result(int(m.group(2)), m.group(3), int(m.group(4)),
                                          json.loads(m.group(5)))
    return out


# --- real genserve server processes ---------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def health_status(channel) -> int | None:
    try:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=1).status
    except grpc.RpcError:
        return None


_serve_help: str | None = None


def serve_supports(flag: str) -> bool:
    """Whether this checkout's ``genserve serve`` has ``flag`` (read from its --help)."""
    global _serve_help
    if _serve_help is None:
        import contextlib
        import io

        from service.cli import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(["serve", "--help"])
        _serve_help = out.getvalue()
    return flag in _serve_help


class ServerProcess:
    """``genserve serve ARGS --host HOST --port PORT`` as a subprocess, its log in a file.

    Prometheus metrics, where the server has them, go to a free port of their own
    (``metrics_port``), never to the fixed default another test's server may hold.
    """

    def __init__(self, log: Path, *args: str, host: str = "127.0.0.1",
                 port: int | None = None) -> None:
        self.host, self.port = host, port or free_port(host)
        self.address = f"{host}:{self.port}"
        self.log = log
        self.metrics_port: int | None = None
        if serve_supports("--enforce-eager"):  # no compile: the clients are under test
            args = (*args, "--enforce-eager")
        if serve_supports("--metrics-port"):
            self.metrics_port = free_port(host)
            args = (*args, "--metrics-port", str(self.metrics_port))
        exe = Path(sys.executable).with_name("genserve")
        cli = [str(exe)] if exe.exists() else [sys.executable, "-m", "service.cli"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'protos'}"}
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [*cli, "serve", *args, "--host", host, "--port", str(self.port)],
                cwd=REPO, env=env, stdout=out, stderr=out)

    def wait_serving(self, timeout: float = 300) -> None:
        end = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            while health_status(channel) != health_pb2.HealthCheckResponse.SERVING:
                if self.proc.poll() is not None or time.monotonic() > end:
                    self.stop()
                    pytest.fail(f"genserve serve on {self.address} never became SERVING:\n"
                                f"{self.log.read_text()[-4000:]}")
                time.sleep(0.3)

    def requests_ok(self, rpc: str) -> float | None:
        """``genserve_requests_total{rpc=RPC,code="OK"}`` scraped from the server's
        metrics endpoint; None when this server has no metrics or no such series."""
        if self.metrics_port is None:
            return None
        import urllib.request

        url = f"http://{self.host}:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("genserve_requests_total{") and f'rpc="{rpc}"' in line
                  and 'code="OK"' in line]
        return sum(values) if values else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
