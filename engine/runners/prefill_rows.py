"""The last decoder layer of a prefill chunk computed past its attention for the rows
whose logits are asked only (llamacpp_handoff.TorchPrefill).

Why: a prompt chunk needs every layer's K and V for all of its rows, but after the last
layer's attention only the rows that are sampled (the chunk's last one, or none before
the prompt's last chunk): the rest of that layer (its residual, norm and MLP) computes
hidden states nothing reads. HF ``generate`` computes them: on the default model
(30 layers) they are ~2% of a long prompt's products. The rows kept get the same bits as
in the full layer, since every op after the attention works row by row (the packed
native linears give a row the same bits whatever the other rows: tested).

Taken for transformers' Llama, Mistral and Qwen2 decoder layers, whose forward this is,
sliced; any other layer, or a call in another form, runs the layer as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.runners.llama_family import is_family_module


@dataclass
class KeptRows:
    """How many last rows of a chunk the model's next forward keeps (None: all)."""

    rows: int | None = None


def keep_last_rows(model: nn.Module) -> KeptRows | None:
    """Make ``model``'s last decoder layer keep ``KeptRows.rows`` rows past its attention;
    None where the model's last layer is not one this applies to."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return None
    last: Any = layers[-1]
    if not is_family_module(last, "DecoderLayer"):
        return None
    kept = KeptRows()
    original = last.forward

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows = kept.rows
        if rows is None or args or hidden_states.dim() != 3 or rows >= hidden_states.shape[1]:
            return original(hidden_states, *args, **kwargs)
        residual = hidden_states
        attn, _ = last.self_attn(hidden_states=last.input_layernorm(hidden_states), **kwargs)
        start = hidden_states.shape[1] - rows
        hidden = residual[:, start:] + attn[:, start:]
        if not rows:
            return hidden
        return hidden + last.mlp(last.post_attention_layernorm(hidden))

    last.forward = forward
    return kept
