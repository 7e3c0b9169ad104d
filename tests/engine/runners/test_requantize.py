"""Which GGUFs the llama.cpp runner requantises, and where the copy is cached."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.runners.requantize import requantized_path, target_format


def test_auto_requantises_only_the_formats_measured_to_lose():
    assert target_format("auto", "Q4_1") == "Q8_0"
    assert target_format("auto", "Q8_0") is None
    assert target_format("auto", "Q4_K - Medium") is None  # not measured: as it is


def test_bf16_is_offered_not_chosen_by_auto():
    assert target_format("BF16", "Q4_1") == "BF16"
    assert target_format("auto", "Q4_1") == "Q8_0"  # BF16 measured slower at batch 1


def test_none_and_the_files_own_format_run_it_as_it_is():
    assert target_format("none", "Q4_1") is None
    assert target_format("Q8_0", "Q8_0") is None
    assert target_format("F16", "Q4_1") == "F16"


def test_an_unknown_choice_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="auto, none, Q8_0, BF16, F16"):
        target_format("Q2_K", "Q4_1")


def test_the_copy_is_keyed_by_the_source_file(tmp_path, monkeypatch):
    monkeypatch.setenv("GENSERVE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + b"\0" * 100)
    first = requantized_path(src, "Q8_0")
    assert first.parent == tmp_path / "cache" / "requantized"
    assert first.name.startswith("m-") and first.name.endswith(".Q8_0.gguf")
    src.write_bytes(b"GGUF" + b"\1" * 200)  # the source changed: another copy
    assert requantized_path(src, "Q8_0") != first
    assert requantized_path(Path(src), "F16") != requantized_path(src, "Q8_0")
