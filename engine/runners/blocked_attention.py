"""Causal attention for one sequence's prefill chunk as plain GEMMs over blocks of query
rows: the attention the llama.cpp runner's torch prefill (``--torch-prefill-tokens``) runs.

Why: on this CPU (AVX512-BF16, two cores) SDPA's flash kernel runs a bf16 causal attention
at about fp32's speed (3,000 tokens, 9 heads of 64: 0.081 s a layer bf16, 0.091 s fp32),
while oneDNN's bf16 GEMMs run ~2x its rate. Scores for 256 query rows at a time against
the keys they may see (``q @ k.T``), a softmax, then ``p @ v``: the default model's
3,000-token prefill in 512-token chunks took 3.5-4.5 s against 4.8-5.5 s with SDPA
(interleaved, the same weights; a 1,024-token prompt 1.0 s against 1.2 s), its last
logits as close to fp32's as SDPA's (KL at most 6e-5 over six prompts, SDPA's 3e-4).

In float32 (a CPU without AVX512-BF16) SDPA's flash kernel beats these GEMMs, but handed a
chunk's mask over ``past`` cached tokens it computes and masks every score, reading the
mask too. ``split_causal_attention`` (``SPLIT_NAME``) calls the flash kernel twice instead,
the chunk's rows over the past unmasked and over the chunk itself with ``is_causal``, and
merges the two by their log-sum-exps: measured here (2-core AVX2 EPYC, 9 heads of 64, 30
layers, 512-token chunks) 3,000 tokens' attention 4.28 s against 5.01 s masked (one causal
call over the whole prompt: 4.05 s), 1,024 tokens 0.63 against 0.68 s.
``native_causal_attention`` (``NATIVE_NAME``) runs float32 head sizes of 64 and 128 through
the native library's flash-attention kernel (``causal_prefill`` in
engine/runners/torch/native_attention.cpp) where it is built: the same 30 layers' attention
0.29-0.36 s against 0.50-0.67 s at 1,024 tokens, 2.3-2.9 s against 3.2-4.3 s at 3,000
(alternating), as close to a float64 reference as SDPA's.

Scope: batch 1, a causal mask over positions ``past .. past + L - 1`` (a prompt chunk on
top of ``past`` cached tokens: what the torch prefill runs); anything else (a sliding
window, soft-capping, attention sinks, padding, dropout) goes to transformers' SDPA.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "genserve_blocked_causal"
SPLIT_NAME = "genserve_split_causal"
NATIVE_NAME = "genserve_native_causal"
NATIVE_HEAD_SIZES = (64, 128)  # what causal_prefill is compiled for
ROWS = 256  # query rows a block (128 and 256 read the same here; 512 was slower)
SCORES_BYTES = 64 * 2**20  # fewer rows where a block's scores would pass this
# Keyword arguments Llama-like models pass that do not change what is computed here.
HARMLESS = {"position_ids", "cache_position", "output_attentions", "is_causal",
            "use_cache", "past_key_values", "position_embeddings"}


def _plain(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           dropout: float, kwargs: dict[str, Any]) -> bool:
    """Whether this call is the plain causal attention of one sequence."""
    if query.shape[0] != 1 or dropout or query.shape[1] % key.shape[1]:
        return False
    if value.shape[1] != key.shape[1] or value.shape[-1] != query.shape[-1]:
        return False  # e.g. multi-head latent attention's value width
    if getattr(module, "sliding_window", None) or kwargs.get("is_causal") is False:
        return False
    return all(v is None or v is False or k in HARMLESS for k, v in kwargs.items())


def blocked_causal_attention(module: Any, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             dropout: float = 0.0, scaling: float | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: ``query [1, heads, L, d]``, ``key`` /
    ``value [1, kv heads, past + L, d]``; returns ``[1, L, heads, d]``. The mask is not read
    (batch 1 without padding: causal with the offset ``past``)."""
    if not _plain(module, query, key, value, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    _, heads, n_q, d = query.shape
    kv_heads, n_kv = key.shape[1], key.shape[2]
    group, past = heads // kv_heads, n_kv - n_q
    scale = scaling if scaling is not None else d ** -0.5
    # query heads h * group .. h * group + group - 1 share kv head h (transformers' repeat_kv)
    q = (query * scale).view(1, kv_heads, group, n_q, d)
    out = torch.empty(1, kv_heads, group, n_q, d, dtype=query.dtype, device=query.device)
    rows = max(16, min(ROWS, SCORES_BYTES // (heads * n_kv * query.element_size())))
    most = heads * min(rows, n_q) * n_kv
    scores_buf, probs_buf = _workspace(2 * most, query).split(most)
    for start in range(0, n_q, rows):
        end = min(start + rows, n_q)
        n, seen = end - start, past + end
        shape, numel = (1, kv_heads, group * n, seen), heads * n * seen
        block = q[:, :, :, start:end].reshape(1, kv_heads, group * n, d)
        scores = scores_buf[:numel].view(shape)
        torch.matmul(block, key[:, :, :seen].transpose(-1, -2), out=scores)
        diagonal = scores.view(1, kv_heads, group, n, seen)[..., past + start:]
        diagonal.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=query.device)
                              .triu(1), float("-inf"))
        probs = probs_buf[:numel].view(shape)
        torch.softmax(scores, dim=-1, out=probs)
        out[:, :, :, start:end] = torch.matmul(probs, value[:, :, :seen]).view(
            1, kv_heads, group, n, d)
    return out.view(1, heads, n_q, d).transpose(1, 2).contiguous(), None


def split_causal_attention(module: Any, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: torch.Tensor | None,
                           dropout: float = 0.0, scaling: float | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``blocked_causal_attention``'s contract, by SDPA's CPU flash kernel: the chunk over
    its past (no mask) and over itself (causal), merged by log-sum-exp."""
    if not _plain(module, query, key, value, dropout, kwargs) or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    heads, n_q = query.shape[1], query.shape[2]
    group, past = heads // key.shape[1], key.shape[2] - n_q
    key, value = repeat_kv(key, group), repeat_kv(value, group)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(query, key[:, :, past:], value[:, :, past:], 0.0, True, scale=scaling)
    if past:
        old, old_lse = flash(query, key[:, :, :past], value[:, :, :past], 0.0, False,
                             scale=scaling)
        top = torch.maximum(lse, old_lse)
        w_new, w_old = torch.exp(lse - top), torch.exp(old_lse - top)
        total = w_new + w_old
        out = out * (w_new / total).unsqueeze(-1) + old * (w_old / total).unsqueeze(-1)
    return out.transpose(1, 2).contiguous(), None


def native_causal_attention(module: Any, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            dropout: float = 0.0, scaling: float | None = None,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``blocked_causal_attention``'s contract through the native flash-attention kernel
    (float32 on the CPU, head size 64 or 128, the native library loaded); anything else
    through ``split_causal_attention``."""
    from engine.runners.torch import native_gemm

    if (query.dtype != torch.float32 or query.device.type != "cpu"
            or query.shape[-1] not in NATIVE_HEAD_SIZES or not native_gemm.available()
            or not _plain(module, query, key, value, dropout, kwargs)):
        return split_causal_attention(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (key, value))
    query = query if query.stride(-1) == 1 else query.contiguous()
    return torch.ops.genserve_attention.causal_prefill(query, key, value, scale), None


_kept = threading.local()


def _workspace(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A flat buffer of at least ``numel`` elements kept between calls (per thread, dtype
    and device). Why: a block's scores are megabytes, and fresh ones each block meant
    fresh pages from the kernel: a 3,000-token prefill in the engine took 5.0-5.3 s with
    ~900,000 page faults a prompt, 4.0-4.2 s with the memory kept (by malloc settings)."""
    key = (like.dtype, like.device)
    buffers = _kept.__dict__.setdefault("buffers", {})
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


AttentionInterface.register(NAME, blocked_causal_attention)
AttentionInterface.register(SPLIT_NAME, split_causal_attention)
AttentionInterface.register(NATIVE_NAME, native_causal_attention)
# transformers builds no mask at all for an attention name without a mask function, so
# the sliding-window layers that go to SDPA here would see every earlier token: SDPA's
# masks (None where a plain causal chunk allows it, which the blocked path assumes).
AttentionMaskInterface.register(NAME, sdpa_mask)
AttentionMaskInterface.register(SPLIT_NAME, sdpa_mask)
AttentionMaskInterface.register(NATIVE_NAME, sdpa_mask)
