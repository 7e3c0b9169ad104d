"""AUTO's choice of backend, its background switch to xgrammar, and compiles that are
killed at their limits (worker processes), never waited on at shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from structured.llguidance_backend import UnsupportedSpec
from structured.manager import StructuredConfig, StructuredOutputs
from structured.spec import AUTO, LLGUIDANCE, LM_FORMAT_ENFORCER, XGRAMMAR, StructuredSpec
from tests.service.test_structured_service import SLOW_SCHEMA

SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                     "required": ["n"]})
RUNAWAY = r"(a{1,200}){1,200}"  # lm-format-enforcer's FSM for this grows for minutes


@pytest.fixture(scope="module")
def outputs(tokenizer):
    so = StructuredOutputs(tokenizer, len(tokenizer), [tokenizer.eos_token_id],
                           StructuredConfig(compile_timeout_s=3.0, accelerate_after=2,
                                            compile_max_rss_mb=1536))
    yield so
    so.close()


def factory(outputs, spec):
    return asyncio.run(outputs.factory(spec))


def test_auto_serves_with_llguidance_first(outputs):
    f = factory(outputs, StructuredSpec("json_schema", SCHEMA))
    assert f.backend == LLGUIDANCE and not f.lenient and f.check_output is not None
    assert f.check_output('{"n": 3}') is None
    assert "does not match" in f.check_output('{"n": "three"}')


def test_auto_serves_a_slow_xgrammar_schema_at_once(outputs):
    start = time.perf_counter()
    f = factory(outputs, StructuredSpec("json_schema", SLOW_SCHEMA))
    assert f.backend == LLGUIDANCE and time.perf_counter() - start < 2.0
    with pytest.raises(ValueError, match="longer than 3s"):  # xgrammar alone: killed
        factory(outputs, StructuredSpec("json_schema", SLOW_SCHEMA, backend=XGRAMMAR))


def test_auto_falls_back_to_xgrammar_when_llguidance_cannot_enforce(outputs, monkeypatch):
    def cannot(spec):
        raise UnsupportedSpec("pretend this keyword is unimplemented")

    monkeypatch.setattr(outputs.llguidance, "compile", cannot)
    f = factory(outputs, StructuredSpec("regex", r"[xyz]{3}7"))
    assert f.backend == XGRAMMAR


def test_auto_does_not_fall_back_for_a_spec_wrong_in_itself(outputs):
    with pytest.raises(ValueError, match="does not exist") as err:
        factory(outputs, StructuredSpec("json_schema", '{"$ref": "#/$defs/gone"}'))
    assert XGRAMMAR not in str(err.value)
    for backend in (XGRAMMAR, LM_FORMAT_ENFORCER):  # refused whoever is asked
        with pytest.raises(ValueError, match="does not exist"):
            factory(outputs, StructuredSpec("json_schema", '{"$ref": "#/$defs/gone"}',
                                            backend=backend))
    with pytest.raises(ValueError, match="look-around"):
        factory(outputs, StructuredSpec("regex", "(?=a)a{100000}", backend=XGRAMMAR))


def test_lenient_llguidance_output_is_validated_against_the_schema(outputs):
    schema = json.dumps({"type": "object", "properties": {"v": {"not": {"type": "string"}}},
                         "required": ["v"]})
    f = factory(outputs, StructuredSpec("json_schema", schema))
    assert f.backend == LLGUIDANCE and f.lenient
    assert f.check_output('{"v": 1}') is None
    problem = f.check_output('{"v": "s"}')
    assert "does not match" in problem and "lenient" in problem


def test_a_spec_requested_again_moves_to_xgrammar_in_the_background(outputs):
    spec = StructuredSpec("regex", r"q[0-9]{4}")
    assert factory(outputs, spec).backend == LLGUIDANCE  # the first request
    assert factory(outputs, spec).backend == LLGUIDANCE  # the second starts the build
    deadline = time.monotonic() + 60
    while factory(outputs, spec).backend != XGRAMMAR:
        assert time.monotonic() < deadline, "xgrammar never took over"
        time.sleep(0.2)


def test_lm_format_enforcer_stays_selectable_and_handles_a_self_key(outputs):
    schema = json.dumps({"type": "object", "self": {"href": "x"},
                         "properties": {"a": {"type": "string"}}})
    f = factory(outputs, StructuredSpec("json_schema", schema, backend=LM_FORMAT_ENFORCER))
    assert f.backend == LM_FORMAT_ENFORCER


def test_a_runaway_compile_is_killed_and_its_worker_replaced(outputs):
    workers = outputs.workers
    killed = workers.killed
    start = time.perf_counter()
    with pytest.raises(ValueError, match="longer than 3s|more than 1536 MiB"):
        factory(outputs, StructuredSpec("regex", RUNAWAY, backend=LM_FORMAT_ENFORCER))
    assert time.perf_counter() - start < 60
    assert workers.killed == killed + 1
    start = time.perf_counter()  # asked again: the verdict is cached, no worker tied up
    with pytest.raises(ValueError, match="longer than 3s|more than 1536 MiB"):
        factory(outputs, StructuredSpec("regex", RUNAWAY, backend=LM_FORMAT_ENFORCER))
    assert time.perf_counter() - start < 1 and workers.killed == killed + 1
    # the replacement serves the next compile, and no runaway process is left behind
    f = factory(outputs, StructuredSpec("regex", r"k[0-9]", backend=LM_FORMAT_ENFORCER))
    assert f.backend == LM_FORMAT_ENFORCER
    children = [p for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == os.getpid()]
    assert all(_cpu_seconds(int(p)) < 30 for p in children)


def test_close_never_waits_on_a_running_compile(tokenizer):
    so = StructuredOutputs(tokenizer, len(tokenizer), [tokenizer.eos_token_id],
                           StructuredConfig(compile_timeout_s=60, accelerate_after=0))

    async def compile_then_close():
        task = asyncio.ensure_future(so.factory(StructuredSpec(
            "regex", RUNAWAY, backend=LM_FORMAT_ENFORCER)))
        await asyncio.sleep(8)  # the worker starts and is deep in the runaway compile
        start = time.perf_counter()
        so.close()
        with pytest.raises(ValueError, match="shutting down"):
            await task
        return time.perf_counter() - start

    assert asyncio.run(compile_then_close()) < 3


def test_a_slow_worker_start_is_not_counted_as_compile_time(tokenizer, monkeypatch):
    """A worker that takes longer to start than the compile limit (a loaded machine
    importing torch) still serves the spec: only its compile is timed."""
    import structured.compile_worker as cw
    import structured.manager as manager

    monkeypatch.setattr(manager, "WEDGED_SLACK_S", 0.5)
    real = cw._Worker.wait_ready

    def slow_start(self, closing):
        time.sleep(4.5)  # beyond every backend's compile_timeout_s + the slack
        real(self, closing)

    monkeypatch.setattr(cw._Worker, "wait_ready", slow_start)
    so = StructuredOutputs(tokenizer, len(tokenizer), [tokenizer.eos_token_id],
                           StructuredConfig(compile_timeout_s=1.0, accelerate_after=0))
    try:
        got = factory(so, StructuredSpec("json_schema", SCHEMA, backend=XGRAMMAR))
        assert got.backend == XGRAMMAR
    finally:
        so.close()


def test_unknown_whitespace_mode_is_refused(outputs):
    with pytest.raises(ValueError, match="whitespace"):
        factory(outputs, StructuredSpec("json_object", "", AUTO, whitespace="lots"))


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def test_lm_format_enforcer_output_is_validated_against_the_schema_too(outputs):
    """Its parser's fallback once let EOS end an unfinished string: whatever a backend
    enforces, a finished output that is not valid under the schema is reported."""
    f = factory(outputs, StructuredSpec("json_schema", SCHEMA, backend=LM_FORMAT_ENFORCER))
    assert f.backend == LM_FORMAT_ENFORCER and f.check_output is not None
    assert f.check_output('{"n": 3}') is None
    assert "not JSON" in f.check_output('{"n": ')


@pytest.mark.parametrize("backend", [LLGUIDANCE, XGRAMMAR, LM_FORMAT_ENFORCER])
def test_a_json_object_output_is_checked_for_being_one(outputs, backend):
    f = factory(outputs, StructuredSpec("json_object", "", backend=backend))
    assert f.check_output('{"a": [1, 2]}') is None
    assert "not JSON" in f.check_output('{"a": 1,\n}')
    assert "not an object" in f.check_output('[1, 2]')
