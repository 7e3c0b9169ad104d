"""RMSNorm, the MLP's SiLU(gate) x up and the attention's rotary embedding as one native
pass each (native_elementwise.cpp), for the llama.cpp runner's float32 torch prefill
(llamacpp_handoff.load_torch_prefill).

Why: transformers runs a float32 RMSNorm as five ops, the MLP's activation as two (silu,
then a multiply of two column slices of the fused gate/up product) and the rotary
embedding as ~8 (q then copied into the attention kernel's layout), each a pass over the
chunk into a fresh tensor. On a 2-core AVX2 EPYC (cProfile, 1,024-token prompt in
512-token chunks) the multiply alone took ~0.14 s, silu ~0.04 s, the norms ~0.06 s and
the rotary embedding with q's copy ~0.13 s of a 2.5 s prefill whose linears and attention
were already native.

Taken only for transformers' own Llama, Mistral and Qwen2 modules: RMSNorms; MLPs whose
gate and up are fused (fused_linear.py) with SiLU; attentions whose q, k and v are fused,
with no sliding window, head sizes a multiple of 16 and the rotary embedding over the
whole head; on float32 CPU tensors of one sequence with the native library loaded.
Anything else (another family's norm, such as Gemma's 1 + weight, an adapter, bf16, CUDA)
runs the module's own forward.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from torch import nn

from engine.runners.llama_family import is_family_module
from engine.runners.torch import native_gemm
from engine.runners.torch.fused_linear import fused_groups

log = logging.getLogger(__name__)

def _native(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def _norm_forward(mod: Any, original: Any, x: torch.Tensor) -> torch.Tensor:
    if not _native(x):
        return original(x)
    return torch.ops.genserve_elementwise.rms_norm(x, mod.weight, mod.variance_epsilon)


def _mlp_forward(mod: Any, original: Any, fused: nn.Linear,
                 x: torch.Tensor) -> torch.Tensor:
    if not _native(x):
        return original(x)
    y = fused(x)  # [..., 2 * intermediate]: gate's columns, then up's
    return mod.down_proj(torch.ops.genserve_elementwise.silu_mul(y))


def _mlp_fused_layer(mod: Any) -> nn.Linear | None:
    """The MLP's fused gate/up layer, if its gate's columns come first and up's right
    after, and its activation is SiLU."""
    if getattr(getattr(mod, "config", None), "hidden_act", None) != "silu":
        return None
    for group in fused_groups(mod):
        if group.members == [mod.gate_proj, mod.up_proj] and group.offsets == [
                0, mod.gate_proj.out_features] and mod.gate_proj.out_features == \
                mod.up_proj.out_features:
            return group.linear
    return None


def _attention_forward(mod: Any, original: Any, fused: nn.Linear, heads: int, kv_heads: int,
                       hidden_states: torch.Tensor,
                       position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                       attention_mask: torch.Tensor | None = None, cache: Any = None,
                       **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' attention forward (q, k, v projected, rotated, cached, attended, o
    projected) with the projection split, q and k rotated and all three laid out as
    [1, heads, T, d] in one native pass."""
    cos, sin = position_embeddings if position_embeddings is not None else (None, None)
    if (cos is None or sin is None or hidden_states.dim() != 3 or hidden_states.shape[0] != 1
            or not all(_native(t) for t in (hidden_states, cos, sin))
            or cos.shape[-1] != mod.head_dim):
        return original(hidden_states, position_embeddings=position_embeddings,
                        attention_mask=attention_mask, cache=cache, **kwargs)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = sys.modules[type(mod).__module__].eager_attention_forward
    q, k, v = torch.ops.genserve_elementwise.rope_split(fused(hidden_states), cos, sin, heads,
                                                        kv_heads)
    if cache is not None:
        k, v = cache.update(k, v, mod.layer_idx, kwargs=kwargs)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(mod.config._attn_implementation, eager)
    out, weights = attention(mod, q, k, v, attention_mask, dropout=0.0, scaling=mod.scaling,
                             **kwargs)
    return mod.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


def _attention_fused_layer(mod: Any) -> tuple[nn.Linear, int, int] | None:
    """The attention's fused q/k/v layer and its head counts, where the route applies."""
    config = mod.config
    if getattr(mod, "sliding_window", None) or (  # Mistral's window is its config's
            type(mod).__name__ == "MistralAttention" and getattr(config, "sliding_window", None)):
        return None
    if mod.head_dim % 16 or getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return None
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    sizes = [heads * mod.head_dim, kv_heads * mod.head_dim, kv_heads * mod.head_dim]
    for group in fused_groups(mod):
        if group.members == [mod.q_proj, mod.k_proj, mod.v_proj] and group.offsets == [
                0, sizes[0], sizes[0] + sizes[1]] and [
                m.out_features for m in group.members] == sizes:
            return group.linear, heads, kv_heads
    return None


def fuse_elementwise(model: nn.Module) -> int:
    """Route ``model``'s eligible RMSNorms, MLPs and attentions through the native passes
    (their weights float32 on the CPU); returns how many modules. Call after the siblings
    are fused and packed."""
    if not native_gemm.available():
        return 0
    count = 0
    for mod in model.modules():
        if is_family_module(mod, "RMSNorm"):
            weight = mod.weight
            if isinstance(weight, torch.Tensor) and _native(weight) and weight.dim() == 1:
                mod.forward = _bind(_norm_forward, mod)
                count += 1
        elif is_family_module(mod, "MLP"):
            fused = _mlp_fused_layer(mod)
            if fused is not None:
                mod.forward = _bind(_mlp_forward, mod, fused)
                count += 1
        elif is_family_module(mod, "Attention"):
            found = _attention_fused_layer(mod)
            if found is not None:
                mod.forward = _bind(_attention_forward, mod, *found)
                count += 1
    log.info("native RMSNorm, SiLU x up and rotary embedding for %d modules", count)
    return count


def _bind(fn: Any, mod: nn.Module, *extra: Any) -> Any:
    original = mod.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return fn(mod, original, *extra, *args, **kwargs)

    return forward
