"""Paged decode attention as one Triton kernel (CUDA graphs' decode step).

The eager decode gathers each row's KV blocks into a contiguous copy, builds a mask and
calls SDPA: ~10 small kernels a layer, which in a Llama-3-8B-shaped batch-1 step on an
H200 cost about as much time as a third of the weights' reads. Here one program per
(row, KV head, context split) reads the row's blocks through its block table in place,
attends with all the query heads that share that KV head (GQA) with an online softmax,
and writes its output (or, when the context is split, a partial that a second small kernel
combines: flash-decoding, so one long row still spreads over the GPU). Sliding windows and
logit soft-capping are honoured as in ``attention._attend``. float32 runs its products in
IEEE float32 (not TF32), so float32 conformance stays exact.

Kernels are built on first use: ``TRITON_INTERPRET=1`` set before that runs them on the
CPU (the tests do), and a machine without Triton never imports it.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch

log = logging.getLogger(__name__)

SPLIT_TOKENS = 256  # context tokens per program at most, before the context is split
TILE = 64  # context tokens per loop iteration
_TARGET_PROGRAMS = 528  # ~4 per multiprocessor of an H100/H200: enough to fill the GPU


def enabled(device: torch.device, dtype: torch.dtype, n_kv: int, head_dim: int) -> bool:
    """Use the kernel for CUDA decode steps unless ``GENSERVE_DECODE_ATTENTION=sdpa``
    (the gather + SDPA path, kept for comparison), Triton is missing, the head size is
    over 256, or the kernel fails its check on this device. Blocks are padded to powers
    of two (Triton's extents), so a head size of 96 (Phi-3) or 3 KV heads (SmolLM2) are
    fine."""
    if device.type != "cuda" or os.environ.get("GENSERVE_DECODE_ATTENTION") == "sdpa":
        return False
    if head_dim > 256:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return _passes_check(device, dtype, n_kv, head_dim)


@functools.cache
def _passes_check(device: torch.device, dtype: torch.dtype, n_kv: int, head_dim: int
                  ) -> bool:
    """One small launch against gather + SDPA before any graph is captured with it: a GPU
    or Triton build the kernel does not compile for (or computes wrongly on) keeps the
    old path, logged, instead of failing every graph or serving a wrong attention."""
    from engine.runners.torch.attention import _decode

    g = torch.Generator(device=device).manual_seed(0)
    rows, width, bs = 2, 40, 16
    k = torch.randn(width * rows, bs, n_kv, head_dim, generator=g, device=device).to(dtype)
    v = torch.randn(k.shape, generator=g, device=device).to(dtype)
    q = torch.randn(rows, 2 * n_kv, head_dim, generator=g, device=device).to(dtype)
    tables = torch.arange(width * rows, device=device).view(rows, width)
    seq_lens = torch.tensor([width * bs, 37], device=device)
    mask = (torch.arange(width * bs, device=device)[None] < seq_lens[:, None])[:, None, None]
    try:
        out = paged_decode(q, k, v, tables, seq_lens, head_dim ** -0.5)
        ref = _decode(q.float(), k.float(), v.float(), tables, mask, head_dim ** -0.5)
        err = ((out.float() - ref).norm() / ref.norm()).item()
    except Exception as e:  # any failure means: do not use it here
        log.warning("Triton paged decode attention unavailable on %s (%s: %s); CUDA graphs "
                    "attend by gather + SDPA", device, type(e).__name__, e)
        return False
    if not err < (2e-2 if dtype != torch.float32 else 1e-4):
        log.warning("Triton paged decode attention disagrees with SDPA on %s (relative "
                    "error %.2g); CUDA graphs attend by gather + SDPA", device, err)
        return False
    return True


@functools.cache
def _kernels() -> tuple[Any, Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def write_kv(key, value, k_cache, v_cache, slots, stride_kt, stride_kh, stride_vt,
                 stride_vh, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 KV_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
        t = tl.program_id(0)
        h = tl.arange(0, KV_PAD)[:, None]
        d = tl.arange(0, DIM_PAD)[None, :]
        live = (h < KV_HEADS) & (d < HEAD_DIM)
        dst = tl.load(slots + t).to(tl.int64) * (KV_HEADS * HEAD_DIM) + h * HEAD_DIM + d
        tl.store(k_cache + dst, tl.load(key + t * stride_kt + h * stride_kh + d, mask=live),
                 mask=live)
        tl.store(v_cache + dst, tl.load(value + t * stride_vt + h * stride_vh + d,
                                        mask=live), mask=live)

    @triton.jit
    def decode(q, k_cache, v_cache, tables, seq_lens, out, part_acc, part_ml,
               stride_qt, stride_qh, stride_tb, scale, softcap, window,
               KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
               HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               TILE_N: tl.constexpr,
               SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr):
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens + row).to(tl.int32)
        start = split * SPLIT
        end = tl.minimum(start + SPLIT, seq_len)
        lo = start
        if HAS_WINDOW:
            lo = tl.maximum(start, seq_len - window)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        dim = d[None, :] < HEAD_DIM
        heads = kvh * GROUP + g
        qv = tl.load(q + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                     mask=(g[:, None] < GROUP) & dim, other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        first = (lo // TILE_N) * TILE_N
        for t0 in range(first, end, TILE_N):
            n = t0 + tl.arange(0, TILE_N)
            valid = (n >= lo) & (n < end)
            block = tl.load(tables + row * stride_tb + n // BLOCK_SIZE, mask=valid, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
            off = (slot * KV_HEADS + kvh) * HEAD_DIM
            kt = tl.load(k_cache + off[:, None] + d[None, :], mask=valid[:, None] & dim,
                         other=0.0)
            vt = tl.load(v_cache + off[:, None] + d[None, :], mask=valid[:, None] & dim,
                         other=0.0)
            if IEEE:
                s = tl.dot(qv, tl.trans(kt), input_precision="ieee")
            else:
                s = tl.dot(qv, tl.trans(kt))
            s = s * scale
            if HAS_SOFTCAP:
                s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # tanh
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            denom = denom * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p, vt.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(vt.dtype), vt)
            acc = acc * alpha[:, None] + pv
            m = m_new
        live = g < GROUP
        if NUM_SPLITS == 1:
            o = acc / denom[:, None]
            tl.store(out + row * (KV_HEADS * GROUP * HEAD_DIM) + heads[:, None] * HEAD_DIM
                     + d[None, :], o.to(out.dtype.element_ty), mask=live[:, None] & dim)
        else:
            base = (row * KV_HEADS * GROUP + heads) * NUM_SPLITS + split
            tl.store(part_acc + base[:, None] * HEAD_DIM + d[None, :], acc,
                     mask=live[:, None] & dim)
            tl.store(part_ml + base * 2, m, mask=live)
            tl.store(part_ml + base * 2 + 1, denom, mask=live)

    @triton.jit
    def combine(part_acc, part_ml, out, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
        rh = tl.program_id(0)  # row * heads + head
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, DIM_PAD)
        live = s < NUM_SPLITS
        base = rh * NUM_SPLITS + s
        m = tl.load(part_ml + base * 2, mask=live, other=float("-inf"))
        denom = tl.load(part_ml + base * 2 + 1, mask=live, other=0.0)
        acc = tl.load(part_acc + base[:, None] * HEAD_DIM + d[None, :],
                      mask=live[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        top = tl.max(m, 0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
        o = tl.sum(acc * w[:, None], 0) / tl.sum(denom * w, 0)
        tl.store(out + rh * HEAD_DIM + d, o.to(out.dtype.element_ty), mask=d < HEAD_DIM)

    return write_kv, decode, combine


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def write_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   key: torch.Tensor, value: torch.Tensor) -> None:
    """key/value ``[1, KVH, T, D]`` into the slots ``slot_mapping [T]`` of
    ``[blocks, block_size, KVH, D]`` caches: one launch for both."""
    n_kv, d = k_cache.shape[2], k_cache.shape[3]
    k, v = _unit_last(key[0]), _unit_last(value[0])
    write_kv, _, _ = _kernels()
    write_kv[(k.shape[1],)](k, v, k_cache, v_cache, slot_mapping, k.stride(1), k.stride(0),
                            v.stride(1), v.stride(0), KV_HEADS=n_kv, HEAD_DIM=d,
                            KV_PAD=_pow2(n_kv), DIM_PAD=max(16, _pow2(d)))


def num_splits(rows: int, n_kv: int, width_tokens: int) -> int:
    """Context splits per (row, KV head): enough programs to fill the GPU, each at least
    a tile and at most ``SPLIT_TOKENS`` unless the rows alone fill it."""
    most = -(-width_tokens // SPLIT_TOKENS)
    want = -(-_TARGET_PROGRAMS // (rows * n_kv))
    return max(1, min(most, want))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q ``[B, H, D]`` (any strides with unit last) over each row's first ``seq_lens[b]``
    cached tokens, found through ``tables [B, W]`` -> ``[B, H, D]`` contiguous.
    The split count depends only on shapes, so a CUDA graph captures a fixed grid."""
    q = _unit_last(q)
    rows, n_heads, d = q.shape
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv
    width = tables.shape[1] * block_size
    splits = num_splits(rows, n_kv, width)
    per_split = -(-width // splits)
    split = -(-per_split // TILE) * TILE
    out = torch.empty(rows, n_heads, d, dtype=q.dtype, device=q.device)
    if splits > 1:
        part_acc = torch.empty(rows * n_heads * splits, d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(rows * n_heads * splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _, decode, combine = _kernels()
    decode[(rows, n_kv, splits)](
        q, k_cache, v_cache, tables, seq_lens, out, part_acc, part_ml,
        q.stride(0), q.stride(1), tables.stride(0), float(scale), float(softcap or 1.0),
        int(window or 0),
        KV_HEADS=n_kv, GROUP=group, GROUP_PAD=max(16, _pow2(group)), HEAD_DIM=d,
        DIM_PAD=max(16, _pow2(d)), BLOCK_SIZE=block_size, TILE_N=TILE, SPLIT=split,
        NUM_SPLITS=splits,
        HAS_SOFTCAP=softcap is not None, HAS_WINDOW=window is not None,
        IEEE=q.dtype == torch.float32)
    if splits > 1:
        combine[(rows * n_heads,)](part_acc, part_ml, out, HEAD_DIM=d,
                                   DIM_PAD=max(16, _pow2(d)), NUM_SPLITS=splits,
                                   SPLITS_PAD=max(2, _pow2(splits)))
    return out
