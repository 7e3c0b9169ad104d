"""RMSNorm and the MLP's SiLU(gate) x up as one native pass each (native_elementwise.cpp),
for the llama.cpp runner's float32 torch prefill (llamacpp_handoff.load_torch_prefill).

Why: transformers runs a float32 RMSNorm as five ops and the MLP's activation as two
(silu, then a multiply of two column slices of the fused gate/up product), each a pass
over the chunk into a fresh tensor. On a 2-core AVX2 EPYC (torch profiler, 1,024-token
prompt in 512-token chunks) the multiply alone took ~0.14 s, silu ~0.04 s and the norms
~0.06 s of a 2.5 s prefill whose linears and attention were already native.

Taken only for transformers' own Llama, Mistral and Qwen2 RMSNorm modules and MLPs whose
gate and up are fused (fused_linear.py) with SiLU, on float32 CPU tensors with the native
library loaded; anything else (another family's norm, such as Gemma's 1 + weight, an
adapter, bf16, CUDA) runs the module's own forward.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from engine.runners.torch import native_gemm
from engine.runners.torch.fused_linear import fused_groups

log = logging.getLogger(__name__)

FAMILIES = ("llama", "mistral", "qwen2")
_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"}
_MLPS = {"LlamaMLP", "MistralMLP", "Qwen2MLP"}


def _transformers_class(mod: nn.Module, names: set[str]) -> bool:
    cls = type(mod)
    return cls.__name__ in names and cls.__module__.startswith(
        tuple(f"transformers.models.{f}." for f in FAMILIES))


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


def fuse_elementwise(model: nn.Module) -> int:
    """Route ``model``'s eligible RMSNorms and MLPs through the native passes (their
    weights float32 on the CPU); returns how many modules. Call after the siblings are
    fused and packed."""
    if not native_gemm.available():
        return 0
    count = 0
    for mod in model.modules():
        if _transformers_class(mod, _NORMS):
            weight = mod.weight
            if isinstance(weight, torch.Tensor) and _native(weight) and weight.dim() == 1:
                mod.forward = _bind(_norm_forward, mod)
                count += 1
        elif _transformers_class(mod, _MLPS):
            fused = _mlp_fused_layer(mod)
            if fused is not None:
                mod.forward = _bind(_mlp_forward, mod, fused)
                count += 1
    log.info("native RMSNorm and SiLU x up for %d modules", count)
    return count


def _bind(fn: Any, mod: nn.Module, *extra: Any) -> Any:
    original = mod.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        return fn(mod, original, *extra, x)

    return forward
