"""``genserve generate``: the CLI over genserve.client, against real in-process servers."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from genserve.client import Client
from service.cli import main

REPO = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(address):
    with Client(address, timeout=60) as c:
        yield c


@pytest.fixture(autouse=True)
def _keep_logging(capsys):
    """main() points the root logger at the (captured) stderr: put pytest's back after.
    Taking ``capsys`` makes this teardown run before capsys closes that stream, so a line
    the in-process server logs meanwhile never hits a closed file."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prints_the_text(capsys, address, client):
    code, out, err = run(capsys, PROMPT, "--address", address, "--max-new-tokens", "8")
    assert code == 0, err
    assert out == client.generate(PROMPT, max_new_tokens=8).text + "\n"


def test_stream_prints_the_same_text(capsys, address, client):
    code, out, err = run(capsys, PROMPT, "--address", address, "--max-new-tokens", "8",
                         "--stream")
    assert code == 0, err
    assert out == client.generate(PROMPT, max_new_tokens=8).text + "\n"


def test_json(capsys, address, client):
    code, out, _ = run(capsys, PROMPT, "--address", address, "--max-new-tokens", "8", "--json")
    assert code == 0
    data = json.loads(out)
    expected = client.generate(PROMPT, max_new_tokens=8)
    assert data["completions"] == [{"index": 0, "text": expected.text,
                                     "finish_reason": "length"}]
    assert data["usage"]["completion_tokens"] == 8 and data["request_id"]


def test_stream_json_lines(capsys, address, client):
    code, out, _ = run(capsys, PROMPT, "--address", address, "--max-new-tokens", "8",
                       "--stream", "--json")
    assert code == 0
    chunks = [json.loads(line) for line in out.splitlines()]
    assert "".join(c["text"] for c in chunks) == client.generate(PROMPT, max_new_tokens=8).text
    assert chunks[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert all("usage" not in c for c in chunks[:-1])


def test_sampling_and_stop_flags(capsys, address, client):
    expected = client.generate(PROMPT, max_new_tokens=8, temperature=0.8, top_p=0.9, top_k=50,
                               seed=11)
    code, out, _ = run(capsys, PROMPT, "--address", address, "--max-new-tokens", "8",
                       "--temperature", "0.8", "--top-p", "0.9", "--top-k", "50",
                       "--seed", "11")
    assert code == 0 and out == expected.text + "\n"
    stop = expected.text[3:6]
    code, out, _ = run(capsys, PROMPT, "--address", address, "--max-new-tokens", "8",
                       "--temperature", "0.8", "--top-p", "0.9", "--top-k", "50",
                       "--seed", "11", "--stop", "not in it", "--stop", stop, "--json")
    completion = json.loads(out)["completions"][0]
    assert code == 0 and completion["finish_reason"] == "stop_sequence"
    assert completion["stop_sequence"] == stop
    assert completion["text"] == expected.text[:expected.text.index(stop)]


def test_speculative_flag_reaches_the_server(capsys, address):
    # this server has no speculative method: asking for it is the server's INVALID_ARGUMENT
    code, out, err = run(capsys, PROMPT, "--address", address, "--speculative")
    assert code == 1 and out == "" and "speculative" in err
    code, out, err = run(capsys, PROMPT, "--address", address, "--max-new-tokens", "4",
                         "--no-speculative")
    assert code == 0 and out, err


def test_chat_and_stdin(capsys, address, client, monkeypatch):
    chat = client.generate([{"role": "user", "content": "Hi"}], max_new_tokens=6).text
    code, out, _ = run(capsys, "Hi", "--chat", "--address", address, "--max-new-tokens", "6")
    assert code == 0 and out == chat + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
    code, out, _ = run(capsys, "-", "--address", address, "--max-new-tokens", "4")
    assert code == 0 and out == client.generate(PROMPT, max_new_tokens=4).text + "\n"


def test_structured_output_flags(capsys, address, tmp_path):
    code, out, _ = run(capsys, PROMPT, "--address", address, "--choice", "yes",
                       "--choice", "no")
    assert code == 0 and out in ("yes\n", "no\n")
    code, out, _ = run(capsys, PROMPT, "--address", address, "--regex", "[0-9]{4}")
    assert code == 0 and re.fullmatch(r"[0-9]{4}\n", out)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    for spec in (str(path), json.dumps(schema)):
        code, out, _ = run(capsys, PROMPT, "--address", address, "--json-schema", spec,
                           "--max-new-tokens", "32")
        assert code == 0
        jsonschema.validate(json.loads(out), schema)
    code, out, _ = run(capsys, PROMPT, "--address", address, "--json-object",
                       "--max-new-tokens", "32", "--json")
    assert code == 0 and json.loads(out)["completions"][0]["finish_reason"]


def test_call_errors_exit_1(capsys, address):
    code, out, err = run(capsys, PROMPT, "--address", address, "--top-p", "1.5")
    assert code == 1 and out == ""
    # (the in-process server logs to the same stderr: look for the line)
    assert "\ngenserve generate: error: invalid request: sampling.top_p" in "\n" + err
    code, _, err = run(capsys, PROMPT, "--address", f"127.0.0.1:{_free_port()}",
                       "--timeout", "5")
    assert code == 1 and "error: server unavailable" in err
    code, _, err = run(capsys, PROMPT, "--address", address, "--max-new-tokens", "200",
                       "--timeout", "0.05")
    assert code == 1 and "error: deadline exceeded (0.05s)" in err
    code, out, err = run(capsys, PROMPT, "--address", address, "--max-new-tokens", "200",
                         "--timeout", "0.02", "--stream")
    assert code == 1 and "error: deadline exceeded (0.02s)" in err
    assert out.endswith("\n")  # the partial line is ended before the error


@pytest.mark.parametrize("argv,message", [
    (["--regex", "a", "--choice", "b"], "not allowed with argument"),
    (["--json-schema", "{not json"], "inline JSON is not valid JSON"),
    (["--json-schema", "/no/such/schema.json"], "neither inline JSON nor a readable file"),
    (["--max-new-tokens", "0"], "must be >= 1"),
    (["--timeout", "0"], "must be > 0"),
])
def test_bad_flags_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["generate", PROMPT, *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_tls_setup_exits_2(capsys, tmp_path):
    code, _, err = run(capsys, PROMPT, "--tls-cert", "c.pem")
    assert code == 2 and "--tls-cert and --tls-key go together" in err
    code, _, err = run(capsys, PROMPT, "--tls-ca", str(tmp_path / "missing.pem"))
    assert code == 2 and "cannot read the TLS root certificates" in err


def test_tls_flags(capsys, tls_server, mtls_server, tls_files):
    code, out, err = run(capsys, "Hello there", "--address", tls_server.address,
                         "--tls-ca", str(tls_files.ca), "--max-new-tokens", "2")
    assert code == 0 and out.strip(), err
    code, _, err = run(capsys, "Hello there", "--address", tls_server.address,
                       "--max-new-tokens", "2", "--timeout", "5")
    assert code == 1 and "server unavailable" in err  # plaintext to a TLS port
    code, out, err = run(capsys, "Hello there", "--address", mtls_server.address,
                         "--tls-ca", str(tls_files.ca), "--tls-cert", str(tls_files.client_cert),
                         "--tls-key", str(tls_files.client_key), "--tls-server-name",
                         "localhost", "--max-new-tokens", "2")
    assert code == 0 and out.strip(), err


def test_the_installed_command(address, client):
    """The ``genserve`` console script (pyproject's entry point), as from a shell."""
    exe = Path(sys.executable).with_name("genserve")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "service.cli"]
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'protos'}"}
    proc = subprocess.run([*command, "generate", PROMPT, "--address", address,
                           "--max-new-tokens", "8"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == client.generate(PROMPT, max_new_tokens=8).text + "\n"
    proc = subprocess.run([*command, "generate", PROMPT, "--address", address, "--top-k",
                           "-1"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "--top-k: must be >= 0" in proc.stderr
