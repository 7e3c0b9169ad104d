"""is_family_module: transformers' own Llama/Mistral/Qwen2 classes only, by kind and family."""

from __future__ import annotations

from transformers import LlamaConfig, MistralConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

from engine.runners.llama_family import is_family_module

TINY = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2,
            num_key_value_heads=1, num_hidden_layers=1)


def test_transformers_own_layers_are_recognised_by_kind_and_family():
    llama = LlamaDecoderLayer(LlamaConfig(**TINY), layer_idx=0)
    mistral = MistralDecoderLayer(MistralConfig(**TINY), layer_idx=0)
    assert is_family_module(llama, "DecoderLayer")
    assert is_family_module(llama, "DecoderLayer", "llama")
    assert not is_family_module(llama, "DecoderLayer", "mistral")
    assert is_family_module(mistral, "DecoderLayer", "mistral")
    assert is_family_module(llama.input_layernorm, "RMSNorm")
    assert is_family_module(llama.mlp, "MLP") and is_family_module(llama.self_attn, "Attention")
    assert not is_family_module(llama, "MLP")


def test_a_same_named_class_from_elsewhere_is_not_transformers_own():
    # remote code may define its own LlamaRMSNorm computing something else
    class LlamaRMSNorm2(LlamaRMSNorm):
        pass

    LlamaRMSNorm2.__name__ = "LlamaRMSNorm"
    assert not is_family_module(LlamaRMSNorm2(16), "RMSNorm")
    assert not is_family_module(LlamaRMSNorm2(16), "RMSNorm", "llama")
