"""``genserve`` CLI: flag parsing, and a real ``genserve serve`` process drained by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from service.cli import LLAMACPP_GOMP_SPINCOUNT, main, openmp_settings, parse_bytes
from tests.service.serve_process import health, serve, wait_serving


@pytest.mark.parametrize("text,expected", [
    ("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
    ("1000000", 1_000_000), (" 64 kib ", 64 * 1024),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("argv", [
    ["serve", "--kv-cache-memory", "lots"],
    ["serve", "--max-n", "0"],
    ["serve", "--max-num-seqs", "-1"],
    ["serve", "--port", "http"],
])
def test_bad_flags_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def _served_config(monkeypatch, argv: list[str]):
    """The ServerConfig ``genserve serve argv`` would serve (the server is not started)."""
    import service.server

    seen = []

    async def fake_serve(config):
        seen.append(config)

    monkeypatch.setattr(service.server, "serve", fake_serve)
    monkeypatch.setattr(os, "environ", os.environ.copy())  # serve adds OpenMP settings
    assert main(["serve", *argv]) == 0
    return seen[0]


def test_long_prefill_flags_reach_the_engine_config(monkeypatch):
    default = _served_config(monkeypatch, [])
    assert default.engine.long_prefill_token_threshold is None  # by runner
    assert default.engine.max_long_partial_prefills == 1
    seen = _served_config(monkeypatch, ["--long-prefill-token-threshold", "0",
                                        "--max-long-partial-prefills", "2"])
    assert seen.engine.long_prefill_token_threshold == 0
    assert seen.engine.max_long_partial_prefills == 2


def test_stream_interval_flag_reaches_the_engine_config(monkeypatch, capsys):
    assert _served_config(monkeypatch, []).engine.stream_interval == 1  # a message a token
    assert _served_config(monkeypatch, ["--stream-interval", "4"]).engine.stream_interval == 4
    with pytest.raises(SystemExit) as e:
        main(["serve", "--stream-interval", "0"])
    assert e.value.code == 2 and "--stream-interval" in capsys.readouterr().err


def test_max_lora_wait_flag_reaches_the_engine_config(monkeypatch):
    assert _served_config(monkeypatch, []).engine.max_lora_wait_s == 60.0
    assert _served_config(monkeypatch, ["--max-lora-wait-s", "2.5"]).engine.max_lora_wait_s \
        == 2.5
    assert _served_config(monkeypatch, ["--max-lora-wait-s", "0"]).engine.max_lora_wait_s == 0


@pytest.mark.parametrize("wait", ["-1", "soon", "inf", "nan"])
def test_bad_max_lora_wait_exits_with_usage(wait, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--max-lora-wait-s", wait])
    assert e.value.code == 2
    assert "--max-lora-wait-s" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--long-prefill-token-threshold", "-1"],
                                  ["--max-long-partial-prefills", "0"]])
def test_bad_long_prefill_flags_exit_with_usage(argv):
    with pytest.raises(SystemExit) as e:
        main(["serve", *argv])
    assert e.value.code == 2


def test_tgis_flags_reach_the_server_config(monkeypatch):
    default = _served_config(monkeypatch, [])
    assert default.fmaas and default.tgis.default_include_stop_seqs
    assert default.limits.max_new_tokens == 1024 and default.limits.prompt_logprobs
    config = _served_config(monkeypatch, [
        "--no-fmaas", "--no-default-include-stop-seqs", "--max-new-tokens", "100",
        "--disable-prompt-logprobs"])
    assert not config.fmaas and not config.tgis.default_include_stop_seqs
    assert config.limits.max_new_tokens == 100 and not config.limits.prompt_logprobs
    assert config.limits.default_max_new_tokens == 100  # the default never exceeds the cap


def test_otlp_traces_endpoint_flag_reaches_the_server_config(monkeypatch):
    assert _served_config(monkeypatch, []).otlp_traces_endpoint is None  # off by default
    config = _served_config(monkeypatch, ["--otlp-traces-endpoint", "http://collector:4317"])
    assert config.otlp_traces_endpoint == "http://collector:4317"
    monkeypatch.setenv("GENSERVE_OTLP_TRACES_ENDPOINT", "http://env:4317")
    assert _served_config(monkeypatch, []).otlp_traces_endpoint == "http://env:4317"


def test_runner_and_threads_flags_reach_the_engine_config(monkeypatch):
    default = _served_config(monkeypatch, [])
    assert default.engine.runner == "auto" and default.engine.threads is None
    config = _served_config(monkeypatch, ["--runner", "torch", "--threads", "3"])
    assert config.engine.runner == "torch" and config.engine.threads == 3
    monkeypatch.setenv("GENSERVE_RUNNER", "llamacpp")
    assert _served_config(monkeypatch, []).engine.runner == "llamacpp"


def test_llama_cpp_speed_flags_default_to_fast_and_reach_the_engine_config(monkeypatch):
    default = _served_config(monkeypatch, []).engine
    assert not default.batch_invariant and default.requantize == "auto"
    assert default.kv_streams is None and default.kv_cache_memory is None  # auto
    config = _served_config(monkeypatch, ["--batch-invariant", "--requantize", "none"]).engine
    assert config.batch_invariant and config.requantize == "none"
    assert _served_config(monkeypatch, ["--kv-streams"]).engine.kv_streams is True
    assert _served_config(monkeypatch, ["--no-kv-streams"]).engine.kv_streams is False


def test_serve_shortens_openmp_spin_for_the_llama_cpp_runner(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    _served_config(monkeypatch, ["--runner", "llamacpp"])
    assert os.environ["GOMP_SPINCOUNT"] == LLAMACPP_GOMP_SPINCOUNT


def test_serve_decides_openmp_settings_before_torch_loads_libgomp():
    """libgomp reads its environment once, when torch's import loads it: ``serve`` builds
    its flags without importing torch, else the setting would come too late."""
    code = ("import sys\n"
            "import service.cli as cli\n"
            "def spy(*args):\n"
            "    print('torch loaded:', 'torch' in sys.modules)\n"
            "    raise SystemExit(0)\n"
            "cli.openmp_settings = spy\n"
            "cli.main(['serve', '--runner', 'llamacpp'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch loaded: False"


def test_openmp_spin_is_shortened_only_where_llama_cpp_may_run(monkeypatch):
    short = {"GOMP_SPINCOUNT": LLAMACPP_GOMP_SPINCOUNT}
    assert openmp_settings("llamacpp", "m.gguf", "cpu", {}) == short
    assert openmp_settings("torch", "default", "auto", {}) == {}
    assert openmp_settings("auto", "/models/hf-dir", "auto", {}) == {}
    assert openmp_settings("auto", "default", "cuda", {}) == {}
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    assert openmp_settings("auto", "default", "auto", {}) == short
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)  # no llama-cpp-python
    assert openmp_settings("auto", "default", "auto", {}) == {}
    # the user's own OpenMP settings are kept
    assert openmp_settings("llamacpp", "m.gguf", "cpu", {"GOMP_SPINCOUNT": "0"}) == {}
    assert openmp_settings("llamacpp", "m.gguf", "cpu", {"OMP_WAIT_POLICY": "active"}) == {}


@pytest.mark.parametrize("argv", [["serve", "--runner", "onnx"], ["serve", "--threads", "0"]])
def test_bad_runner_flags_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2


def test_settings_precedence_flag_over_env_over_file_over_default(monkeypatch, tmp_path):
    config = tmp_path / "genserve.yaml"
    config.write_text("max-num-seqs: 7\nmax_batch_size: 9\nfmaas: false\n"
                      "served-model-name: from-file\nprocessor-plugin: [a.b:C]\n")
    monkeypatch.setenv("GENSERVE_MAX_BATCH_SIZE", "11")
    monkeypatch.setenv("GENSERVE_SEED", "5")
    monkeypatch.setenv("GENSERVE_DISABLE_PROMPT_LOGPROBS", "true")
    monkeypatch.setenv("GENSERVE_REQUIRE_INTEROP", "1")  # not a flag: ignored
    seen = _served_config(monkeypatch, ["--config", str(config), "--served-model-name", "cli",
                                        "--processor-plugin", "x.y:Z"])
    assert seen.engine.max_num_seqs == 7  # file
    assert seen.limits.max_batch_size == 11  # env over file
    assert seen.served_model_name == "cli"  # flag over file
    assert seen.seed == 5 and not seen.limits.prompt_logprobs  # env
    assert not seen.fmaas  # file
    assert seen.processor_plugins == ["x.y:Z"]  # a list flag on the command line wins whole
    assert seen.engine.max_num_batched_tokens == 0  # default: chosen for the device
    assert seen.engine.step_token_budget() == 512  # on this CPU machine


@pytest.mark.parametrize(("env", "file", "message"), [
    ({"GENSERVE_MAX_NUM_SEQS": "many"}, "", "GENSERVE_MAX_NUM_SEQS: not an integer"),
    ({"GENSERVE_FMAAS": "maybe"}, "", "GENSERVE_FMAAS: expected true or false"),
    ({}, "max-num-seqs: 0\n", "max-num-seqs: must be >= 1"),
    ({}, "no-such-flag: 1\n", "unknown setting(s) no-such-flag"),
    ({}, "- a list\n", "expected a mapping"),
])
def test_bad_settings_are_usage_errors_naming_their_source(monkeypatch, tmp_path, capsys,
                                                           env, file, message):
    config = tmp_path / "c.yaml"
    config.write_text(file)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--config", str(config)])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_sigterm_drains_a_real_server_process(tiny_model_dir, tmp_path):
    log = tmp_path / "serve.log"
    proc, port = serve(tiny_model_dir, log, "--drain-grace-seconds", "60", "--enforce-eager")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            wait_serving(proc, ch, log)
            stub = pb_grpc.GenerationServiceStub(ch)
            stream = stub.GenerateStream(pb.GenerateStreamRequest(request=pb.GenerateRequest(
                prompt="Tell me a story", stopping=pb.StoppingCriteria(
                    max_new_tokens=80, min_new_tokens=80))), timeout=120)
            first = next(stream)
            proc.send_signal(signal.SIGTERM)
            end = time.monotonic() + 10  # NOT_SERVING, then refused (GOAWAY, port closed)
            while health(ch) == health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < end, log.read_text()
                time.sleep(0.05)
            refused_by = time.monotonic() + 10  # served until calls stop coming, then GOAWAY
            while True:
                try:
                    stub.Generate(pb.GenerateRequest(prompt="too late"), timeout=10)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE
                    break
                assert time.monotonic() < refused_by, log.read_text()
            rest = list(stream)
            assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert rest[-1].usage.completion_tokens == 80
            assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 80
        assert proc.wait(60) == 0, log.read_text()
        text = log.read_text()
        assert "warm-up generation took" in text and "draining" in text and "stopped" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_model_feature_refused_at_start_exits_2_with_one_line_naming_it(tiny_model_dir,
                                                                          tmp_path):
    import json
    import shutil

    model = tmp_path / "chunked"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["attention_chunk_size"] = 8  # chunked local attention: not implemented
    (model / "config.json").write_text(json.dumps(config))
    log = tmp_path / "serve.log"
    proc, _ = serve(model, log, "--enforce-eager")
    try:
        assert proc.wait(timeout=120) == 2, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "genserve serve: error: " in text and "attention_chunk_size" in text, text
    assert "Traceback" not in text, text
