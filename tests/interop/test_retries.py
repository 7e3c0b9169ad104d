"""The Go, Java and Node example clients retry calls answered UNAVAILABLE (their service
config's retry policy), and only those.

A stand-in GenerationService (no model) answers the first calls UNAVAILABLE, as a
draining or not yet ready replica would, then succeeds: the client must print the result
after that many attempts, each seen by the server. ``--max-attempts 1`` drops the policy,
and a code that is not UNAVAILABLE is never retried.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from tests.interop.conftest import parse_results, run_client


class FlakyService(pb_grpc.GenerationServiceServicer):
    """Answers the first ``fail`` Generate calls with ``code``, the rest with "ok"."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fail = 0
        self.code = grpc.StatusCode.UNAVAILABLE
        self.attempts = 0

    def Generate(self, request, context):  # noqa: N802 (gRPC's method name)
        with self.lock:
            self.attempts += 1
            failing = self.attempts <= self.fail
        if failing:
            context.abort(self.code, "replica draining")
        return pb.GenerateResponse(
            completions=[pb.Completion(text=" ok", finish_reason=pb.FINISH_REASON_LENGTH)],
            usage=pb.Usage(completion_tokens=1))


@pytest.fixture(scope="module")
def flaky():
    service = FlakyService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield service, f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def _generate(client, address, *flags):
    return run_client(client, "--target", address, "--timeout", "20s", "--max-new-tokens",
                      "1", *flags, "generate", "Hi", timeout=60)


def test_unavailable_is_retried(client, flaky):
    service, address = flaky
    service.fail, service.code, service.attempts = 2, grpc.StatusCode.UNAVAILABLE, 0
    r = _generate(client, address)
    assert r.returncode == 0, r.stderr
    assert parse_results(r.stdout, "generate")[0].text == " ok"
    assert service.attempts == 3  # two UNAVAILABLE answers, then the one that succeeded


@pytest.mark.parametrize(("max_attempts", "fail"), [(3, 10), (1, 1)])
def test_attempts_are_capped_by_max_attempts(client, flaky, max_attempts, fail):
    service, address = flaky
    service.fail, service.code, service.attempts = fail, grpc.StatusCode.UNAVAILABLE, 0
    r = _generate(client, address, "--max-attempts", str(max_attempts))
    assert r.returncode == 1
    assert "error: server unavailable" in r.stderr
    assert service.attempts == max_attempts


def test_other_codes_are_not_retried(client, flaky):
    service, address = flaky
    service.fail, service.code, service.attempts = 1, grpc.StatusCode.RESOURCE_EXHAUSTED, 0
    r = _generate(client, address)
    assert r.returncode == 1
    assert "error: server overloaded" in r.stderr
    assert service.attempts == 1
