"""A rolling update without errors: two real replicas serve a steady load from the
Python client (round_robin over both, retrying UNAVAILABLE), one is sent SIGTERM mid-load
and drains, and not one call fails: health turns NOT_SERVING, GOAWAY moves the clients to
the other replica at once, in-flight calls finish on the draining one."""

from __future__ import annotations

import threading
import time

import pytest

from genserve.client import Client, GenserveError
from tests.conftest import build_tiny_model
from tests.interop.conftest import ServerProcess
from tests.interop.test_load_balancing import HOSTS, _shared_free_port

WORKERS = 4


@pytest.fixture
def replicas(tmp_path, tokenizer_dir):
    port = _shared_free_port(HOSTS)
    model = build_tiny_model(tmp_path / "model", tokenizer_dir)
    servers = [ServerProcess(tmp_path / f"serve{i}.log", "--model", str(model),
                             "--max-model-len", "256", "--kv-cache-memory", "16MiB",
                             "--no-structured-output", "--drain-grace-seconds", "20",
                             host=host, port=port) for i, host in enumerate(HOSTS)]
    try:
        for server in servers:
            server.wait_serving()
        yield servers, port
    finally:
        for server in servers:
            server.stop()


def test_draining_one_replica_under_load_fails_no_call(replicas):
    servers, port = replicas
    target = "ipv4:" + ",".join(f"{host}:{port}" for host in HOSTS)
    stop = threading.Event()
    done: list[str] = []
    failures: list[str] = []

    def load(worker: int) -> None:
        # half the workers do not retry at all: GOAWAY alone must move them (the old drain,
        # answering UNAVAILABLE on a listener kept open, failed their calls)
        with Client(target, max_attempts=5 if worker % 2 else 1, timeout=60) as client:
            i = 0
            while not stop.is_set():
                try:
                    if i % 3 == 2:  # streams too: they must end normally, not be cut
                        with client.generate_stream(f"worker {worker} call {i}",
                                                    max_new_tokens=24) as stream:
                            text = "".join(chunk.text for chunk in stream)
                    else:
                        text = client.generate(f"worker {worker} call {i}",
                                               max_new_tokens=24).text
                    done.append(text)
                except GenserveError as e:
                    failures.append(f"{e.code.name}: {e}")
                i += 1

    threads = [threading.Thread(target=load, args=(w,)) for w in range(WORKERS)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    before = len(done)
    servers[0].proc.send_signal(15)  # SIGTERM: what the kubelet sends after preStop
    assert servers[0].proc.wait(60) == 0, servers[0].log.read_text()
    time.sleep(1.5)  # the survivor carries the load alone
    stop.set()
    for t in threads:
        t.join(60)
    assert not failures, failures[:5]
    assert before >= WORKERS and len(done) > before + WORKERS, (before, len(done))
    log = servers[0].log.read_text()
    assert "draining" in log and "stopped" in log
