"""A GGUF's transformers config, with what transformers' GGUF loader drops put back.

transformers maps a fixed table of GGUF metadata keys per architecture
(``GGUF_CONFIG_MAPPING``) and leaves every other field at its config class's default. For
some files that default is another model: a Phi-3 GGUF loses its sliding window (full
attention past 2,047 tokens for Phi-3-mini-4k), a Gemma 2 GGUF its soft-capping values and,
for the 27B model, its query scaling, a StarCoder2 GGUF its RoPE base, a GGUF with linear
or YaRN RoPE scaling its scaling, one with partial RoPE (Phi-4-mini) its rotary dimensions,
a LongRoPE GGUF its factors, a Llama 3.1 GGUF its RoPE scaling (baked into
``rope_freqs.weight``). Each is read back here from what llama.cpp's converter writes, as
llama.cpp itself reads it, so the torch runner on a .gguf (and the llama.cpp runner's
torch prefill) runs the model llama.cpp runs. What cannot be read back is refused
(``UnfaithfulGGUF``), naming it, rather than dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.loading.gguf_reader import shared_parses
from engine.loading.rope_scaling import longrope_parameters

# llama.cpp's "27B" Gemma models (decided there from the layer count) scale queries by
# hidden_size / heads instead of the head size; the GGUF does not say which.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
SCALED_ROPE = {"linear", "yarn"}


class UnfaithfulGGUF(ValueError):
    """The GGUF says something its transformers model cannot hold: no torch model of it."""


class GGUFMetadata:
    """The metadata of one GGUF (``gguf.GGUFReader``), read once."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.reader = gguf.GGUFReader(str(path))
        self.arch = self.text("general.architecture", prefixed=False) or ""

    def field(self, key: str, prefixed: bool = True) -> Any:
        return self.reader.fields.get(f"{self.arch}.{key}" if prefixed else key)

    def number(self, key: str) -> Any:
        f = self.field(key)
        return None if f is None else f.parts[-1][0].item()

    def text(self, key: str, prefixed: bool = True) -> str | None:
        f = self.field(key, prefixed)
        return None if f is None else bytes(f.parts[-1]).decode()

    def tensor(self, name: str) -> Any:
        return next((t for t in self.reader.tensors if t.name == name), None)


def gguf_config(path: Path) -> Any:
    """transformers' config of the GGUF at ``path``, completed (module docstring)."""
    from transformers import AutoConfig

    with shared_parses():  # transformers' parse serves GGUFMetadata too
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        restore(config, GGUFMetadata(path))
    return config


def frequency_factors(meta: GGUFMetadata, config: Any) -> dict[str, Any] | None:
    """A ``rope_freqs.weight`` tensor (Llama 3.1/3.2's RoPE scaling, as llama.cpp's
    converter bakes it: each frequency divided by its factor) as transformers'
    ``rope_parameters``: LongRoPE with the same factors short and long and no attention
    scaling computes exactly those frequencies (``fix_rotary`` then has nothing to
    choose)."""
    freqs = meta.tensor("rope_freqs.weight")
    if freqs is None:
        return None
    factors = [float(x) for x in freqs.data]
    return {"rope_type": "longrope",
            "rope_theta": float(meta.number("rope.freq_base") or 10000.0),
            "short_factor": factors, "long_factor": factors, "attention_factor": 1.0,
            "original_max_position_embeddings": int(config.max_position_embeddings)}


def restore(config: Any, meta: GGUFMetadata) -> None:
    """Set on ``config`` what ``meta`` says and transformers' GGUF loader did not read."""
    window = meta.number("attention.sliding_window")
    if window and not hasattr(config, "sliding_window"):
        raise UnfaithfulGGUF(f"{meta.arch} GGUF: attention.sliding_window {window}, but "
                             f"transformers' {config.model_type} has no sliding window; "
                             f"serve it on the llama.cpp runner, or its HF checkpoint")
    if window:
        config.sliding_window = int(window)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = meta.number(key)
        if value is not None and hasattr(config, key):
            setattr(config, key, float(value))
    if hasattr(config, "query_pre_attn_scalar") and meta.arch in GEMMA_27B_LAYERS:
        big = config.num_hidden_layers == GEMMA_27B_LAYERS[meta.arch]
        config.query_pre_attn_scalar = (config.hidden_size // config.num_attention_heads
                                        if big else int(meta.number("attention.key_length")
                                                        or config.head_dim))
    base = meta.number("rope.freq_base")
    params = config.rope_parameters or {}
    if base is not None and params:  # StarCoder2's base is not in transformers' table
        if "full_attention" in params:  # per layer type: the GGUF's base is the global one
            params["full_attention"] = {**params["full_attention"], "rope_theta": float(base)}
        else:
            config.rope_parameters = {**params, "rope_theta": float(base)}
    rotary = meta.number("rope.dimension_count")
    head = int(meta.number("attention.key_length") or getattr(config, "head_dim", None)
               or config.hidden_size // config.num_attention_heads)
    if rotary and int(rotary) < head:  # partial RoPE (Phi-4-mini: 96 of 128 dimensions)
        params = config.rope_parameters or {}
        if "full_attention" in params:
            raise UnfaithfulGGUF(f"{meta.arch} GGUF: rope.dimension_count {rotary} of "
                                 f"{head} with RoPE per layer type is not read back")
        config.rope_parameters = {**params, "partial_rotary_factor": int(rotary) / head}
    longrope = longrope_parameters(meta) or frequency_factors(meta, config)
    if longrope is not None:
        config.rope_parameters = {**(config.rope_parameters or {}), **longrope}
        config.original_max_position_embeddings = longrope["original_max_position_embeddings"]
        return
    kind = meta.text("rope.scaling.type")
    if kind in (None, "none") or kind == "linear" and (meta.number("rope.scaling.factor")
                                                        or 1.0) == 1.0:
        return
    if kind not in SCALED_ROPE:
        raise UnfaithfulGGUF(f"{meta.arch} GGUF: rope.scaling.type {kind!r} is not read "
                             f"back into the torch model (only {sorted(SCALED_ROPE)}, "
                             f"LongRoPE and rope_freqs are); serve it on the llama.cpp "
                             f"runner, or its HF checkpoint")
    scaling: dict[str, Any] = {"rope_type": kind,
                               "factor": float(meta.number("rope.scaling.factor"))}
    if kind == "yarn":
        original = meta.number("rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
    params = config.rope_parameters or {}
    if "full_attention" in params:  # per layer type (Gemma 3): llama.cpp scales the global
        params["full_attention"] = {**params["full_attention"], **scaling}  # layers only
    else:
        config.rope_parameters = {**params, **scaling}
