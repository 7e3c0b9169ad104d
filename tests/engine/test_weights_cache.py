"""The converted-weights cache's bookkeeping (engine.loading.weights_cache), on a stand-in
converter.

A fake .gguf (any bytes) and a converter that writes a small but well-formed entry keep
these tests at milliseconds; tests/e2e/test_weights_cache_real.py converts the real default
model and checks the cached copy against the GGUF-loaded one.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.loading import weights_cache
from engine.loading.gguf_config import UnfaithfulGGUF
from engine.loading.model_loader import ModelSource, _load_via_cache, hf_source, resolve_model


class FakeConverter:
    """Writes config, a tiny safetensors file and a tokenizer config; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, gguf: Path, out: Path) -> None:
        self.calls += 1
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (out / "tokenizer_config.json").write_text("{}")
        save_file({"w": torch.arange(64, dtype=torch.float32)}, str(out / "model.safetensors"))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv(weights_cache.CACHE_DIR_ENV, str(d))
    return d


@pytest.fixture
def gguf(tmp_path) -> Path:
    path = tmp_path / "models" / "tiny.Q4_1.gguf"
    path.parent.mkdir()
    path.write_bytes(os.urandom(3 << 20))  # > 2 MiB: the key hashes its first and last MiB
    return path


def test_second_load_uses_the_cache(cache_dir, gguf):
    convert = FakeConverter()
    entry = weights_cache.cached_model_dir(gguf, convert)
    assert entry is not None and entry.parent == cache_dir and convert.calls == 1
    assert weights_cache.cached_model_dir(gguf, convert) == entry
    assert convert.calls == 1
    assert sorted(p.name for p in cache_dir.iterdir()) == [entry.name]  # no temp dirs left
    for p in [entry, *entry.iterdir()]:  # readable by a service running as another user
        assert p.stat().st_mode & 0o444 == 0o444, p


def test_first_conversion_logs_progress(cache_dir, gguf, caplog):
    with caplog.at_level(logging.INFO, logger="engine.loading.weights_cache"):
        weights_cache.cached_model_dir(gguf, FakeConverter())
    assert "converting tiny.Q4_1.gguf to the weights cache" in caplog.text
    assert "done in" in caplog.text


@pytest.mark.parametrize("change", ["content_and_mtime", "header_same_mtime", "mtime_only"])
def test_a_changed_source_is_converted_again(cache_dir, gguf, change):
    convert = FakeConverter()
    first = weights_cache.cached_model_dir(gguf, convert)
    st = gguf.stat()
    if change != "mtime_only":
        with gguf.open("r+b") as f:
            f.write(b"GGUF-v2")  # same size: only the hash of the head tells
    if change == "header_same_mtime":
        os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:
        os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = weights_cache.cached_model_dir(gguf, convert)
    assert convert.calls == 2 and second is not None and second != first
    assert not first.exists()  # the earlier version's entry is removed


def _truncate_weights(entry: Path) -> None:
    path = entry / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-16])


def _lie_about_size(entry: Path) -> None:
    """Truncated and the manifest updated to match: only the safetensors header tells."""
    _truncate_weights(entry)
    manifest = json.loads((entry / weights_cache.MANIFEST).read_text())
    manifest["files"]["model.safetensors"] -= 16
    (entry / weights_cache.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage", [
    _truncate_weights,
    _lie_about_size,
    lambda entry: (entry / "model.safetensors").unlink(),
    lambda entry: (entry / "config.json").write_text("{not json"),
    lambda entry: (entry / weights_cache.MANIFEST).unlink(),  # e.g. copied in by hand, half
    lambda entry: (entry / weights_cache.MANIFEST).write_text("[]"),
], ids=["truncated", "truncated-manifest-agrees", "no-weights", "bad-config", "no-manifest",
        "bad-manifest"])
def test_a_corrupt_entry_is_rebuilt_not_fatal(cache_dir, gguf, damage, caplog):
    convert = FakeConverter()
    entry = weights_cache.cached_model_dir(gguf, convert)
    assert entry is not None
    damage(entry)
    with caplog.at_level(logging.WARNING, logger="engine.loading.weights_cache"):
        again = weights_cache.cached_model_dir(gguf, convert)
    assert again == entry and convert.calls == 2
    assert "unusable" in caplog.text and "rebuilding" in caplog.text
    key = json.loads((entry / weights_cache.MANIFEST).read_text())["key"]
    assert weights_cache.check_entry(entry, key) is None


def test_a_crash_while_converting_leaves_no_entry(cache_dir, gguf, caplog):
    def crash(gguf: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed")

    with caplog.at_level(logging.WARNING, logger="engine.loading.weights_cache"):
        assert weights_cache.cached_model_dir(gguf, crash) is None  # load the .gguf instead
    assert "loading the .gguf directly" in caplog.text
    assert list(cache_dir.iterdir()) == []
    convert = FakeConverter()
    assert weights_cache.cached_model_dir(gguf, convert) is not None and convert.calls == 1


@pytest.mark.parametrize("error,said", [
    (ValueError("GGUF model with architecture granite is not supported yet."),
     "architecture granite (remembered"),
    (UnfaithfulGGUF("llama GGUF: attention.sliding_window 4096, but ..."),
     "attention.sliding_window 4096, but ... (remembered")],
    ids=["unread architecture", "UnfaithfulGGUF"])
def test_a_gguf_transformers_cannot_read_faithfully_is_not_converted_again(
        cache_dir, gguf, caplog, error, said):
    """Refused once (an info line naming why: an architecture transformers cannot read,
    or ``UnfaithfulGGUF`` from gguf_config.py), remembered for this file and transformers
    version: the next start does not try again; a changed file is tried again."""
    calls = []

    def unreadable(gguf: Path, out: Path) -> None:
        calls.append(gguf)
        raise error

    with caplog.at_level(logging.INFO, logger="engine.loading.weights_cache"):
        assert weights_cache.cached_model_dir(gguf, unreadable) is None
        assert weights_cache.cached_model_dir(gguf, unreadable) is None
    assert len(calls) == 1
    assert said in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    gguf.write_bytes(os.urandom(3 << 20))  # another file at the same path
    assert weights_cache.cached_model_dir(gguf, unreadable) is None
    assert len(calls) == 2


def test_an_unwritable_cache_dir_falls_back_to_the_gguf(tmp_path, gguf, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # the cache dir would have to be under a file: mkdir fails
    monkeypatch.setenv(weights_cache.CACHE_DIR_ENV, str(blocker / "cache"))
    source = resolve_model(str(gguf))
    with caplog.at_level(logging.WARNING, logger="engine.loading.weights_cache"):
        assert hf_source(source) is source  # the .gguf itself, loaded as before
    assert "could not cache" in caplog.text


def test_an_entry_that_fails_to_load_is_rebuilt_once(cache_dir, gguf, monkeypatch, caplog):
    convert = FakeConverter()
    monkeypatch.setattr(weights_cache, "convert_gguf", convert)
    source = resolve_model(str(gguf))
    seen: list[ModelSource] = []

    def load(s: ModelSource) -> str:
        seen.append(s)
        if len(seen) == 1:
            raise OSError("config refers to a missing class")
        return s.directory

    with caplog.at_level(logging.WARNING, logger="engine.loading.model_loader"):
        directory = _load_via_cache(source, load)
    assert convert.calls == 2 and len(seen) == 2 and "failed to load" in caplog.text
    assert seen[0].gguf_file is None and Path(directory).parent == cache_dir
    assert source.gguf_file == gguf.name and source.model_id == "tiny.Q4_1"  # unchanged


def test_a_tokenizer_entry_is_made_once_and_a_full_entry_is_preferred(cache_dir, gguf,
                                                                      monkeypatch):
    """What the llama.cpp runner reads without its torch prefill: the full entry when
    there is one, else a tokenizer entry converted once; the two of one version coexist,
    and a new version of the file removes both old ones."""
    calls = []

    def tokenizer_only(src: Path, out: Path) -> None:
        calls.append(src)
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (out / "tokenizer_config.json").write_text("{}")

    monkeypatch.setattr(weights_cache, "convert_tokenizer", tokenizer_only)
    light = weights_cache.cached_tokenizer_dir(gguf)
    assert light is not None and light.name.endswith(weights_cache.TOKENIZER_SUFFIX)
    assert weights_cache.cached_tokenizer_dir(gguf) == light and len(calls) == 1
    full = weights_cache.cached_model_dir(gguf, FakeConverter())
    assert full is not None and full.exists() and light.exists()
    assert weights_cache.cached_tokenizer_dir(gguf) == full
    gguf.write_bytes(os.urandom(3 << 20))  # a new version of the file
    newer = weights_cache.cached_tokenizer_dir(gguf)
    assert newer is not None and len(calls) == 2
    assert sorted(p.name for p in cache_dir.iterdir()) == [newer.name]


@pytest.mark.parametrize("error, remembered", [(OSError("no space left"), False),
                                               (ValueError("unknown architecture"), True)])
def test_a_tokenizer_entry_that_fails_is_retried_only_after_a_passing_error(
        cache_dir, gguf, monkeypatch, error, remembered):
    calls = []

    def failing(src: Path, out: Path) -> None:
        calls.append(src)
        raise error

    monkeypatch.setattr(weights_cache, "convert_tokenizer", failing)
    assert weights_cache.cached_tokenizer_dir(gguf) is None
    assert weights_cache.cached_tokenizer_dir(gguf) is None
    assert len(calls) == (1 if remembered else 2)
