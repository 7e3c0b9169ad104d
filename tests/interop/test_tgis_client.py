"""An existing TGIS client, unchanged, against genserve: the Go ``tgis-client`` is built from
the upstream fmaas proto only and must read what the Python fmaas stubs read from the same
real ``genserve serve --model default``."""

from __future__ import annotations

import json

import grpc
import pytest

from fmaas import generation_pb2 as tgis
from fmaas import generation_pb2_grpc as tgis_grpc
from tests.interop.conftest import REPO, ServerProcess, build_client, run_client

MAX_NEW = 8
CAP = 64
PROMPTS = ["The capital of France is", "Café au lait, s'il vous plaît:\n"]


@pytest.fixture(scope="module")
def tgis_client() -> list[str]:
    build_client("go")  # builds both Go clients, or skips loudly without the toolchain
    return [str(REPO / "clients/go/bin/tgis-client")]


@pytest.fixture(scope="module")
def server(tgis_client, tmp_path_factory):
    # The clients must give what the Python stubs get for the same requests: a server
    # whose greedy output depends on neither batch mates nor what it has cached.
    proc = ServerProcess(tmp_path_factory.mktemp("tgis") / "serve.log", "--model", "default",
                         "--max-model-len", "512", "--kv-cache-memory", "64MiB",
                         "--max-new-tokens", str(CAP), "--batch-invariant",
                         "--no-enable-prefix-caching")
    try:
        proc.wait_serving()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield tgis_grpc.GenerationServiceStub(channel)


def _params() -> tgis.Parameters:
    return tgis.Parameters(stopping=tgis.StoppingCriteria(max_new_tokens=MAX_NEW),
                           response=tgis.ResponseOptions(generated_tokens=True))


def _lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def _go(tgis_client, server, *args: str):
    return run_client(tgis_client, "-target", server.address, "-max-new-tokens", str(MAX_NEW),
                      *args)


def test_generate_matches_the_python_fmaas_stubs(tgis_client, server, stub):
    expected = stub.Generate(tgis.BatchedGenerationRequest(
        requests=[tgis.GenerationRequest(text=p) for p in PROMPTS], params=_params()),
        timeout=120).responses
    r = _go(tgis_client, server, "generate", *PROMPTS)
    assert r.returncode == 0, r.stderr
    got = _lines(r.stdout)
    assert [g["index"] for g in got] == [0, 1]
    for g, e in zip(got, expected, strict=True):
        assert g["text"] == e.text
        assert g["generated_token_count"] == e.generated_token_count
        assert g["input_token_count"] == e.input_token_count > 0
        assert g["stop_reason"] == tgis.StopReason.Name(e.stop_reason)
        assert g["tokens"] == e.generated_token_count


def test_stream_sends_input_details_then_deltas(tgis_client, server, stub):
    (expected,) = stub.Generate(tgis.BatchedGenerationRequest(
        requests=[tgis.GenerationRequest(text=PROMPTS[0])], params=_params()),
        timeout=120).responses
    r = _go(tgis_client, server, "stream", PROMPTS[0])
    assert r.returncode == 0, r.stderr
    msgs = _lines(r.stdout)
    head, deltas = msgs[0], msgs[1:]
    assert head["input_token_count"] == expected.input_token_count
    assert head["generated_token_count"] == 0 and head["text"] == ""
    assert "".join(m["text"] for m in deltas) == expected.text
    assert deltas[-1]["generated_token_count"] == expected.generated_token_count
    assert deltas[-1]["stop_reason"] == tgis.StopReason.Name(expected.stop_reason)
    assert all(m["stop_reason"] == "NOT_FINISHED" for m in deltas[:-1])


def test_model_info_and_a_refused_request(tgis_client, server):
    r = _go(tgis_client, server, "info")
    assert r.returncode == 0, r.stderr
    assert _lines(r.stdout) == [{"model_kind": "DECODER_ONLY", "max_sequence_length": 512,
                                 "max_new_tokens": CAP}]
    r = run_client(tgis_client, "-target", server.address, "-max-new-tokens", str(CAP + 1),
                   "generate", PROMPTS[0])
    assert r.returncode == 1
    assert f"InvalidArgument: max_new_tokens must be <= {CAP}" in r.stderr
