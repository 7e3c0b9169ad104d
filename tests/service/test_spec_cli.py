"""``genserve serve --spec-*`` flags map onto the server's SpeculativeConfig."""

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
    return seen["config"].speculative


def test_spec_flags_build_the_speculative_config(monkeypatch):
    spec = parsed(monkeypatch, "--spec-method", "draft", "--spec-draft-model", "self:8",
                  "--num-spec-tokens", "3", "--spec-ngram-min", "2", "--spec-ngram-max", "5",
                  "--spec-disable-batch-size", "4", "--spec-off-by-default",
                  "--spec-scorer", "multi_token")
    assert (spec.method, spec.draft_model, spec.num_spec_tokens, spec.ngram_min,
            spec.ngram_max, spec.disable_batch_size, spec.enabled_by_default,
            spec.scorer) == ("draft", "self:8", 3, 2, 5, 4, False, "multi_token")


def test_speculation_is_off_unless_a_method_is_given(monkeypatch):
    spec = parsed(monkeypatch)
    assert spec.method is None
    assert spec.scorer == "batch_expansion"


@pytest.mark.parametrize("flags,message", [
    (["--spec-method", "draft"], "--spec-draft-model"),
    (["--spec-method", "ngram", "--spec-ngram-min", "4", "--spec-ngram-max", "2"],
     "--spec-ngram-min"),
])
def test_inconsistent_spec_flags_exit_with_a_message(monkeypatch, flags, message):
    with pytest.raises(SystemExit, match=message):
        parsed(monkeypatch, *flags)


@pytest.mark.parametrize("flag,value", [("--spec-method", "medusa"),
                                        ("--spec-scorer", "tree")])
def test_unknown_spec_method_or_scorer_is_refused(capsys, flag, value):
    with pytest.raises(SystemExit):
        cli.main(["serve", flag, value])
    assert "invalid choice" in capsys.readouterr().err
