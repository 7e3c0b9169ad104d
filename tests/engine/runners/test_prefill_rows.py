"""The last decoder layer past its attention for the asked rows only (prefill_rows.py):
those rows' hidden states are the full layer's bit for bit with the packed native
linears, the KV cache is the same, no rows at all still fills the cache, and other
layers run as they are."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from engine.runners.prefill_rows import keep_last_rows
from engine.runners.torch import native_gemm
from engine.runners.torch.native_elementwise import fuse_elementwise
from tests.engine.runners.test_native_elementwise import prepared, tiny


def as_copy(model: torch.nn.Module) -> torch.nn.Module:
    """As the hand-off's float32 copy: fused, packed, its elementwise ops native."""
    fuse_elementwise(prepared(model))
    return model


def run(model, kept, rows, chunks):
    """The chunks through the model with ``rows`` kept each; the last chunk's hidden
    states and the cache."""
    cache = DynamicCache()
    hidden = None
    with torch.inference_mode():
        for ids in chunks:
            if kept is not None:
                kept.rows = rows
            try:
                hidden = model.model(input_ids=ids, cache=cache, use_cache=True).last_hidden_state
            finally:
                if kept is not None:
                    kept.rows = None
    return hidden, cache


@pytest.mark.skipif(not native_gemm.cpu_supported(), reason="the native kernels need AVX2/FMA")
@pytest.mark.parametrize("config_cls", ["LlamaConfig", "MistralConfig", "Qwen2Config"])
@pytest.mark.parametrize("rows", [1, 3, 0])
def test_kept_rows_are_the_full_layers_bit_for_bit_and_the_cache_the_same(config_cls, rows):
    full, cut = as_copy(tiny(config_cls)), as_copy(tiny(config_cls))  # the same weights
    kept = keep_last_rows(cut)
    assert kept is not None
    chunks = [torch.arange(3, 40)[None], torch.arange(50, 71)[None]]
    want, want_cache = run(full, None, None, chunks)
    got, got_cache = run(cut, kept, rows, chunks)
    assert got.shape == (1, rows, 64)
    assert torch.equal(got, want[:, want.shape[1] - rows:])
    for a, b in zip(got_cache.layers, want_cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_unset_or_all_rows_run_the_layer_as_it_is():
    model = tiny("LlamaConfig")
    stock = copy.deepcopy(model)
    kept = keep_last_rows(model)
    assert kept is not None
    ids = [torch.arange(20)[None]]
    want, _ = run(stock, None, None, ids)
    for rows in (None, 20, 25):
        got, _ = run(model, kept, rows, ids)
        assert torch.equal(got, want)


def test_another_familys_last_layer_is_left_alone():
    gemma = tiny("Gemma2Config", head_dim=16)
    assert keep_last_rows(gemma) is None
    assert "forward" not in gemma.model.layers[-1].__dict__
