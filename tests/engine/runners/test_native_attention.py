"""The torch runner's native decode attention (native_attention.cpp): each row over its own
paged blocks read in place equals the gather + SDPA path, and a row's bits depend on nothing
but its own query and context."""

from __future__ import annotations

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
