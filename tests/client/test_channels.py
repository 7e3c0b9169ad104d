"""Client channels: TLS / mTLS, round_robin over two replicas, retries of UNAVAILABLE."""

from __future__ import annotations

import contextlib
import time

import grpc
import pytest

from genserve.client import Client, GenserveError

Code = grpc.StatusCode


def _generate_ok(running) -> float:
    value = running.server.metrics.registry.get_sample_value(
        "genserve_requests_total", {"rpc": "Generate", "code": "OK"})
    return value or 0.0


def test_tls_with_a_root_certificate_file(tls_server, tls_files):
    with Client(tls_server.address, root_certificates=str(tls_files.ca), timeout=30) as c:
        assert c.health() == "SERVING"
        assert c.generate("Hello there", max_new_tokens=3).usage.completion_tokens == 3
    # the name checked against the certificate: localhost is in its SANs
    with Client(tls_server.address, root_certificates=tls_files.ca.read_bytes(),
                server_name="localhost", timeout=30) as c:
        assert c.health() == "SERVING"


def test_tls_refuses_an_untrusted_server_and_plaintext(tls_server):
    with Client(tls_server.address, tls=True, timeout=5) as c:  # system roots only
        with pytest.raises(GenserveError) as e:
            c.health()
        assert e.value.code == Code.UNAVAILABLE
    with Client(tls_server.address, timeout=5) as c:
        with pytest.raises(GenserveError) as e:
            c.health()
        assert e.value.code == Code.UNAVAILABLE


def test_mtls_needs_the_client_certificate(mtls_server, tls_files):
    with Client(mtls_server.address, root_certificates=tls_files.ca.read_bytes(),
                certificate_chain=tls_files.client_cert.read_bytes(),
                private_key=str(tls_files.client_key), timeout=30) as c:
        assert c.generate("Hello there", max_new_tokens=2).usage.completion_tokens == 2
    with Client(mtls_server.address, root_certificates=str(tls_files.ca), timeout=5) as c:
        with pytest.raises(GenserveError) as e:
            c.health()
        assert e.value.code == Code.UNAVAILABLE


@pytest.fixture(scope="module")
def replicas(make_echo_server):
    return make_echo_server(), make_echo_server()


def _target(replicas) -> str:
    return "ipv4:" + ",".join(r.address for r in replicas)


@pytest.mark.parametrize("policy", ["round_robin", "pick_first"])
def test_load_balancing(replicas, policy):
    before = [_generate_ok(r) for r in replicas]
    with Client(_target(replicas), load_balancing=policy, wait_for_ready=True,
                timeout=30) as c:
        c.wait_until_serving(10)
        for i in range(8):
            assert c.generate(f"call {i}", max_new_tokens=2).usage.completion_tokens == 2
    got = [_generate_ok(r) - b for r, b in zip(replicas, before, strict=True)]
    assert sum(got) == 8
    if policy == "round_robin":
        assert min(got) >= 2, got  # spread per call over both replicas
    else:
        assert max(got) == 8, got  # one connection, one replica


@contextlib.contextmanager
def _draining(running):
    """The replica answers generation calls UNAVAILABLE, as at the end of a drain."""
    running.server.state.closing = True
    try:
        yield
    finally:
        running.server.state.closing = False


def test_unavailable_is_retried_on_another_replica(replicas):
    with _draining(replicas[0]):
        with Client(_target(replicas), timeout=30) as c:
            c.wait_until_serving(10, service="")
            codes = []
            for i in range(6):
                try:
                    c.generate(f"call {i}", max_new_tokens=2)
                    codes.append(Code.OK)
                except GenserveError as e:
                    codes.append(e.code)
                    assert "shutting down" in e.details
        assert Code.UNAVAILABLE in codes and Code.OK in codes  # no retries: half fail
        with Client(_target(replicas), max_attempts=3, timeout=30) as c:
            for i in range(6):
                assert c.generate(f"call {i}", max_new_tokens=2).usage.completion_tokens == 2


def test_round_robin_sends_no_call_to_a_replica_whose_health_is_not_serving(replicas):
    """The client watches each replica's health: one that turns NOT_SERVING (a drain
    starting) gets no new calls, before any GOAWAY; back to SERVING, it gets them again."""
    from grpc_health.v1 import health_pb2

    def health(running, status):
        running.call(lambda: running.server._set_health(status))

    with Client(_target(replicas), timeout=30, wait_for_ready=True) as c:
        c.wait_until_serving(10, service="")
        health(replicas[0], health_pb2.HealthCheckResponse.NOT_SERVING)
        time.sleep(0.5)  # the watch's update reaching the client's channel
        try:
            before = [_generate_ok(r) for r in replicas]
            for i in range(8):
                assert c.generate(f"call {i}", max_new_tokens=2).usage.completion_tokens == 2
            got = [_generate_ok(r) - b for r, b in zip(replicas, before, strict=True)]
            assert got == [0, 8], got
        finally:
            health(replicas[0], health_pb2.HealthCheckResponse.SERVING)
