"""Cases for the Triton paged-decode kernel (CUDA graphs' attention) under Triton's CPU
interpreter: it must compute what the gather + SDPA path computes, for every feature that
path honours. bf16 is checked on a GPU only (the interpreter's bf16 products are wrong).

Run by test_triton_decode.py in a child process: the interpreter works only when
``TRITON_INTERPRET=1`` is set before Triton is first imported (its standard library's
reductions are built then), and the parent test process has imported it already.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine.runners.torch import triton_decode
from engine.runners.torch.attention import StaticDecode, _decode, _static_decode
from engine.runners.torch.kv_tensors import KVCache, KVCacheSpec

assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_triton_decode.py"


def _case(rows, heads, kv_heads, head_dim, block_size, width, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = width * rows + 3
    k = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g)[:rows * width].view(rows, width)
    seq_lens = torch.randint(1, width * block_size + 1, (rows,), generator=g)
    q = torch.randn(1, heads, rows, head_dim, generator=g).to(dtype)[0].transpose(0, 1)
    return q, k, v, tables, seq_lens


def _reference(q, k, v, tables, seq_lens, window=None, softcap=None):
    width = tables.shape[1] * k.shape[1]
    mask = (torch.arange(width)[None] < seq_lens[:, None])[:, None, None, :]
    return _decode(q.double(), k.double(), v.double(), tables, mask, q.shape[-1] ** -0.5,
                   window, softcap)


def _rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("rows,heads,kv_heads,head_dim,width", [
    (1, 8, 2, 32, 4),  # GQA, one split
    (3, 4, 4, 32, 40),  # MHA, context split in several programs
    (2, 12, 4, 32, 24),  # a group of 3 query heads (padded to the dot's 16 rows)
    (2, 9, 3, 24, 20),  # 3 KV heads and a head size that is not a power of two
])
def test_kernel_equals_gather_and_sdpa_in_float32(rows, heads, kv_heads, head_dim, width):
    q, k, v, tables, seq_lens = _case(rows, heads, kv_heads, head_dim, 16, width,
                                      torch.float32)
    out = triton_decode.paged_decode(q, k, v, tables, seq_lens, head_dim ** -0.5)
    assert out.shape == q.shape and out.is_contiguous()
    assert _rel_err(out, _reference(q, k, v, tables, seq_lens)) < 5e-6


@pytest.mark.parametrize("window,softcap", [(37, None), (None, 5.0), (100, 30.0), (1, None)])
def test_kernel_honours_sliding_window_and_softcap(window, softcap):
    q, k, v, tables, seq_lens = _case(2, 8, 2, 32, 8, 64, torch.float32, seed=1)
    seq_lens[0] = 512  # the longest row: the window cuts it
    assert triton_decode.num_splits(2, 2, 512) > 1
    out = triton_decode.paged_decode(q, k, v, tables, seq_lens, 32 ** -0.5, window, softcap)
    assert _rel_err(out, _reference(q, k, v, tables, seq_lens, window, softcap)) < 5e-6


def test_kernel_in_half_precision_matches_to_rounding():
    q, k, v, tables, seq_lens = _case(4, 8, 2, 64, 16, 20, torch.float16, seed=2)
    out = triton_decode.paged_decode(q, k, v, tables, seq_lens, 64 ** -0.5)
    assert out.dtype == torch.float16
    assert _rel_err(out, _reference(q, k, v, tables, seq_lens)) < 2e-3


def test_padded_row_attends_to_its_one_slot():
    q, k, v, tables, seq_lens = _case(2, 4, 2, 16, 16, 3, torch.float32, seed=3)
    seq_lens[1] = 1
    tables[1] = 0  # the scratch block
    out = triton_decode.paged_decode(q, k, v, tables, seq_lens, 0.25)
    first_slot_v = v[0, 0].repeat_interleave(2, dim=0)  # GQA: heads 2i, 2i+1 read kv head i
    torch.testing.assert_close(out[1], first_slot_v)


def test_split_count_fills_the_gpu_only_when_rows_do_not():
    assert triton_decode.num_splits(1, 8, 256) == 1
    assert triton_decode.num_splits(1, 8, 4096) == 16
    assert triton_decode.num_splits(64, 8, 4096) == 2
    assert triton_decode.num_splits(128, 8, 4096) == 1


@pytest.mark.parametrize("kv_heads,head_dim", [(2, 32), (3, 24)])
def test_write_kv_cache_fills_each_tokens_slot(kv_heads, head_dim):
    cache_k = torch.zeros(4, 16, kv_heads, head_dim)
    cache_v = torch.zeros(4, 16, kv_heads, head_dim)
    key = torch.randn(1, 3, kv_heads, head_dim).transpose(1, 2)  # [1, KVH, T, D] like HF's
    value = torch.randn(1, kv_heads, 3, head_dim)
    slots = torch.tensor([5, 40, 63])
    triton_decode.write_kv_cache(cache_k, cache_v, slots, key, value)
    flat_k = cache_k.view(-1, kv_heads, head_dim)
    flat_v = cache_v.view(-1, kv_heads, head_dim)
    torch.testing.assert_close(flat_k[slots], key[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(flat_v[slots], value[0].transpose(0, 1), rtol=0, atol=0)
    assert flat_k.abs().sum(-1).sum(-1).nonzero().flatten().tolist() == [5, 40, 63]


def test_static_decode_step_with_kernel_equals_gather_path():
    """The CUDA graph's attention call (``StaticDecode``) through the kernel and through
    gather + SDPA: same cache writes, same outputs."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16,
                       dtype=torch.float32)
    outs = []
    for kernel in (False, True):
        cache = KVCache(spec, 12, torch.device("cpu"))
        g = torch.Generator().manual_seed(4)
        for layer in range(2):
            cache.key[layer].copy_(torch.randn(cache.key[layer].shape, generator=g))
            cache.value[layer].copy_(torch.randn(cache.value[layer].shape, generator=g))
        tables = torch.tensor([[3, 7, 1, 11], [2, 11, 11, 11]])
        seq_lens = torch.tensor([50, 9])
        slots = torch.tensor([1 * 16 + 1, 2 * 16 + 8])  # position seq_len - 1 of each row
        meta = StaticDecode(cache, slots, tables, seq_lens, kernel=kernel)
        query = torch.randn(1, 8, 2, 32, generator=g)
        key = torch.randn(1, 2, 2, 32, generator=g)
        value = torch.randn(1, 2, 2, 32, generator=g)
        out = _static_decode(meta, 1, query, key, value, None, window=20, softcap=None)
        outs.append((out, cache.key[1].clone(), cache.value[1].clone()))
    (ref, ref_k, ref_v), (out, k, v) = outs
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_device_check_accepts_a_working_kernel():
    triton_decode._passes_check.cache_clear()
    assert triton_decode._passes_check(torch.device("cpu"), torch.float32, 2, 32)


def test_device_check_refuses_a_kernel_that_fails_or_computes_wrongly(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this GPU")

    for fake, said in ((broken, "unavailable"),
                       (lambda q, *a, **k: torch.zeros_like(q), "disagrees")):
        monkeypatch.setattr(triton_decode, "paged_decode", fake)
        triton_decode._passes_check.cache_clear()
        with caplog.at_level("WARNING"):
            assert not triton_decode._passes_check(torch.device("cpu"), torch.float32, 2, 32)
        assert said in caplog.text and "gather + SDPA" in caplog.text
    triton_decode._passes_check.cache_clear()


def test_kernel_is_for_cuda_and_heads_up_to_256(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not triton_decode.enabled(cpu, torch.float32, 2, 32)
    monkeypatch.setattr(triton_decode, "_passes_check", lambda *a: True)
    assert triton_decode.enabled(cuda, torch.bfloat16, 8, 128)
    assert triton_decode.enabled(cuda, torch.bfloat16, 3, 96)  # SmolLM2's 3, Phi-3's 96
    assert not triton_decode.enabled(cuda, torch.bfloat16, 8, 512)
    monkeypatch.setenv("GENSERVE_DECODE_ATTENTION", "sdpa")
    assert not triton_decode.enabled(cuda, torch.bfloat16, 8, 128)
