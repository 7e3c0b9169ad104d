"""Write tiny GGUF files of other architectures from tiny random HF models, the way
llama.cpp's ``convert_hf_to_gguf.py`` does, so the llama.cpp runner is tested on more
than the default (Llama) GGUF without downloading anything.

The tokenizer fields are copied from the default model's GGUF (the tiny HF models use its
tokenizer); tensors are written as F32 under llama.cpp's names for the architecture.
Architectures llama.cpp runs with its interleaved ("normal") RoPE have their q/k weights
permuted, as the upstream converter's ``LlamaModel.modify_tensors`` does (Granite's
converter is a LlamaModel); NEOX-RoPE ones such as Qwen2 go in as they are.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

PERMUTED_QK = {"llama", "granite"}  # llama.cpp runs these with interleaved RoPE
GEMMA_NORMS = {"gemma", "gemma2", "gemma3"}  # RMSNorm weights stored as w, run as 1 + w

TOKENIZER_KEYS = (  # copied verbatim from the default GGUF
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template",
)


@functools.lru_cache(maxsize=1)
def default_tokenizer_fields() -> dict[str, Any]:
    """The default GGUF's tokenizer metadata: key -> (value, GGUFValueType, sub type).
    Read once per process (gguf-py takes seconds over its 49k-token vocabulary); callers
    must not modify it."""
    import gguf

    from engine.loading.model_loader import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    out = {}
    for key in TOKENIZER_KEYS:
        field = reader.fields[key]
        sub = field.types[1] if len(field.types) > 1 else None
        out[key] = (field.contents(), field.types[0], sub)
    return out


def write_gguf(model: Any, path: Path, *, arch: str | None = None,
               tokenizer_fields: dict[str, Any] | None = None,
               extra: dict[str, float] | None = None, pre: str | None = None,
               extra_ints: dict[str, int] | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None,
               name: str | None = None, extra_strings: dict[str, str] | None = None
               ) -> Path:
    """Write the HF causal LM ``model`` as an F32 GGUF of llama.cpp architecture ``arch``
    (default: the HF model type). ``arch`` may name an architecture llama.cpp does not know
    (its tensors are then written under Llama's names). ``extra``: float metadata keys
    under the architecture's prefix (e.g. Granite's multipliers). ``pre``: the
    pre-tokenizer (``tokenizer.ggml.pre``) instead of the default model's "smollm".
    ``extra_ints`` / ``extra_strings``: uint32 / string metadata keys under the
    architecture's prefix;
    ``extra_tensors``: tensors written under their GGUF names as they are (e.g. Phi-3's
    ``rope_factors_long.weight``). ``name``: ``general.name`` instead of "tiny-ARCH"
    (llama.cpp keys some vocabulary rules on it: a name containing "phi3" makes it look
    up Phi-3's own special tokens)."""
    import gguf

    cfg = model.config
    arch = arch or cfg.model_type
    known = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}
    names = gguf.get_tensor_name_map(known.get(arch, gguf.MODEL_ARCH.LLAMA),
                                     cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name or f"tiny-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters or {}
    rope = rope.get("full_attention", rope)  # per layer type: the global layers' base
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or rope["rope_theta"]))
    if hasattr(cfg, "rms_norm_eps"):
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    else:  # LayerNorm models (StarCoder2)
        w.add_layer_norm_eps(cfg.norm_epsilon)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, value in (extra or {}).items():
        w.add_float32(f"{arch}.{key}", value)
    for key, ivalue in (extra_ints or {}).items():
        w.add_uint32(f"{arch}.{key}", ivalue)
    for key, text in (extra_strings or {}).items():
        w.add_string(f"{arch}.{key}", text)
    fields = dict(tokenizer_fields or default_tokenizer_fields())
    if pre is not None:
        fields["tokenizer.ggml.pre"] = (pre, *fields["tokenizer.ggml.pre"][1:])
    for key, (value, vtype, sub) in fields.items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False):
            continue  # llama.cpp reuses token_embd
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name} in architecture {arch}")
        data = tensor.detach().float().numpy().astype(np.float32)
        if arch in GEMMA_NORMS and hf_name.endswith("norm.weight"):
            data = data + 1.0  # Gemma scales by 1 + w; llama.cpp by w (upstream adds 1)
        if arch in PERMUTED_QK and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
            data = permute_for_rope(data, heads)
        w.add_tensor(name, data)
    for name, data in (extra_tensors or {}).items():
        w.add_tensor(name, np.asarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def permute_for_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half q/k rows of each head reordered to llama.cpp's interleaved pairs
    (upstream ``LlamaModel.permute``)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))
