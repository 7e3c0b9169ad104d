"""RoPE whose frequencies depend on the sequence length, fixed once when the server starts.

transformers recomputes two kinds of rotary embedding at every forward from the largest
position in that forward: ``longrope`` (Phi-3/3.5/4-mini 128k, MiniCPM3: ``short_factor``
up to ``original_max_position_embeddings``, ``long_factor`` beyond) and ``dynamic`` NTK
scaling. In a packed batch that position is the largest of every sequence in the step, so
a sequence's output would depend on its batch mates and on how its prompt was chunked, and
a cached prefix block could hold KV of either kind. As vLLM does, the choice is made once
from ``max_model_len``: LongRoPE's long factors for every sequence when ``max_model_len``
exceeds the original context, its short ones otherwise (then no sequence can pass the
original context, and every output is transformers' own); dynamic NTK is scaled for
``max_model_len`` when that exceeds the model's positions (it cannot here: the runners cap
``max_model_len`` at them), else not at all. llama.cpp makes the same choice from its
context size; the llama.cpp runner makes it take ours (``llama_cpp_overrides``).

A GGUF keeps LongRoPE's factors as tensors (``rope_factors_long/short.weight``) that
transformers' GGUF loader drops; ``longrope_parameters`` reads them back for the
converted model (engine/loading/gguf_config.py).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

# llama.cpp architectures that load LongRoPE factor tensors whatever rope.scaling.type says
LONGROPE_ARCHS = frozenset({"phi3", "phimoe", "minicpm3"})
# llama.cpp picks the long factors when its context per sequence exceeds the original
# context; overriding the original context to these makes it pick what we chose.
LLAMA_CPP_LONG, LLAMA_CPP_SHORT = 1, 2**31 - 1


def use_long_factors(max_model_len: int, original: int) -> bool:
    """LongRoPE's choice for a server: the long factors iff a sequence may pass the
    original context."""
    return max_model_len > original


Note = tuple[int, str]  # (logging level, message) of a choice, for the start-up log


def longrope_note(long: bool, max_model_len: int, original: int) -> Note:
    """What a LongRoPE choice says at start: a warning when the long factors serve short
    sequences too (transformers' generate would use the short ones for them)."""
    if not long:
        return logging.INFO, (f"LongRoPE: short factors for every sequence (max_model_len "
                              f"{max_model_len} <= the original context {original})")
    return logging.WARNING, (f"LongRoPE: long factors for every sequence (max_model_len "
                             f"{max_model_len} > the original context {original}); "
                             f"sequences shorter than {original} tokens lose some quality "
                             f"(transformers' generate uses the short factors for them): "
                             f"--max-model-len {original} or less serves them so")


def _original_context(module: Any, params: dict) -> int:
    return int(params.get("original_max_position_embeddings")
               or getattr(module.config, "original_max_position_embeddings", 0)
               or module.original_max_seq_len)


def fix_rotary(model: Any, max_model_len: int) -> list[Note]:
    """Fix every length-dependent rotary embedding of ``model`` for ``max_model_len``
    (module docstring); returns what was chosen, one note per kind, for the log."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    chosen: set[Note] = set()
    for module in model.modules():
        kinds = getattr(module, "rope_type", None)
        if kinds is None or not hasattr(module, "config"):
            continue
        per_layer = isinstance(kinds, dict)
        for layer_type, kind in (kinds.items() if per_layer else [(None, kinds)]):
            if not isinstance(kind, str) or kind != "longrope" and "dynamic" not in kind:
                continue
            prefix = f"{layer_type}_" if per_layer else ""
            params = (module.config.rope_parameters[layer_type] if per_layer
                      else module.config.rope_parameters) or {}
            original = _original_context(module, params)
            buf = getattr(module, f"{prefix}inv_freq")
            init = ROPE_INIT_FUNCTIONS[kind]
            extra = {"layer_type": layer_type} if per_layer else {}
            if kind == "longrope" and params.get("short_factor") == params.get(
                    "long_factor"):
                fixed = "fixed-longrope"  # one set of factors (gguf_config's rope_freqs)
            elif kind == "longrope":
                long = use_long_factors(max_model_len, original)
                if long:
                    inv, _ = init(module.config, buf.device, seq_len=original + 1, **extra)
                    buf.copy_(inv)
                else:
                    buf.copy_(getattr(module, f"{prefix}original_inv_freq"))
                chosen.add(longrope_note(long, max_model_len, original))
                fixed = "fixed-longrope"
            else:
                if max_model_len > original:
                    inv, scaling = init(module.config, buf.device, seq_len=max_model_len,
                                        **extra)
                    buf.copy_(inv)
                    module.attention_scaling = scaling
                else:
                    buf.copy_(getattr(module, f"{prefix}original_inv_freq"))
                chosen.add((logging.INFO, f"dynamic NTK RoPE: scaled for "
                                          f"{max(max_model_len, original)} positions for "
                                          f"every sequence"))
                fixed = "fixed-ntk"
            # transformers' per-forward update runs only for these two names
            if per_layer:
                kinds[layer_type] = fixed
            else:
                module.rope_type = fixed
    return sorted(chosen)


def longrope_parameters(meta: Any) -> dict[str, Any] | None:
    """transformers' ``rope_parameters`` for a GGUF with LongRoPE factor tensors, None for
    any other file. ``meta``: the file's ``gguf_config.GGUFMetadata``."""
    long, short = meta.tensor("rope_factors_long.weight"), meta.tensor(
        "rope_factors_short.weight")
    if long is None or short is None:
        return None
    original = meta.number("rope.scaling.original_context_length")
    if original is None:
        raise ValueError(f"{meta.arch} GGUF: LongRoPE factors without "
                         f"{meta.arch}.rope.scaling.original_context_length")
    params: dict[str, Any] = {
        "rope_type": "longrope",
        "rope_theta": float(meta.number("rope.freq_base") or 10000.0),
        "long_factor": [float(x) for x in long.data],
        "short_factor": [float(x) for x in short.data],
        "original_max_position_embeddings": int(original)}
    attn = meta.number("rope.scaling.attn_factor")
    if attn is not None:
        params["attention_factor"] = float(attn)
    return params


def llama_cpp_overrides(arch: str, meta: Any, n_ctx_train: int,
                        max_model_len: int) -> tuple[dict[str, int], Note | None]:
    """(GGUF metadata overrides, what was chosen) that make llama.cpp choose LongRoPE's
    factors as ``use_long_factors`` does; nothing for a model without them. ``meta(key)``
    reads a metadata value as text (None when absent)."""
    key = f"{arch}.rope.scaling.original_context_length"
    original = meta(key)
    scaling = meta(f"{arch}.rope.scaling.type")
    if original is None or not (scaling == "longrope" or arch in LONGROPE_ARCHS):
        return {}, None
    if int(original) >= n_ctx_train:  # no longer context: a file without the factors
        return {}, None
    long = use_long_factors(max_model_len, int(original))
    return ({key: LLAMA_CPP_LONG if long else LLAMA_CPP_SHORT},
            longrope_note(long, max_model_len, int(original)))
