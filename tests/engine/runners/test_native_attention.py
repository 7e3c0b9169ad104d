"""The torch runner's native decode attention (native_attention.cpp): each row over its own
paged blocks read in place equals the gather + SDPA path, and a row's bits depend on nothing
but its own query and context."""

from __future__ import annotations

import types

import pytest
import torch

from engine.runners.torch import attention, native_gemm

pytestmark = pytest.mark.skipif(not native_gemm.cpu_supported(),
                                reason="the native kernels need an x86 CPU with AVX2/FMA")

BLOCK = 16


def _case(lens, heads=9, kv_heads=3, dim=64, blocks=160, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks, BLOCK, kv_heads, dim, generator=g)
    v = torch.randn(blocks, BLOCK, kv_heads, dim, generator=g)
    width = max(-(-n // BLOCK) for n in lens)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, dim, generator=g)
    seq_lens = torch.tensor(lens)
    mask = (torch.arange(width * BLOCK)[None] < seq_lens[:, None])[:, None, None, :]
    meta = attention.AttentionMetadata(kv_cache=None, slot_mapping=None,  # type: ignore[arg-type]
                                       num_decode=len(lens), decode_block_tables=tables,
                                       decode_mask=mask, decode_seq_lens=seq_lens)
    return q, k, v, tables, mask, meta


@pytest.fixture(scope="module", autouse=True)
def built():
    """Every test here loads the kernel first, whichever worker runs it."""
    assert native_gemm.available()


def test_the_kernel_builds_here():
    assert native_gemm.available()


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 1, 8)])
@pytest.mark.parametrize("window,softcap", [(None, None), (100, None), (None, 30.0),
                                            (7, 50.0)])
def test_rows_equal_the_gathered_sdpa_path(heads, kv_heads, dim, window, softcap):
    # 1 token, inside a block, several blocks, and long enough for split contexts
    q, k, v, tables, mask, meta = _case([1, 17, 300, 1100], heads, kv_heads, dim)
    want = attention._decode(q, k, v, tables, mask, 0.125, window, softcap)
    got = attention._native_decode(meta, q, k, v, 0.125, window, softcap)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_lengths_come_from_the_mask_when_the_step_has_none():
    q, k, v, tables, mask, meta = _case([3, 40, 700])
    want = attention._native_decode(meta, q, k, v, None, None, None)
    meta.decode_seq_lens = None
    assert torch.equal(attention._native_decode(meta, q, k, v, None, None, None), want)


def test_a_rows_bits_do_not_depend_on_the_other_rows_or_the_thread_count():
    lens = [900, 5, 260, 33, 1200, 129]
    q, k, v, tables, mask, meta = _case(lens)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = attention._native_decode(meta, q, k, v, 0.2, None, None)
        torch.set_num_threads(1)
        assert torch.equal(attention._native_decode(meta, q, k, v, 0.2, None, None), batch)
    finally:
        torch.set_num_threads(before)
    for i in range(len(lens)):
        alone = attention.AttentionMetadata(
            kv_cache=None, slot_mapping=None, num_decode=1,  # type: ignore[arg-type]
            decode_block_tables=tables[i:i + 1], decode_mask=mask[i:i + 1],
            decode_seq_lens=meta.decode_seq_lens[i:i + 1])
        assert torch.equal(attention._native_decode(alone, q[i:i + 1], k, v, 0.2, None, None),
                           batch[i:i + 1]), i


def test_a_length_outside_the_table_is_refused():
    q, k, v, tables, mask, meta = _case([20])
    meta.decode_seq_lens = torch.tensor([tables.shape[1] * BLOCK + 1])
    with pytest.raises(RuntimeError, match="outside its table"):
        attention._native_decode(meta, q, k, v, None, None, None)


def test_only_fp32_cpu_steps_with_head_dims_in_eights_use_it(monkeypatch):
    q, k, v, *_ = _case([4])
    assert attention.native_decode_usable(q, k)
    assert not attention.native_decode_usable(q.bfloat16(), k.bfloat16())
    assert not attention.native_decode_usable(q[..., :60], k[..., :60])
    monkeypatch.setattr(native_gemm, "available", lambda: False)
    assert not attention.native_decode_usable(q, k)


def test_the_eager_step_attends_through_it(monkeypatch):
    calls = []
    real = attention._native_decode

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "_native_decode", spy)
    from engine.runners.torch.kv_tensors import KVCache, KVCacheSpec

    cache = KVCache(KVCacheSpec(1, 3, 64, BLOCK, torch.float32), 8, torch.device("cpu"))
    q, _, _, _, _, meta = _case([5, 20], blocks=8)
    meta.kv_cache = cache
    meta.slot_mapping = torch.tensor([4, 3 * BLOCK + 3])
    key = torch.randn(1, 3, 2, 64)
    out = attention._paged_attention(meta, 0, q.transpose(0, 1)[None], key, key, None)
    assert out.shape == (1, 2, 9, 64) and calls == [(2, 9, 64)]


# ---- causal_prefill: a prompt chunk over its cached past (the llama.cpp runner's float32
# torch prefill, through blocked_attention.native_causal_attention) ----


def _chunk(heads, kv_heads, dim, past, n, seed=0, spread=3.0):
    """q in transformers' layout (a transposed view, as its attention gets it), k and v
    over past + n positions; large scores (``spread``) make the softmax peaked."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, n, heads, dim, generator=g) * spread).transpose(1, 2)
    k = torch.randn(1, kv_heads, past + n, dim, generator=g) * spread
    v = torch.randn(1, kv_heads, past + n, dim, generator=g)
    return q, k, v


def _float64_causal(q, k, v, scale):
    """[1, n, heads, dim]: the chunk's rows at positions past .. past + n - 1, in float64."""
    group, n, total = q.shape[1] // k.shape[1], q.shape[2], k.shape[2]
    kk, vv = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = (q.double() @ kk.transpose(-1, -2)) * scale
    seen = torch.ones(n, total, dtype=torch.bool).tril(total - n)
    return (torch.softmax(scores.masked_fill(~seen, float("-inf")), -1) @ vv).transpose(1, 2)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (8, 1, 64)])
@pytest.mark.parametrize("past,n", [(0, 1), (0, 7), (0, 100), (5, 50), (130, 97), (700, 300),
                                    (1, 512)])
def test_a_prefill_chunk_is_as_close_to_float64_as_sdpas(heads, kv_heads, dim, past, n):
    """Every block and tile edge: fewer rows than a tile, a unit or a key block, a past
    that ends mid-block, grouped and ungrouped heads."""
    import torch.nn.functional as F

    q, k, v = _chunk(heads, kv_heads, dim, past, n)
    scale = dim ** -0.5
    ref = _float64_causal(q, k, v, scale)
    got = torch.ops.genserve_attention.causal_prefill(q, k, v, scale)
    seen = torch.ones(n, past + n, dtype=torch.bool).tril(past)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=scale,
                                          enable_gqa=True).transpose(1, 2)
    assert got.shape == (1, n, heads, dim) and got.is_contiguous()
    sdpa_err = (sdpa.double() - ref).abs().max().item()
    assert (got.double() - ref).abs().max().item() <= max(2 * sdpa_err, 1e-6)


def test_a_prefill_row_sees_no_later_key():
    """A key after a row's position changes nothing of that row, bit for bit (its weight is
    exactly 0, not e^-87)."""
    q, k, v = _chunk(9, 3, 64, past=40, n=200)
    base = torch.ops.genserve_attention.causal_prefill(q, k, v, 0.125)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 150:] += 1e4
    v2[:, :, 150:] = 1e30  # would swamp any row that weighed them at all
    moved = torch.ops.genserve_attention.causal_prefill(q, k2, v2, 0.125)
    torch.testing.assert_close(moved[:, :110], base[:, :110], rtol=0, atol=0)  # 40 + 110 = 150


def test_the_prefill_thread_count_changes_nothing():
    q, k, v = _chunk(9, 3, 64, past=300, n=260)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.genserve_attention.causal_prefill(q, k, v, 0.125)
        torch.set_num_threads(2)
        two = torch.ops.genserve_attention.causal_prefill(q, k, v, 0.125)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, two, rtol=0, atol=0)


@pytest.mark.parametrize("bad", ["bf16", "head_size", "groups"])
def test_the_prefill_kernel_refuses_what_it_does_not_compute(bad):
    q, k, v = _chunk(9, 3, 64, past=3, n=5)
    if bad == "bf16":
        q = q.bfloat16()
    elif bad == "head_size":
        q, k, v = _chunk(4, 4, 32, past=3, n=5)
    else:
        q, k, v = _chunk(8, 3, 64, past=3, n=5)
    with pytest.raises(RuntimeError, match="causal_prefill"):
        torch.ops.genserve_attention.causal_prefill(q, k, v, 0.125)


def test_the_float32_prefill_attention_runs_the_kernel_and_falls_back_for_the_rest(
        monkeypatch):
    from engine.runners import blocked_attention

    calls = []
    real = torch.ops.genserve_attention.causal_prefill

    class Ops:
        @staticmethod
        def causal_prefill(*args):
            calls.append(args[0].shape)
            return real(*args)

    monkeypatch.setattr(torch.ops, "genserve_attention", Ops)
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    q, k, v = _chunk(9, 3, 64, past=10, n=20)
    out, _ = blocked_attention.native_causal_attention(module, q, k, v, None, scaling=0.125)
    assert calls == [(1, 9, 20, 64)]
    torch.testing.assert_close(out.double(), _float64_causal(q, k, v, 0.125), atol=1e-5,
                               rtol=1e-5)
    q, k, v = _chunk(6, 2, 16, past=10, n=20)  # a head size it is not built for: split SDPA
    out, _ = blocked_attention.native_causal_attention(module, q, k, v, None, scaling=0.125)
    assert len(calls) == 1
    torch.testing.assert_close(out.double(), _float64_causal(q, k, v, 0.125), atol=1e-5,
                               rtol=1e-5)
