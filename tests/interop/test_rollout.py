"""A rolling update without errors: two real replicas serve a steady load from the
Python client (round_robin over both, retrying UNAVAILABLE), and in the second case from
the Go example client too (round_robin over a DNS name that resolves to both, its retry
policy for UNAVAILABLE); one replica is sent SIGTERM mid-load and drains, and not one call
fails: health turns NOT_SERVING, GOAWAY moves the clients to the other replica at once,
in-flight calls finish on the draining one."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from genserve.client import Client, GenserveError
from tests.conftest import build_tiny_model
from tests.interop.conftest import ServerProcess, build_client, parse_results, run_client
from tests.interop.dns_stub import DnsStub
from tests.interop.test_load_balancing import HOSTS, NAME, _shared_free_port

WORKERS = 4
GO_WORKERS = 2
GO_PROMPTS = 8  # calls per Go client process (one channel): processes straddle the drain


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


@pytest.mark.parametrize("go_load", [False, True], ids=["python", "python+go"])
def test_draining_one_replica_under_load_fails_no_call(replicas, go_load):
    go_client = build_client("go") if go_load else None  # skips loudly without Go
    servers, port = replicas
    target = "ipv4:" + ",".join(f"{host}:{port}" for host in HOSTS)
    stop = threading.Event()
    done: list[str] = []
    failures: list[str] = []
    go_calls: list[float] = []  # when each Go client process that finished started

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

    def go_load_worker(worker: int, dns_port: int) -> None:
        # one Go client process after another, each making GO_PROMPTS calls (or one
        # stream) on its own channel: dns://STUB/NAME resolves to both replicas
        assert go_client is not None
        i = 0
        while not stop.is_set():
            started = time.monotonic()
            command = (["stream", f"go {worker} stream {i}"] if i % 3 == 2 else
                       ["generate", *(f"go {worker} call {i}.{j}" for j in range(GO_PROMPTS))])
            r = run_client(go_client, "--target", f"dns://127.0.0.1:{dns_port}/{NAME}:{port}",
                           "--timeout", "60s", "--max-new-tokens", "24", *command)
            results = parse_results(r.stdout, "generate")
            if r.returncode != 0 or (command[0] == "generate" and len(results) != GO_PROMPTS) \
                    or (command[0] == "stream" and "stream finish=" not in r.stdout):
                failures.append(f"go client rc={r.returncode}: {r.stderr.strip()[-500:]}")
            else:
                go_calls.append(started)
            i += 1

    with contextlib.ExitStack() as stack:
        threads = [threading.Thread(target=load, args=(w,)) for w in range(WORKERS)]
        if go_load:
            dns = stack.enter_context(DnsStub(NAME, list(HOSTS)))
            threads += [threading.Thread(target=go_load_worker, args=(w, dns.port))
                        for w in range(GO_WORKERS)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        before = len(done)
        drain_started = time.monotonic()
        servers[0].proc.send_signal(15)  # SIGTERM: what the kubelet sends after preStop
        assert servers[0].proc.wait(60) == 0, servers[0].log.read_text()
        time.sleep(1.5)  # the survivor carries the load alone
        stop.set()
        for t in threads:
            t.join(120)
    assert not failures, failures[:5]
    assert before >= WORKERS and len(done) > before + WORKERS, (before, len(done))
    print(f"python calls: {len(done)} ({before} before the drain); go client processes: "
          f"{len(go_calls)} ({sum(t < drain_started for t in go_calls)} started before it)")
    if go_load:  # Go client processes ran before, across and after the drain's start
        assert any(t < drain_started for t in go_calls), go_calls
        assert any(t > drain_started for t in go_calls), go_calls
    log = servers[0].log.read_text()
    assert "draining" in log and "stopped" in log
