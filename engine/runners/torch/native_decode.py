"""A decode step of a Llama-shaped model in one native call (native_decode.cpp), on a CPU in
float32 where the native linears and decode attention run.

The compiled step (compiled_step.py) runs the same kernels, but from ~30 inductor pieces,
~120 linear calls and 30 attention calls, each entered from Python: on the default model
(SmolLM2-135M, 2 cores) a one-row step spent about as long between its kernels as in
them. The native step makes those calls from C++, with the very ATen ops transformers' eager
model runs for the rest (RMSNorm, rotary, SiLU, residual adds), so its logits are the
eager step's bit for bit (tested). The embedding lookup and the rotary cos/sin (any RoPE
scaling the model's rotary module applies) stay in Python, one call each.

Taken only for layers that are exactly transformers' Llama, Mistral or Qwen2 decoder
layers with the runner's packed, fused q/k/v and gate/up products; anything else
(another architecture, adapters, tensor parallelism, CUDA) keeps the compiled step.
``GENSERVE_NATIVE_DECODE=0`` turns it off, for comparison.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.runners.llama_family import FAMILIES, is_family_module
from engine.runners.torch import packed_linear
from engine.runners.torch.attention import native_decode_usable
from engine.runners.torch.decode_inputs import DecodeInputs
from engine.runners.torch.fused_linear import fused_groups
from engine.runners.torch.kv_tensors import KVCache

log = logging.getLogger(__name__)

NATIVE_DECODE_ENV = "GENSERVE_NATIVE_DECODE"

def _window(model_type: str, config: Any, attn: nn.Module) -> int:
    """The window the family gives its attention (what its forward passes as
    ``sliding_window``)."""
    if model_type == "mistral":
        return int(getattr(config, "sliding_window", None) or 0)
    if model_type == "qwen2":
        return int(getattr(attn, "sliding_window", None) or 0)
    return 0


class Unsupported(Exception):
    """Why a model's decode step stays compiled (the message says it)."""


def _packed(mod: nn.Module, what: str) -> packed_linear.PackedLayer:
    key = packed_linear.packed_key(mod)
    if key is None:
        raise Unsupported(f"{what} is not packed")
    layer = packed_linear._LAYERS[key]
    if layer.onednn:
        raise Unsupported(f"{what} is packed for oneDNN, not the native kernel")
    return layer


def _linear_parts(layer: packed_linear.PackedLayer) -> tuple[list[torch.Tensor], int]:
    empty = torch.empty(0)
    bias = layer.bias.detach() if layer.bias is not None else empty
    scales = layer.scales if layer.scales is not None else empty
    return [layer.weight, scales, bias], layer.bits


def _fused(parent: nn.Module, names: tuple[str, ...], what: str) -> packed_linear.PackedLayer:
    members = [getattr(parent, n) for n in names]
    for group in fused_groups(parent):
        if group.members == members:
            starts = [sum(m.out_features for m in members[:i]) for i in range(len(members))]
            if group.offsets != starts:
                raise Unsupported(f"{what}: fused in another order")
            return _packed(group.linear, what)
    raise Unsupported(f"{what} are not fused")


@dataclass
class NativeDecodeStep:
    model: Any  # a transformers causal LM (its attributes are read by name)
    tensors: list[torch.Tensor]
    ints: list[int]
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    head_bits: int
    vocab: int
    eps: float
    scale: float
    generation: int  # packed_linear's, when the panels above were taken

    @property
    def stale(self) -> bool:
        """A layer was packed or unpacked since (a benchmark's baseline, an adapter fold):
        the panels held here may no longer be the model's."""
        return self.generation != packed_linear.generation()

    @classmethod
    def build(cls, model: Any, kv_cache: KVCache) -> NativeDecodeStep:
        """The step for ``model`` over ``kv_cache``; raises ``Unsupported`` saying why not."""
        if os.environ.get(NATIVE_DECODE_ENV, "1") == "0":
            raise Unsupported(f"{NATIVE_DECODE_ENV}=0")
        config = model.config
        model_type = getattr(config, "model_type", "")
        if model_type not in FAMILIES:
            raise Unsupported(f"model type {model_type!r}")
        if getattr(config, "hidden_act", None) != "silu":
            raise Unsupported(f"activation {getattr(config, 'hidden_act', None)!r}")
        if getattr(config, "pretraining_tp", 1) != 1:
            raise Unsupported("pretraining_tp > 1")
        spec = kv_cache.spec  # the attention's check: a float32 CPU cache, kernels built
        if not native_decode_usable(torch.empty(1, 1, spec.head_dim), kv_cache.key[0]):
            raise Unsupported("the native decode attention is off or does not apply")
        if getattr(config, "partial_rotary_factor", None) not in (None, 1.0):
            raise Unsupported("a partial rotary embedding")
        base = model.model
        if type(base.embed_tokens) is not nn.Embedding:
            raise Unsupported("the embedding is not a plain nn.Embedding")
        if not callable(getattr(base, "rotary_emb", None)):
            raise Unsupported("the model has no rotary embedding module")
        tensors: list[torch.Tensor] = []
        ints: list[int] = []
        eps: set[float] = set()
        scales: set[float] = set()
        for i, layer in enumerate(base.layers):
            if not is_family_module(layer, "DecoderLayer", model_type):
                raise Unsupported(f"layer {i} is a {type(layer).__module__}."
                                  f"{type(layer).__name__}")
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(not type(n).__name__.endswith("RMSNorm") for n in norms):
                raise Unsupported(f"layer {i}'s norms are not RMSNorm")
            if attn.o_proj.bias is not None or mlp.down_proj.bias is not None:
                raise Unsupported(f"layer {i}: o_proj/down_proj with a bias")
            qkv, qkv_bits = _linear_parts(_fused(attn, ("q_proj", "k_proj", "v_proj"),
                                                 f"layer {i}'s q/k/v"))
            gate_up = _fused(mlp, ("gate_proj", "up_proj"), f"layer {i}'s gate/up")
            if gate_up.bias is not None:
                raise Unsupported(f"layer {i}: gate/up with a bias")
            o, o_bits = _linear_parts(_packed(attn.o_proj, f"layer {i}'s o_proj"))
            gu, gu_bits = _linear_parts(gate_up)
            down, down_bits = _linear_parts(_packed(mlp.down_proj, f"layer {i}'s down_proj"))
            tensors += [norms[0].weight.detach(), *qkv, *o[:2], norms[1].weight.detach(),
                        *gu[:2], *down[:2], kv_cache.key[i], kv_cache.value[i]]
            ints += [qkv_bits, o_bits, gu_bits, down_bits, _window(model_type, config, attn)]
            eps |= {float(n.variance_epsilon) for n in norms}
            scales.add(float(attn.scaling))
        if len(eps) != 1 or len(scales) != 1:
            raise Unsupported("layers differ in their norm epsilon or attention scale")
        if not type(base.norm).__name__.endswith("RMSNorm"):
            raise Unsupported("the final norm is not RMSNorm")
        eps.add(float(base.norm.variance_epsilon))
        if len(eps) != 1:
            raise Unsupported("the final norm's epsilon differs")
        for attr in ("final_logit_softcapping", "logits_scaling", "attn_logit_softcapping"):
            if getattr(config, attr, None) not in (None, 1.0):
                raise Unsupported(f"{attr} is set")
        head = _packed(model.lm_head, "the LM head")
        head_parts, head_bits = _linear_parts(head)
        tensors += [base.norm.weight.detach(), *head_parts]
        mlp0 = base.layers[0].mlp
        return cls(model, tensors, ints, heads=int(config.num_attention_heads),
                   kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                   intermediate=int(mlp0.gate_proj.out_features), head_bits=head_bits,
                   vocab=head.width, eps=eps.pop(), scale=scales.pop(),
                   generation=packed_linear.generation())

    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of one decode step (writes the rows' keys and values)."""
        base = self.model.model
        hidden = base.embed_tokens(inputs.input_ids)  # [1, rows, hidden]
        cos, sin = base.rotary_emb(hidden, inputs.positions)
        rows = hidden.shape[1]
        return torch.ops.genserve_decode.decode_step(
            hidden[0], cos.reshape(rows, -1), sin.reshape(rows, -1), self.tensors, self.ints,
            inputs.slot_mapping, inputs.block_tables, inputs.seq_lens, self.heads,
            self.kv_heads, self.head_dim, self.intermediate, self.head_bits, self.vocab,
            self.eps, self.scale)


def native_step(model: Any, kv_cache: KVCache) -> NativeDecodeStep | None:
    """The native step for this model, or None (logged once, with why)."""
    try:
        step = NativeDecodeStep.build(model, kv_cache)
    except Unsupported as e:
        log.info("decode steps stay compiled (no native step: %s)", e)
        return None
    log.info("decode steps run natively: one call a step (%d layers)", len(step.ints) // 5)
    return step
