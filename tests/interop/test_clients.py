"""The Go, Java and Node example clients against a real ``genserve serve --model default``.

Every client must print what the Python stubs get from the same server: the same greedy
text for the same prompt and max_new_tokens, per-item errors in GenerateBatch, stream
chunks in order, and gRPC status codes turned into clear messages.
"""

from __future__ import annotations

import json
import re
import subprocess

import grpc
import pytest

from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from tests.interop.conftest import (
    REPO,
    ServerProcess,
    build_client,
    free_port,
    go_binary,
    parse_results,
    require_some_toolchain,
    run_client,
)

MAX_NEW_TOKENS = 8
PROMPTS = ["The capital of France is", "Café au lait, s'il vous plaît:\n"]
STREAM_PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One real server with the default model for the whole module (loading takes ~20 s)."""
    require_some_toolchain()
    # The clients must give what the Python stubs get for the same requests: a server
    # whose greedy output depends on neither batch mates nor what it has cached.
    proc = ServerProcess(tmp_path_factory.mktemp("interop") / "serve.log", "--model",
                         "default", "--max-model-len", "512", "--kv-cache-memory", "64MiB",
                         "--batch-invariant", "--no-enable-prefix-caching")
    try:
        proc.wait_serving()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def python_texts(server) -> dict[str, str]:
    """Greedy completions from the Python stubs: what every client must print."""
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        texts = {}
        for prompt in [*PROMPTS, STREAM_PROMPT]:
            resp = stub.Generate(pb.GenerateRequest(
                prompt=prompt, stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW_TOKENS)),
                timeout=60)
            assert resp.usage.completion_tokens == MAX_NEW_TOKENS  # so LENGTH below
            texts[prompt] = resp.completions[0].text
    return texts


def _args(server, *rest: str) -> list[str]:
    return ["--target", server.address, "--timeout", "60s",
            "--max-new-tokens", str(MAX_NEW_TOKENS), *rest]


def test_health_check(client, server):
    r = run_client(client, *_args(server, "health"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "health: SERVING"


def test_generate_matches_python_stubs(client, server, python_texts):
    r = run_client(client, *_args(server, "generate", *PROMPTS))
    assert r.returncode == 0, r.stderr
    results = parse_results(r.stdout, "generate")
    assert sorted(results) == [0, 1], r.stdout
    for i, prompt in enumerate(PROMPTS):
        assert results[i].text == python_texts[prompt]
        assert results[i].finish == "LENGTH"
        assert results[i].completion_tokens == MAX_NEW_TOKENS


def test_batch_error_per_item(client, server, python_texts):
    # item 1 is invalid (an empty prompt): INVALID_ARGUMENT for it alone
    r = run_client(client, *_args(server, "batch", PROMPTS[0], "", PROMPTS[1]))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1] == "batch[1] error: invalid request: prompt must not be empty", r.stdout
    results = parse_results(r.stdout, "batch")
    assert sorted(results) == [0, 2], r.stdout
    assert results[0].text == python_texts[PROMPTS[0]]
    assert results[2].text == python_texts[PROMPTS[1]]


def test_stream_chunks_in_order(client, server, python_texts):
    r = run_client(client, *_args(server, "stream", STREAM_PROMPT))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    chunks = [ln for ln in lines if ln.startswith("chunk[")]
    assert [c.split("]", 1)[0] for c in chunks] == [f"chunk[{i}" for i in range(len(chunks))]
    texts = [json.loads(c.split("] ", 1)[1]) for c in chunks]
    assert len([t for t in texts if t]) > 1, "the text came in one piece: not streamed"
    assert "".join(texts) == python_texts[STREAM_PROMPT]
    last = re.fullmatch(r'stream finish=(\w+) completion_tokens=(\d+) text=(".*")', lines[-1])
    assert last, r.stdout
    assert last.group(1) == "LENGTH" and int(last.group(2)) == MAX_NEW_TOKENS
    assert json.loads(last.group(3)) == python_texts[STREAM_PROMPT]


def test_invalid_argument_is_explained(client, server):
    r = run_client(client, *_args(server, "--top-p", "1.5", "generate", "Hi"))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "error: invalid request: sampling.top_p must be in (0, 1], got 1.5")
    assert r.stdout == ""


def test_deadline_is_explained(client, server):
    # The answer (a story of some 25+ tokens before EOS, or 256) cannot be generated in
    # 50 ms on this CPU, even by the llama.cpp runner (~9 ms a token): the deadline passes
    r = run_client(client, "--target", server.address, "--timeout", "50ms",
                   "--max-new-tokens", "256", "generate", "Tell me a long story")
    assert r.returncode == 1
    assert "error: deadline exceeded" in r.stderr


def test_unavailable_is_explained(client):
    r = run_client(client, "--target", f"127.0.0.1:{free_port()}", "--timeout", "10s",
                   "health")
    assert r.returncode == 1
    assert "error: server unavailable (not running, still loading the model, or draining)" \
        in r.stderr


def test_go_client_is_a_module_build(server):
    """clients/build.sh builds the Go module with its vendored grpc-go 1.64, not GOPATH."""
    command = build_client("go")
    go = go_binary()
    assert go is not None
    info = subprocess.run([go, "version", "-m", command[0]], capture_output=True, text=True,
                          check=True).stdout
    deps = dict(line.split("\t")[2:4] for line in info.splitlines()
                if line.startswith("\tdep\t"))
    assert "\tmod\tgithub.com/genserve/genserve/clients/go\t" in info, info
    assert deps["google.golang.org/grpc"] == "v1.64.0", info
    # every module the binary was built from is in go.mod, vendor/modules.txt and go.sum
    go_dir = REPO / "clients/go"
    sums = (go_dir / "go.sum").read_text()
    for mod, version in deps.items():
        assert f"{mod} {version} h1:" in sums and f"{mod} {version}/go.mod h1:" in sums
        assert f"# {mod} {version}\n" in (go_dir / "vendor/modules.txt").read_text()
        assert f"\t{mod} {version}" in (go_dir / "go.mod").read_text()
    r = run_client(command, *_args(server, "generate", PROMPTS[0]))
    assert r.returncode == 0, r.stderr


def test_java_client_is_a_maven_build(server):
    """clients/build.sh builds clients/java/pom.xml with Maven: its jar runs on its own."""
    build_client("java")
    jar = REPO / "clients/java/target/genserve-client.jar"
    props = (REPO / "clients/java/target/maven-archiver/pom.properties").read_text()
    assert "artifactId=genserve-client" in props
    r = run_client(["java", "-jar", str(jar)], *_args(server, "generate", PROMPTS[0]))
    assert r.returncode == 0, r.stderr
    assert parse_results(r.stdout, "generate")[0].finish == "LENGTH"
