"""Paged attention plugged into transformers through its attention interface.

Registering one function under a name and loading the model with
``attn_implementation=NAME`` routes every attention layer of any HF architecture here,
with RoPE already applied to ``key``. The step's packed batch is laid out as: first one
token per *decode row* (each row its own query over its own cached prefix: plain decodes
and the k+1 queries of speculative batch expansion alike), then *prefill chunks*.
Every layer writes the step's keys/values into the paged cache first, then attends, so a
row sees every token written before it in the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine.kv_cache import KVCache

ATTN_NAME = "genserve_paged"


@dataclass
class PrefillChunk:
    start: int  # offset of the chunk's first token in the packed batch
    length: int
    ctx_len: int  # tokens of this sequence already in the cache before the chunk
    block_ids: torch.Tensor  # blocks covering ctx_len + length tokens
    mask: torch.Tensor | None  # [length, ctx_len + length] bool, None when ctx_len == 0


@dataclass
class AttentionMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [T] flat slot of each packed token
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks] long
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_blocks * block_size]
    prefills: list[PrefillChunk] = field(default_factory=list)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    **kwargs):
    """query ``[1, H, T, D]``, key/value ``[1, KVH, T, D]`` -> ``([1, T, H, D], None)``."""
    meta: AttentionMetadata = kwargs["genserve_meta"]
    layer = module.layer_idx
    k_cache = meta.kv_cache.key[layer]
    v_cache = meta.kv_cache.value[layer]
    _, n_kv, _, d = key.shape
    flat_k = k_cache.view(-1, n_kv, d)
    flat_v = v_cache.view(-1, n_kv, d)
    flat_k.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    flat_v.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))

    q = query[0].transpose(0, 1)  # [T, H, D]
    outs = []
    nd = meta.num_decode
    if nd:
        # index_select is ~7x faster than advanced indexing for this gather on CPU.
        flat_tables = meta.decode_block_tables.flatten()
        ks = k_cache.index_select(0, flat_tables).view(nd, -1, n_kv, d).transpose(1, 2)
        vs = v_cache.index_select(0, flat_tables).view(nd, -1, n_kv, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2), ks, vs, attn_mask=meta.decode_mask, scale=scaling,
            enable_gqa=True,
        )
        outs.append(o.squeeze(2))  # [nd, H, D]
    for chunk in meta.prefills:
        qc = query[:, :, chunk.start:chunk.start + chunk.length]
        if chunk.mask is None:
            kc = key[:, :, chunk.start:chunk.start + chunk.length]
            vc = value[:, :, chunk.start:chunk.start + chunk.length]
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scaling,
                                               enable_gqa=True)
        else:
            total = chunk.ctx_len + chunk.length
            kc = k_cache.index_select(0, chunk.block_ids).view(-1, n_kv, d)[:total]
            vc = v_cache.index_select(0, chunk.block_ids).view(-1, n_kv, d)[:total]
            kc, vc = kc.transpose(0, 1)[None], vc.transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=chunk.mask,
                                               scale=scaling, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))  # [length, H, D]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_NAME, paged_attention)
