"""Refuse at load what the torch runner cannot serve exactly.

A model is run through transformers' modules with our paged attention in place of theirs,
so anything a model needs from attention that the hook does not do would be served
silently wrong. Two checks, both at start-up: the config names no feature known to be
unsupported, and a probe forward (``probe_attention``) sees every layer's attention run
through the hook with no argument the hook does not honour.
"""

from __future__ import annotations

from typing import Any

from engine.runners.torch.attention import UnsupportedModelFeature

# What a layer of ``config.layer_types`` may be: full causal attention or a sliding window
# (both handled by the paged attention); chunked, linear and recurrent layers are not.
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def check_config(config: Any) -> None:
    """``UnsupportedModelFeature`` naming every feature of ``config`` the runner lacks."""
    text = config.get_text_config()
    name = getattr(config, "model_type", "model")
    problems = []
    if getattr(config, "is_encoder_decoder", False):
        problems.append("encoder-decoder models (genserve serves causal LMs)")
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = (quant.get("quant_method") if isinstance(quant, dict)
                  else getattr(quant, "quant_method", None))
        problems.append(f"quantization_config (quant_method={method}): the torch runner "
                        f"has no kernels for it; use unquantised weights, or a .gguf on the "
                        f"llama.cpp runner")
    layer_types = set(getattr(text, "layer_types", None) or ())
    if layer_types - SUPPORTED_LAYER_TYPES:
        problems.append(f"layer_types {sorted(layer_types - SUPPORTED_LAYER_TYPES)} (only "
                        f"{sorted(SUPPORTED_LAYER_TYPES)} are implemented)")
    if getattr(text, "attention_chunk_size", None):
        problems.append("attention_chunk_size (chunked local attention)")
    if getattr(text, "alibi", False) or getattr(text, "use_alibi", False):
        problems.append("ALiBi position biases")
    if problems:
        raise UnsupportedModelFeature(f"{name}: the torch runner cannot serve this model "
                                      f"exactly: " + "; ".join(problems))


def check_probe(config: Any, layers_called: list[int]) -> None:
    """After a probe forward: every decoder layer ran its attention through the hook once,
    in order (a layer that bypasses it would read a cache it never wrote)."""
    text = config.get_text_config()
    expected = list(range(text.num_hidden_layers))
    if layers_called != expected:
        raise UnsupportedModelFeature(
            f"{getattr(config, 'model_type', 'model')}: its attention does not run through "
            f"transformers' attention interface layer by layer (layers called: "
            f"{layers_called[:8]}{'...' if len(layers_called) > 8 else ''}, expected "
            f"{text.num_hidden_layers}); the torch runner cannot serve it")
