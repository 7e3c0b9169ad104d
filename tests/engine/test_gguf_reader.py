"""GGUF metadata is parsed once per file version inside ``shared_parses`` (transformers'
own loads included), and nothing is kept after it (engine/loading/gguf_reader.py)."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.loading import gguf_reader
from engine.loading.gguf_reader import shared_parses
from engine.loading.weights_cache import load_gguf
from tests.engine.runners.gguf_builder import write_gguf


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """Every real parse (a construction of gguf-py's reader class), by path, and every
    tensor-name map gguf-py builds."""
    seen: list[str] = []
    real = gguf_reader._original if gguf_reader._depth else gguf.GGUFReader
    name_map = (gguf_reader._original_name_map if gguf_reader._depth
                else gguf.get_tensor_name_map)

    class Counting(real):  # type: ignore[misc, valid-type]
        def __init__(self, path, mode="r"):
            seen.append(str(path))
            super().__init__(path, mode)

    def counting_name_map(arch, n_blocks):
        seen.append(f"name map {arch.name} {n_blocks}")
        return name_map(arch, n_blocks)

    # as in a process with no block open (the test session keeps one: tests/conftest.py);
    # monkeypatch puts the session's block back afterwards
    for name, value in (("_depth", 0), ("_original", None), ("_readers", OrderedDict()),
                        ("_original_name_map", None), ("_name_maps", {})):
        monkeypatch.setattr(gguf_reader, name, value)
    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counting_name_map)
    return seen


def small_gguf(path: Path, value: int) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("test.value", value)
    w.add_tensor("t", np.arange(4, dtype=np.float32) + value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_file_is_parsed_once_per_version_inside_a_block_and_let_go_after(tmp_path, parses):
    path = small_gguf(tmp_path / "a.gguf", 1)
    counting = gguf.GGUFReader
    with shared_parses():
        first = gguf.GGUFReader(path)
        with shared_parses():  # nested: the same readers
            assert gguf.GGUFReader(str(path)) is first
        assert gguf.GGUFReader(path) is first
        assert len(parses) == 1
        os.remove(path)  # a new version of the file (new size and time): parsed again
        small_gguf(path, 100_000)
        second = gguf.GGUFReader(path)
        assert second is not first and parses == [str(path)] * 2
        assert second.fields["test.value"].contents() == 100_000
        llama = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(llama, 2) is gguf.get_tensor_name_map(llama, 2)
        assert parses.count("name map LLAMA 2") == 1
    assert gguf.GGUFReader is counting and not gguf_reader._readers
    assert not gguf_reader._name_maps
    gguf.GGUFReader(path)
    assert len([p for p in parses if p == str(path)]) == 3  # outside, every call parses


def test_converting_a_gguf_parses_it_once(tmp_path, tiny_model_dir, parses):
    """Tokenizer, config (ours and transformers') and weights: four parses before, and a
    tensor-name map for each of the model's modules."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    path = write_gguf(model, tmp_path / "tiny.gguf")
    parses.clear()  # the writer read the default model's vocabulary
    _, converted = load_gguf(path)
    assert parses == [str(path), "name map LLAMA 2"]
    want = model.state_dict()["model.embed_tokens.weight"]
    assert torch.equal(converted.state_dict()["model.embed_tokens.weight"], want)
