"""``genserve serve --spec-*`` flags map onto the engine's SpeculativeConfig."""

from __future__ import annotations

import pytest

import service.server
from service import cli


def parsed(monkeypatch, *flags: str):
    seen = {}

    async def fake_serve(config):
        seen["config"] = config

    monkeypatch.setattr(service.server, "serve", fake_serve)
    assert cli.main(["serve", *flags]) == 0
    return seen["config"].engine.speculative


def test_spec_flags_build_the_speculative_config(monkeypatch):
    spec = parsed(monkeypatch, "--spec-method", "draft", "--spec-draft-model", "self:8",
                  "--num-spec-tokens", "3", "--spec-ngram-min", "2", "--spec-ngram-max", "5",
                  "--spec-disable-batch-size", "4", "--spec-off-by-default")
    assert (spec.method, spec.draft_model, spec.num_spec_tokens, spec.ngram_min,
            spec.ngram_max, spec.disable_batch_size, spec.enabled_by_default) == (
        "draft", "self:8", 3, 2, 5, 4, False)


def test_speculation_is_off_unless_a_method_is_given(monkeypatch):
    assert parsed(monkeypatch).method is None


@pytest.mark.parametrize("flags,message", [
    (["--spec-method", "draft"], "--spec-draft-model"),
    (["--spec-method", "ngram", "--spec-ngram-min", "4", "--spec-ngram-max", "2"],
     "--spec-ngram-min"),
])
def test_inconsistent_spec_flags_exit_with_a_message(monkeypatch, flags, message):
    with pytest.raises(SystemExit, match=message):
        parsed(monkeypatch, *flags)


def test_unknown_spec_method_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--spec-method", "medusa"])
    assert "invalid choice" in capsys.readouterr().err
