"""Which GGUFs the llama.cpp runner requantises, and where the copy is cached."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.loading.model_loader import default_model_path
from engine.runners.requantize import file_format, requantized_path, served_gguf, target_format
from engine.runners.select import llama_cpp_available


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


@pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed")
def test_the_files_format_is_read_from_its_metadata():
    """``file_format`` (what a bench runs llama.cpp itself on) names the shipped file's
    own format, as the runner's loaded model does: a vocabulary-only load reports every
    file as "all F32", which sent the benches' ``Llama.generate`` to the Q4_1 file while
    the server ran its Q8_0 copy."""
    from engine.runners.llamacpp import llama_lib

    lib = llama_lib()
    shipped = Path(default_model_path())
    assert file_format(lib, shipped) == "Q4_1"
    assert served_gguf(lib, shipped, "none", 1) == shipped
    copy = served_gguf(lib, shipped, "auto", 2)
    assert copy == requantized_path(shipped.resolve(), "Q8_0")
    assert file_format(lib, copy) == "Q8_0"
