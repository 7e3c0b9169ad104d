"""A GGUF LoRA file read back into PEFT's layout, so the torch runner serves it too.

A GGUF adapter (``engine/gguf_adapter.py``, checked in itself) holds llama.cpp's layout:
tensor names of the architecture (``blk.0.attn_q.weight.lora_a``), ``lora_b`` of q/k with
its rows permuted where llama.cpp's converter permuted the model's q/k weights (models it
runs with interleaved RoPE), tensors possibly f16/bf16/q8_0, and ``adapter.lora.alpha``
(scale ``alpha / rank`` per pair, 1 when 0). Undoing that needs to know, per architecture,
whether the converter permuted: only the architectures below are read; any other is
refused rather than served from a guess.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from engine.adapters import AdapterError, LoraAdapter, LoraWeights

# HF model_type -> (llama.cpp architecture, whether its converter permuted q/k rows)
ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False)}


def gguf_as_peft(adapter: LoraAdapter, config: Any, modules: Iterable[str]) -> LoraAdapter:
    """``adapter`` (a GGUF one) with its weights read into PEFT's layout for the model of
    HF ``config`` whose linear layers are ``modules``: ``AdapterError`` for an architecture
    not read here or a tensor with no linear layer."""
    import gguf
    from gguf.quants import dequantize

    assert adapter.gguf is not None
    aid, name = adapter.adapter_id, adapter.gguf.file.name
    arch, permuted = ARCHITECTURES.get(config.model_type, (None, False))
    if arch is None:
        raise AdapterError(aid, f"{name}: GGUF LoRA adapters are read on the torch runner for "
                           f"{', '.join(ARCHITECTURES)} models only, not "
                           f"{config.model_type!r} (serve its PEFT files)")
    if adapter.gguf.architecture != arch:
        raise AdapterError(aid, f"{name} is an adapter of a {adapter.gguf.architecture} model, "
                           f"not of this {arch} model (general.architecture)")
    names = gguf.get_tensor_name_map(
        {n: a for a, n in gguf.MODEL_ARCH_NAMES.items()}[arch], config.num_hidden_layers)
    module_of: dict[str, str] = {}  # GGUF tensor -> the model's linear layer
    for linear in modules:
        tensor = names.get_name(linear)
        if tensor is not None:
            module_of[tensor + ".weight"] = linear
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for t in gguf.GGUFReader(adapter.gguf.file).tensors:
        base, _, part = t.name.rpartition(".")
        pairs.setdefault(base, {})[part] = dequantize(t.data, t.tensor_type)
    weights = {}
    for base, ab in sorted(pairs.items()):
        module = module_of.get(base)
        if module is None:
            raise AdapterError(aid, f"{name}: tensor {base!r} is no linear layer of this model "
                               f"(the torch runner adapts no LM head or embeddings)")
        if set(ab) != {"lora_a", "lora_b"}:  # the file changed since it was checked
            raise AdapterError(aid, f"{name}: {base} is not one lora_a / lora_b pair")
        a, b = ab["lora_a"], ab["lora_b"]  # [r, in], [out, r]
        if permuted and module.endswith(("q_proj", "k_proj")):
            heads = (config.num_attention_heads if module.endswith("q_proj")
                     else config.num_key_value_heads)
            if b.shape[0] % (2 * heads):
                raise AdapterError(aid, f"{name}: {base}: lora_b has {b.shape[0]} rows, not "
                                   f"{heads} heads of even size")
            b = _unpermute_rope(b, heads)
        scale = adapter.alpha / a.shape[0] if adapter.alpha else 1.0
        weights[module] = LoraWeights(torch.from_numpy(np.array(a, np.float32)),
                                      torch.from_numpy(np.array(b, np.float32) * scale))
    return dataclasses.replace(adapter, weights=weights, gguf=None, target_modules=sorted(
        {m.rsplit(".", 1)[-1] for m in weights}))


def _unpermute_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from llama.cpp's interleaved pairs back to HF's rotate-half order
    (the inverse of the converter's ``LlamaModel.permute``)."""
    return (weight.reshape(heads, weight.shape[0] // heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))
