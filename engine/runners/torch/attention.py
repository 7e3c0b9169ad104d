"""Paged attention plugged into transformers through its attention interface.

Registering one function under a name and loading the model with
``attn_implementation=NAME`` routes every attention layer of any HF architecture here,
with RoPE already applied to ``key``. The step's packed batch is laid out as: first one
token per *decode row* (each row its own query over its own cached prefix: plain decodes
and the k+1 queries of speculative batch expansion alike), then *prefill chunks*.
Every layer writes the step's keys/values into the paged cache first, then attends, so a
row sees every token written before it in the same step.

Compiled decode steps (engine/runners/torch/compiled_step.py) pass one of two markers instead of an
``AttentionMetadata``:

- ``OpaqueDecode``: attention runs as the custom op ``genserve::decode_attention``, which
  the compiler treats as a black box and splits the graph at (vLLM's piecewise compile;
  the compiled step then calls the op's Python body directly). Its eager body reads this
  step's metadata from ``forward_context``, so the graph around it does not depend on
  the context length while the gathered context is only as wide as the step's longest
  row.
- ``StaticDecode``: attention stays in the graph over a full-width block table, masked by
  sequence length; no host values, so it can be captured as a CUDA graph.

Per-layer features transformers passes to the attention function are honoured on every
path: ``sliding_window`` (a query sees only the last ``sliding_window`` positions, itself
included: Mistral, Gemma 2/3's local layers, Qwen2 with ``use_sliding_window``) and
``softcap`` (tanh soft-capping of the attention logits: Gemma 2). Any other feature
kwarg with a value is refused (``UnsupportedModelFeature``): the runner probes the model at
load, so a model needing one is refused at start instead of served wrong.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface

from engine.runners.torch import native_gemm, triton_decode
from engine.runners.torch.kv_tensors import KVCache

ATTN_NAME = "genserve_paged"

# Keyword arguments transformers passes to an attention function that change nothing here:
# our metadata, positions (RoPE is applied before the call), and switches for training or
# for other kernels. Any other keyword with a value is a feature this attention lacks.
_INERT_KWARGS = frozenset({
    "genserve_meta", "position_ids", "cache_position", "output_attentions", "use_cache",
    "is_causal", "dropout", "logits_to_keep", "position_embeddings", "past_key_values",
    "past_key_value", "layer_idx", "return_dict", "output_hidden_states",
})


class UnsupportedModelFeature(ValueError):
    """The model asks the attention for something it cannot do (named in the message)."""


def check_attention_kwargs(kwargs: dict) -> None:
    unknown = sorted(k for k, v in kwargs.items()
                     if k not in _INERT_KWARGS and v is not None and v is not False)
    if unknown:
        raise UnsupportedModelFeature(
            f"the model's attention needs {', '.join(unknown)}, which genserve's paged "
            f"attention does not implement")


@dataclass
class PrefillChunk:
    start: int  # offset of the chunk's first token in the packed batch
    length: int
    ctx_len: int  # tokens of this sequence already in the cache before the chunk
    block_ids: torch.Tensor  # blocks covering ctx_len + length tokens
    mask: torch.Tensor | None  # [length, ctx_len + length] bool, None when ctx_len == 0


@dataclass
class DecodeGroups:
    """Consecutive rows over the same block table (a sequence's 1 + k batch-expansion
    rows) attend as one ``R``-query group, so the group's context is gathered once
    instead of once per row (on a CPU that gather grew ~4x from 1 to 9 rows)."""

    tables: torch.Tensor  # [G, W] long: one table per group
    rows: torch.Tensor  # [G, R] long: each group's rows (padded with its first row)
    mask: torch.Tensor  # [G, 1, R, W * block_size] bool
    row_slot: torch.Tensor  # [rows] long: where each row's output is in [G * R]


@dataclass
class AttentionMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [T] flat slot of each packed token
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks] long
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_blocks * block_size]
    decode_groups: DecodeGroups | None = None  # rows sharing a block table
    decode_seq_lens: torch.Tensor | None = None  # [num_decode] long (else from the mask)
    prefills: list[PrefillChunk] = field(default_factory=list)


@dataclass(frozen=True, eq=False)
class OpaqueDecode:
    """Marker: decode-only step whose attention is the opaque ``decode_attention`` op."""


@dataclass(eq=False)
class StaticDecode:
    """Decode-only step over static buffers: tables ``[B, W]`` cover ``max_model_len``."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, W] long
    seq_lens: torch.Tensor  # [B] long, >= 1 (padded rows attend to the scratch slot)
    kernel: bool = False  # attend with triton_decode's paged kernel instead of gather + SDPA


@dataclass
class _ForwardContext:
    meta: AttentionMetadata | StaticDecode
    next_layer: int = 0  # opaque attention calls come in layer order


class _Current(threading.local):
    """Per thread: a server compiles in a background thread while the step loop runs, and
    a second engine in the process (tests) may compile at the same time."""

    forward: _ForwardContext | None = None


_current = _Current()


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata | StaticDecode,
                    num_layers: int | None = None) -> Iterator[None]:
    """Hand ``meta`` to the opaque attention op for the duration of one forward; with
    ``num_layers``, check that every layer's attention ran exactly once."""
    prev = _current.forward
    ctx = _current.forward = _ForwardContext(meta)
    try:
        yield
        if num_layers is not None and ctx.next_layer != num_layers:
            raise RuntimeError(f"compiled step ran {ctx.next_layer} attention layers, "
                               f"expected {num_layers}")
    finally:
        _current.forward = prev


def _write_cache(kv_cache: KVCache, layer: int, slot_mapping: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache = kv_cache.key[layer]
    v_cache = kv_cache.value[layer]
    _, n_kv, _, d = key.shape
    k_cache.view(-1, n_kv, d).index_copy_(0, slot_mapping, key[0].transpose(0, 1))
    v_cache.view(-1, n_kv, d).index_copy_(0, slot_mapping, value[0].transpose(0, 1))
    return k_cache, v_cache


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scaling: float | None, softcap: float | None,
            is_causal: bool = False) -> torch.Tensor:
    """``[..., H, Lq, D]`` queries over ``[..., KVH, Lk, D]`` keys/values. SDPA has no
    logit soft-capping, so a soft-capped layer (Gemma 2) runs the math explicitly, softmax
    in float32 as transformers' eager attention does."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              scale=scaling, enable_gqa=True)
    if k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.tanh((q @ k.transpose(-1, -2)) * (scale / softcap)) * softcap
    if is_causal:
        mask = _band(q.shape[-2], k.shape[-2], k.shape[-2] - q.shape[-2], None, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


# Prefill on CUDA leaves cuDNN attention out: it builds an execution plan for every new
# sequence length (0.5-1.2 s for a 2k prompt on an H200, torch 2.11), which each new prompt
# length would pay in its time to first token; flash / memory-efficient attention need
# none. Decode steps (CUDA graphs) keep torch's own choice.
_PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                     SDPBackend.MATH]


def _prefill_kernels(device: torch.device) -> contextlib.AbstractContextManager[None]:
    if device.type == "cuda":
        return sdpa_kernel(_PREFILL_BACKENDS)
    return contextlib.nullcontext()


def _band(n_q: int, n_k: int, q_start: int, window: int | None,
          device: torch.device) -> torch.Tensor:
    """``[n_q, n_k]`` bool: query ``i`` (at position ``q_start + i``) sees key ``j`` when
    ``j <= q_start + i`` and, with a window, ``j > q_start + i - window``."""
    q_pos = torch.arange(q_start, q_start + n_q, device=device)[:, None]
    k_pos = torch.arange(n_k, device=device)[None, :]
    band = k_pos <= q_pos
    if window is not None:
        band &= k_pos > q_pos - window
    return band


def _windowed(mask: torch.Tensor, window: int | None) -> torch.Tensor:
    """A decode mask (each row sees a prefix of its gathered slots) cut to the last
    ``window`` slots of that prefix."""
    if window is None:
        return mask
    seen = mask.sum(-1, keepdim=True)
    slots = torch.arange(mask.shape[-1], device=mask.device)
    return mask & (slots >= seen - window)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            tables: torch.Tensor, mask: torch.Tensor, scaling: float | None,
            window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q ``[nd, H, D]`` over each row's gathered blocks ``tables [nd, W]`` -> ``[nd, H, D]``."""
    nd = q.shape[0]
    n_kv, d = k_cache.shape[2], k_cache.shape[3]
    # index_select is ~7x faster than advanced indexing for this gather on CPU.
    flat = tables.flatten()
    ks = k_cache.index_select(0, flat).view(nd, -1, n_kv, d).transpose(1, 2)
    vs = v_cache.index_select(0, flat).view(nd, -1, n_kv, d).transpose(1, 2)
    o = _attend(q.unsqueeze(2), ks, vs, _windowed(mask, window), scaling, softcap)
    return o.squeeze(2)


def _grouped_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    groups: DecodeGroups, scaling: float | None, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Like ``_decode``, but each group of rows (a sequence's speculative rows) is one
    multi-query attention over its context, gathered once."""
    n_groups, size = groups.rows.shape
    n_kv, d = k_cache.shape[2], k_cache.shape[3]
    flat = groups.tables.flatten()
    ks = k_cache.index_select(0, flat).view(n_groups, -1, n_kv, d).transpose(1, 2)
    vs = v_cache.index_select(0, flat).view(n_groups, -1, n_kv, d).transpose(1, 2)
    qg = q.index_select(0, groups.rows.flatten()).view(n_groups, size, *q.shape[1:])
    o = _attend(qg.transpose(1, 2), ks, vs, _windowed(groups.mask, window), scaling,
                softcap)  # [G, H, R, D]
    return o.transpose(1, 2).reshape(n_groups * size, *q.shape[1:]).index_select(
        0, groups.row_slot)


# GENSERVE_DECODE_ATTENTION=sdpa: the gather + SDPA path on the CPU too, for comparison
_NATIVE_DECODE = os.environ.get("GENSERVE_DECODE_ATTENTION") != "sdpa"


def native_decode_usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the native kernel (native_attention.cpp) can run this step's decode rows:
    fp32 on a CPU where the native kernels built, head dims in multiples of 8."""
    return (q.device.type == "cpu" and q.dtype == torch.float32
            and k_cache.dtype == torch.float32 and q.shape[-1] % 8 == 0
            and k_cache.is_contiguous() and _NATIVE_DECODE and native_gemm.available())


def _native_decode(meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, scaling: float | None, window: int | None,
                   softcap: float | None) -> torch.Tensor:
    """Every decode row over its own blocks, read in place: q ``[nd, H, D]`` -> same."""
    assert meta.decode_block_tables is not None and meta.decode_mask is not None
    if meta.decode_seq_lens is None:
        meta.decode_seq_lens = meta.decode_mask.flatten(1).sum(-1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    return torch.ops.genserve_attention.paged_decode(
        q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, float(scale),
        window or 0, softcap or 0.0)


def _paged_attention(meta: AttentionMetadata, layer: int, query: torch.Tensor,
                     key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                     window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """The eager step: ``[1, H, T, D]`` queries -> ``[1, T, H, D]``."""
    k_cache, v_cache = _write_cache(meta.kv_cache, layer, meta.slot_mapping, key, value)
    outs = []
    nd = meta.num_decode
    if nd:
        assert meta.decode_block_tables is not None and meta.decode_mask is not None
        q = query[0, :, :nd].transpose(0, 1)  # [nd, H, D]
        if native_decode_usable(q, k_cache):
            outs.append(_native_decode(meta, q, k_cache, v_cache, scaling, window, softcap))
        elif meta.decode_groups is not None:
            outs.append(_grouped_decode(q, k_cache, v_cache, meta.decode_groups, scaling,
                                        window, softcap))
        else:
            outs.append(_decode(q, k_cache, v_cache, meta.decode_block_tables,
                                meta.decode_mask, scaling, window, softcap))
    with _prefill_kernels(query.device):
        outs.extend(_prefill_chunk(chunk, query, key, value, k_cache, v_cache,
                                   scaling, window, softcap) for chunk in meta.prefills)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
    return out.unsqueeze(0)


def _prefill_chunk(chunk: PrefillChunk, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   scaling: float | None, window: int | None,
                   softcap: float | None) -> torch.Tensor:
    """One prompt chunk's attention -> ``[length, H, D]``."""
    n_kv, d = key.shape[1], key.shape[3]
    qc = query[:, :, chunk.start:chunk.start + chunk.length]
    if chunk.mask is None:
        kc = key[:, :, chunk.start:chunk.start + chunk.length]
        vc = value[:, :, chunk.start:chunk.start + chunk.length]
        mask = (None if window is None or window >= chunk.length
                else _band(chunk.length, chunk.length, 0, window, query.device))
        o = _attend(qc, kc, vc, mask, scaling, softcap, is_causal=mask is None)
    else:
        total = chunk.ctx_len + chunk.length
        kc = k_cache.index_select(0, chunk.block_ids).view(-1, n_kv, d)[:total]
        vc = v_cache.index_select(0, chunk.block_ids).view(-1, n_kv, d)[:total]
        kc, vc = kc.transpose(0, 1)[None], vc.transpose(0, 1)[None]
        mask = chunk.mask
        if window is not None and window < total:
            mask = _band(chunk.length, total, chunk.ctx_len, window, query.device)
        o = _attend(qc, kc, vc, mask, scaling, softcap)
    return o[0].transpose(0, 1)


def decode_attention_impl(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          scaling: float, window: int = 0, softcap: float = 0.0
                          ) -> torch.Tensor:
    """Eager paged attention of the next layer inside a compiled step (metadata from
    ``forward_context``). The layer index is counted, not passed, so every layer's graph
    is the same and compiles once. Writes the cache as a side effect the compiler does
    not see: declaring the cache as mutated would make the compiler copy it. ``window``
    and ``softcap`` 0 = none (custom-op arguments cannot be optional scalars here)."""
    ctx = _current.forward
    assert ctx is not None, "decode_attention outside forward_context"
    layer = ctx.next_layer
    ctx.next_layer += 1
    if isinstance(ctx.meta, StaticDecode):  # an inductor-compiled step inside a CUDA graph
        return _static_decode(ctx.meta, layer, query, key, value, scaling, window or None,
                              softcap or None).contiguous()
    return _paged_attention(ctx.meta, layer, query, key, value, scaling, window or None,
                            softcap or None).contiguous()


decode_attention = torch.library.custom_op("genserve::decode_attention", mutates_args=())(
    decode_attention_impl)


@decode_attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
      scaling: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


def _static_decode(meta: StaticDecode, layer: int, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, scaling: float | None, window: int | None = None,
                   softcap: float | None = None) -> torch.Tensor:
    if meta.kernel:  # CUDA: one Triton kernel reads the blocks in place (triton_decode.py)
        k_cache, v_cache = meta.kv_cache.key[layer], meta.kv_cache.value[layer]
        triton_decode.write_kv_cache(k_cache, v_cache, meta.slot_mapping, key, value)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = triton_decode.paged_decode(query[0].transpose(0, 1), k_cache, v_cache,
                                         meta.block_tables, meta.seq_lens, scale, window,
                                         softcap)
        return out.unsqueeze(0)
    k_cache, v_cache = _write_cache(meta.kv_cache, layer, meta.slot_mapping, key, value)
    width = meta.block_tables.shape[1] * k_cache.shape[1]
    mask = torch.arange(width, device=query.device)[None, :] < meta.seq_lens[:, None]
    q = query[0].transpose(0, 1)
    return _decode(q, k_cache, v_cache, meta.block_tables, mask[:, None, None, :],
                   scaling, window, softcap).unsqueeze(0)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    sliding_window=None, softcap=None, **kwargs):
    """query ``[1, H, T, D]``, key/value ``[1, KVH, T, D]`` -> ``([1, T, H, D], None)``."""
    meta = kwargs["genserve_meta"]
    if isinstance(meta, _Probe):
        meta.record(module, kwargs)
    layer = module.layer_idx
    window = int(sliding_window) if sliding_window else None
    cap = float(softcap) if softcap else None
    if isinstance(meta, _Probe):
        meta = meta.meta
    if isinstance(meta, OpaqueDecode):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return decode_attention(query, key, value, float(scale), window or 0,
                                cap or 0.0), None
    if isinstance(meta, StaticDecode):
        return _static_decode(meta, layer, query, key, value, scaling, window, cap), None
    return _paged_attention(meta, layer, query, key, value, scaling, window, cap), None


@dataclass(eq=False)
class _Probe:
    """Wraps one step's metadata to record what each attention call is asked for."""

    meta: AttentionMetadata
    layers: list[int] = field(default_factory=list)

    def record(self, module, kwargs: dict) -> None:
        check_attention_kwargs(kwargs)
        self.layers.append(getattr(module, "layer_idx", -1))


def probe_step(meta: AttentionMetadata) -> _Probe:
    """``meta`` for a forward that also checks each attention call's features and counts
    the layers that called (``probe.layers``): the runner's load-time model check."""
    return _Probe(meta)


AttentionInterface.register(ATTN_NAME, paged_attention)
