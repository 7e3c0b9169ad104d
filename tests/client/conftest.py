"""Client tests: ``genserve.client`` and ``genserve generate`` against real in-process servers.

``server`` is one genserve gRPC server for all of tests/client (package scope: it stops
when the directory is done), on the real ``AsyncEngine`` over the tiny random model with
structured output on; ``make_echo_server`` starts servers on the fast fake echo engine
(TLS ones too). All come from ``tests/service/conftest.py``'s helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.config import EngineConfig
from tests.service.conftest import (  # noqa: F401  (structured_outputs is a fixture)
    MAX_MODEL_LEN,
    RunningServer,
    start_server,
    stop_server,
    structured_outputs,
)
from tests.service.fake_engine import FakeEngine


@pytest.fixture(scope="package")
def server(tiny_model_dir, structured_outputs) -> Iterator[RunningServer]:  # noqa: F811
    running, _ = start_server(
        EngineConfig(model=str(tiny_model_dir), max_model_len=MAX_MODEL_LEN, max_waiting=64,
                     kv_cache_memory=64 * 2**20),
        structured_outputs=structured_outputs)
    yield running
    stop_server(running)


@pytest.fixture(scope="package")
def address(server: RunningServer) -> str:
    return server.address


@pytest.fixture(scope="package")
def make_echo_server(tokenizer, tiny_model_dir) -> Iterator[Callable[..., RunningServer]]:
    """``make_echo_server(**ServerConfig fields)``: a fake-engine server, stopped when
    tests/client is done."""
    started: list[RunningServer] = []

    def make(**server_kw) -> RunningServer:
        engine = FakeEngine(tokenizer, EngineConfig(model=str(tiny_model_dir),
                                                    max_model_len=MAX_MODEL_LEN))
        running, _ = start_server(engine, structured=None, **server_kw)
        started.append(running)
        return running

    yield make
    for running in started:
        stop_server(running)


@dataclass
class TlsFiles:
    ca: Path  # the CA that signed the server and client certificates
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory) -> TlsFiles:
    """A throw-away CA, a server certificate for localhost/127.0.0.1 and a client one."""
    from tests.service.test_tls import make_ca, make_leaf

    d = tmp_path_factory.mktemp("tls")
    ca, ca_key, ca_cert = make_ca("genserve test CA")
    server = make_leaf(ca_key, ca_cert, "localhost", server=True)
    client = make_leaf(ca_key, ca_cert, "genserve client", server=False)
    files = TlsFiles(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem",
                     d / "client.key")
    for path, data in ((files.ca, ca.cert), (files.server_cert, server.cert),
                       (files.server_key, server.key), (files.client_cert, client.cert),
                       (files.client_key, client.key)):
        path.write_bytes(data)
    return files


@pytest.fixture(scope="package")
def tls_server(make_echo_server, tls_files) -> RunningServer:
    return make_echo_server(tls_cert=str(tls_files.server_cert),
                            tls_key=str(tls_files.server_key))


@pytest.fixture(scope="package")
def mtls_server(make_echo_server, tls_files) -> RunningServer:
    return make_echo_server(tls_cert=str(tls_files.server_cert),
                            tls_key=str(tls_files.server_key),
                            tls_client_ca=str(tls_files.ca))
