"""Structured logs: the JSON / text formatters, the per-request line, and ``--log-format``."""

from __future__ import annotations

import io
import json
import logging
import re
import time
import urllib.request

import grpc
import pytest

from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from service.cli import main
from service.logs import JsonFormatter, make_handler, request_id_var
from tests.service.conftest import start_server, stop_server
from tests.service.serve_process import free_port, serve, wait_serving

TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO|WARNING|ERROR) ")


def _record(msg="hello %s", args=("world",), **extra) -> logging.LogRecord:
    record = logging.getLogger("genserve.test").makeRecord(
        "genserve.test", logging.INFO, __file__, 1, msg, args, None, extra=extra)
    return record


def test_json_line_has_time_level_logger_message_and_extras():
    line = JsonFormatter().format(_record(rpc="Generate", duration_ms=1.5))
    obj = json.loads(line)
    assert obj["level"] == "INFO" and obj["logger"] == "genserve.test"
    assert obj["message"] == "hello world"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", obj["time"])
    assert obj["rpc"] == "Generate" and obj["duration_ms"] == 1.5
    assert "request_id" not in obj and "\n" not in line


def _capture(fmt: str, logger: str = "genserve.test"):
    stream = io.StringIO()
    handler = make_handler(fmt, stream)
    log = logging.getLogger(logger)
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.INFO)
    return stream, lambda: (log.removeHandler(handler), log.setLevel(old))


def test_request_id_comes_from_the_context_or_extra():
    stream, done = _capture("json")
    log = logging.getLogger("genserve.test")
    try:
        token = request_id_var.set("req-7")
        log.info("inside a call")
        request_id_var.reset(token)
        log.info("outside")
        log.info("named", extra={"request_id": "req-8"})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("failed")
    finally:
        done()
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert [x.get("request_id") for x in lines] == ["req-7", None, "req-8", None]
    assert "RuntimeError: boom" in lines[3]["exception"]


def test_text_format_prefixes_the_request_id():
    stream, done = _capture("text")
    try:
        token = request_id_var.set("abc")
        logging.getLogger("genserve.test").info("hello")
        request_id_var.reset(token)
        logging.getLogger("genserve.test").info("plain")
    finally:
        done()
    first, second = stream.getvalue().splitlines()
    assert TEXT_LINE.match(first) and first.endswith("genserve.test: [abc] hello")
    assert second.endswith("genserve.test: plain")


def test_bad_log_format_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--log-format", "xml"])
    assert e.value.code == 2
    assert "--log-format" in capsys.readouterr().err


@pytest.fixture(scope="module")
def server(make_engine):
    running, _ = start_server(make_engine(), structured=None)
    yield running
    stop_server(running)


def test_one_json_line_per_finished_request(server):
    stream, done = _capture("json", "service.servicer")
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            ok = stub.Generate(pb.GenerateRequest(
                request_id="log-ok", prompt="Hello there",
                stopping=pb.StoppingCriteria(max_new_tokens=5, min_new_tokens=5)))
            with pytest.raises(grpc.RpcError):
                stub.Generate(pb.GenerateRequest(request_id="log-bad", prompt="x",
                                                 sampling=pb.SamplingParameters(top_p=3)))
            list(stub.GenerateStream(pb.GenerateStreamRequest(request=pb.GenerateRequest(
                prompt="streamed", stopping=pb.StoppingCriteria(max_new_tokens=3)))))
            stub.GenerateBatch(pb.GenerateBatchRequest(requests=[
                pb.GenerateRequest(request_id="b1", prompt="one",
                                   stopping=pb.StoppingCriteria(max_new_tokens=2)),
                pb.GenerateRequest(request_id="b2", prompt="two",
                                   stopping=pb.StoppingCriteria(max_new_tokens=2))]))
            stub.Tokenize(pb.TokenizeRequest(text="hi"))
        # the line is written before the answer leaves the server, but be lenient
        end = time.monotonic() + 5
        while stream.getvalue().count("\n") < 5 and time.monotonic() < end:
            time.sleep(0.02)
    finally:
        done()
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    finished = [x for x in lines if "rpc" in x]
    assert [x["rpc"] for x in finished] == ["Generate", "Generate", "GenerateStream",
                                            "GenerateBatch", "Tokenize"]
    ok_line, bad_line, stream_line, batch_line, tok_line = finished
    assert ok_line["request_id"] == "log-ok" and ok_line["code"] == "OK"
    assert ok_line["level"] == "INFO" and ok_line["logger"] == "service.servicer"
    assert ok_line["prompt_tokens"] == ok.usage.prompt_tokens > 0
    assert ok_line["completion_tokens"] == 5 and ok_line["duration_ms"] > 0
    assert "Generate OK" in ok_line["message"]
    assert bad_line["request_id"] == "log-bad" and bad_line["code"] == "INVALID_ARGUMENT"
    assert bad_line["completion_tokens"] == 0
    assert len(stream_line["request_id"]) == 32  # generated: a uuid4 hex
    assert stream_line["completion_tokens"] == 3
    assert batch_line["request_ids"] == ["b1", "b2"] and batch_line["items"] == 2
    assert batch_line["completion_tokens"] == 4 and "request_id" not in batch_line
    assert tok_line["code"] == "OK" and "completion_tokens" not in tok_line


def test_serve_with_json_logs_and_metrics_port(tiny_model_dir, tmp_path):
    """A real ``genserve serve --log-format json --metrics-port N`` process."""
    metrics_port = free_port()
    log_path = tmp_path / "serve.log"
    # compiles the decode step in the background, as served (SIGTERM may come mid-compile)
    proc, port = serve(tiny_model_dir, log_path, "--no-structured-output", "--log-format",
                       "json", "--metrics-port", str(metrics_port))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            wait_serving(proc, ch, log_path)
            pb_grpc.GenerationServiceStub(ch).Generate(pb.GenerateRequest(
                request_id="cli-json", prompt="Hi", stopping=pb.StoppingCriteria(
                    max_new_tokens=3)), timeout=60)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as r:
            assert 'genserve_requests_total{code="OK",rpc="Generate"} 1.0' in r.read().decode()
        proc.terminate()
        assert proc.wait(60) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert not [x for x in text.splitlines() if TEXT_LINE.match(x)], text  # no text lines
    lines = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
    messages = [x["message"] for x in lines]
    assert "SERVING" in messages and "stopped" in messages
    assert any(m.startswith("metrics on http://127.0.0.1:") for m in messages)
    (done,) = [x for x in lines if x.get("request_id") == "cli-json"]
    assert done["rpc"] == "Generate" and done["code"] == "OK"
    assert done["completion_tokens"] == 3
