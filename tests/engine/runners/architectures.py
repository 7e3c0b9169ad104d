"""Tiny random models of the architectures people deploy, shrunk from their real configs
(few layers, small hidden size) but keeping what makes each one different: sliding windows
shorter than the test prompts, logit soft-capping, q/k norms, multipliers, experts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

WINDOW = 8  # sliding window, in tokens: shorter than every conformance prompt

# architecture -> (config class name, what differs from the common tiny shape, feature)
ARCHITECTURES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("LlamaConfig", {}, "baseline"),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW}, "sliding window"),
    "qwen2": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": WINDOW,
                              "max_window_layers": 1}, "sliding window on layer 1"),
    "qwen3": ("Qwen3Config", {"head_dim": 16}, "q/k norms"),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": WINDOW,
                                "attn_logit_softcapping": 20.0,
                                "final_logit_softcapping": 15.0,
                                "query_pre_attn_scalar": 16},
               "attention + final soft-capping, alternating sliding/global"),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": WINDOW,
                                    "layer_types": ["sliding_attention", "full_attention"],
                                    "query_pre_attn_scalar": 16},
               "alternating sliding/global, q/k norms"),
    "phi3": ("Phi3Config", {"sliding_window": WINDOW}, "fused qkv, sliding window"),
    "granite": ("GraniteConfig", {"embedding_multiplier": 6.0, "residual_multiplier": 0.5,
                                  "attention_multiplier": 0.1, "logits_scaling": 2.0},
                "embedding/residual/attention/logit multipliers"),
    "olmo2": ("Olmo2Config", {}, "q/k norms over all heads, post-norms"),
    "starcoder2": ("Starcoder2Config", {"sliding_window": WINDOW, "use_bias": True},
                   "biases, LayerNorm, sliding window"),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                  "sliding_window": WINDOW}, "experts, sliding window"),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 64,
                                     "shared_expert_intermediate_size": 64,
                                     "decoder_sparse_step": 1}, "experts + shared expert"),
    "granitemoe": ("GraniteMoeConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                        "embedding_multiplier": 6.0,
                                        "residual_multiplier": 0.5,
                                        "attention_multiplier": 0.1, "logits_scaling": 2.0},
                   "experts, multipliers"),
}


def build_architecture(name: str, directory: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save a tiny random ``name`` model with the default model's tokenizer."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cls_name, extra, _ = ARCHITECTURES[name]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    common: dict[str, Any] = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id, tie_word_embeddings=False, initializer_range=0.2)
    config = getattr(transformers, cls_name)(**{**common, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory
