"""round_robin spreads calls per request across replicas, as behind a headless Service.

Two real ``genserve serve`` processes listen on the same port of two loopback addresses
(127.0.0.1 and 127.0.0.2), like two pods behind one DNS name. Each serves a different
tiny random model, so a call's greedy completion tells which replica answered it (and,
where the server has Prometheus metrics, its ``genserve_requests_total`` must agree).

- Python stubs: an ``ipv4:`` target listing both, round_robin vs pick_first.
- Go and Node example clients: a ``dns://DNS-SERVER/NAME:PORT`` target whose name a stub
  DNS server resolves to both addresses (the headless-Service case; in a cluster the
  system resolver does this for ``dns:///NAME:PORT``).
- Java: ``dns:///`` through the JDK resolver, given a hosts file naming both addresses.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass

import grpc
import pytest

from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from tests.conftest import build_tiny_model
from tests.interop.conftest import (
    LANGS,
    ServerProcess,
    build_client,
    free_port,
    parse_results,
    run_client,
)
from tests.interop.dns_stub import DnsStub

HOSTS = ("127.0.0.1", "127.0.0.2")
NAME = "genserve.test"
PROMPT = "The quick brown fox"
MAX_NEW_TOKENS = 6
CALLS = 8


@dataclass
class Replicas:
    servers: list[ServerProcess]
    port: int
    texts: list[str]  # each replica's greedy completion of PROMPT: who served a call

    def counts(self, texts: list[str]) -> list[int]:
        """Calls served by each replica, from the completions they returned."""
        unknown = [t for t in texts if t not in self.texts]
        assert not unknown, f"completions from neither replica: {unknown}"
        return [texts.count(t) for t in self.texts]

    def metrics(self) -> list[float | None]:
        return [s.requests_ok("Generate") for s in self.servers]

    def check_spread(self, texts: list[str], before: list[float | None]) -> list[int]:
        counts = self.counts(texts)
        assert len(texts) == CALLS
        # round_robin over two READY replicas alternates; allow for a replica that was
        # still connecting during the first call or two
        assert min(counts) >= CALLS // 4, f"calls per replica: {counts}"
        after = self.metrics()
        print(f"calls per replica: {counts}; Generate OK counters {before} -> {after}")
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            if a is not None and b is not None:  # the server's own request counter agrees
                assert a - b == counts[i], (i, before, after, counts)
        return counts


def _shared_free_port(hosts) -> int:
    """A port free on every one of ``hosts``."""
    for _ in range(50):
        port = free_port(hosts[0])
        try:
            for host in hosts[1:]:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on all of {hosts}")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tokenizer_dir):
    d = tmp_path_factory.mktemp("lb")
    port = _shared_free_port(HOSTS)
    servers: list[ServerProcess] = []
    try:
        for i, host in enumerate(HOSTS):
            model = build_tiny_model(d / f"model{i}", tokenizer_dir, seed=i)
            servers.append(ServerProcess(
                d / f"serve{i}.log", "--model", str(model), "--max-model-len", "256",
                "--kv-cache-memory", "16MiB", "--no-structured-output", host=host, port=port))
        for server in servers:
            server.wait_serving()
        texts = []
        for server in servers:
            with grpc.insecure_channel(server.address) as channel:
                texts.append(_generate(pb_grpc.GenerationServiceStub(channel)))
        assert texts[0] != texts[1], "both tiny models complete the prompt alike"
        yield Replicas(servers, port, texts)
    finally:
        for server in servers:
            server.stop()


def _generate(stub) -> str:
    return stub.Generate(pb.GenerateRequest(
        prompt=PROMPT, stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW_TOKENS)),
        timeout=60).completions[0].text


@pytest.mark.parametrize("policy", ["round_robin", "pick_first"])
def test_python_stubs(replicas, policy):
    target = "ipv4:" + ",".join(f"{host}:{replicas.port}" for host in HOSTS)
    config = json.dumps({"loadBalancingConfig": [{policy: {}}]})
    before = replicas.metrics()
    with grpc.insecure_channel(target, options=[("grpc.service_config", config)]) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        texts = [_generate(stub) for _ in range(CALLS)]
    if policy == "round_robin":
        replicas.check_spread(texts, before)
    else:  # the default policy pins the channel to one replica: all calls go there
        assert sorted(replicas.counts(texts)) == [0, CALLS]


@pytest.mark.parametrize("lang", LANGS)
def test_example_client_spreads_calls(lang, replicas, tmp_path):
    command = build_client(lang)
    args = ["--timeout", "60s", "--max-new-tokens", str(MAX_NEW_TOKENS),
            "generate", *[PROMPT] * CALLS]
    before = replicas.metrics()
    if lang == "java":
        # grpc-java resolves dns:/// with the JDK resolver: a hosts file of two addresses
        hosts = tmp_path / "hosts"
        hosts.write_text("".join(f"{host} {NAME}\n" for host in HOSTS))
        r = run_client(command, "--target", f"dns:///{NAME}:{replicas.port}", *args,
                       env={"JDK_JAVA_OPTIONS": f"-Djdk.net.hosts.file={hosts}"})
    else:
        # grpc-js asks the dns:// authority's server only with its alternative resolver
        env = {"GRPC_NODE_USE_ALTERNATIVE_RESOLVER": "true"} if lang == "node" else None
        with DnsStub(NAME, list(HOSTS)) as dns:
            r = run_client(command, "--target",
                           f"dns://127.0.0.1:{dns.port}/{NAME}:{replicas.port}", *args, env=env)
        assert (NAME, 1) in dns.queries, dns.queries  # resolved through DNS (A records)
    assert r.returncode == 0, r.stderr
    results = parse_results(r.stdout, "generate")
    assert sorted(results) == list(range(CALLS)), r.stdout
    replicas.check_spread([results[i].text for i in range(CALLS)], before)
