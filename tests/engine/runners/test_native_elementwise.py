"""The native RMSNorm, SiLU(gate) x up and rotary passes (native_elementwise.py): each
equals transformers' own ops (the rotary bit for bit, the others to float32 rounding), bad
inputs are refused, and only transformers' Llama, Mistral and Qwen2 norms, fused SiLU
MLPs and fused full-window attentions are routed through them, with the model's outputs
unchanged beyond rounding."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

from engine.runners.torch import native_gemm
from engine.runners.torch.fused_linear import fuse_siblings
from engine.runners.torch.native_elementwise import fuse_elementwise
from engine.runners.torch.packed_linear import pack_linears

pytestmark = pytest.mark.skipif(not native_gemm.cpu_supported(),
                                reason="the native kernels need x86 AVX2/FMA")


OPS = torch.ops.genserve_elementwise


@pytest.fixture(autouse=True)
def native() -> None:
    assert native_gemm.available()


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(x.shape[-1], eps)
    norm.weight.data.copy_(w)
    return norm(x)


@pytest.mark.parametrize("shape", [(1, 3, 576), (5, 64), (2, 7, 33), (1, 1, 8), (4, 1)])
def test_rms_norm_equals_transformers_to_rounding(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    got = torch.ops.genserve_elementwise.rms_norm(x, w, 1e-5)
    want = hf_rms_norm(x, w, 1e-5)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("shape", [(1, 3, 2 * 1536), (5, 2 * 64), (2, 7, 2 * 13), (1, 2)])
def test_silu_mul_equals_silu_of_gate_times_up_to_rounding(shape):
    g = torch.Generator().manual_seed(1)
    y = torch.randn(shape, generator=g) * 8
    y.view(-1)[:4] = torch.tensor([100.0, -100.0, 0.0, -0.0])[:y.numel()][:4]  # tails
    n = shape[-1] // 2
    got = torch.ops.genserve_elementwise.silu_mul(y)
    want = torch.nn.functional.silu(y[..., :n]) * y[..., n:]
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize(("heads", "kv_heads", "d", "t"), [(9, 3, 64, 37), (4, 4, 16, 1),
                                                            (2, 1, 128, 5)])
def test_rope_split_is_transformers_rotary_bit_for_bit(heads, kv_heads, d, t):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(2)
    y = torch.randn(1, t, (heads + 2 * kv_heads) * d, generator=g)
    angles = torch.rand(1, t, d // 2, generator=g) * 50
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q, k, v = OPS.rope_split(y, cos, sin, heads, kv_heads)
    split = y.view(1, t, -1, d).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(split[:, :heads], split[:, heads:heads + kv_heads],
                                          cos, sin)
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(v, split[:, heads + kv_heads:])


@pytest.mark.parametrize("call", [
    lambda: OPS.rms_norm(torch.randn(2, 8).double(), torch.ones(8), 1e-5),  # float64
    lambda: OPS.rms_norm(torch.randn(8, 2).t(), torch.ones(8), 1e-5),  # not contiguous
    lambda: OPS.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-5),  # weight's size
    lambda: OPS.silu_mul(torch.randn(2, 7)),  # an odd width
    lambda: OPS.silu_mul(torch.randn(8, 2).t()),
    lambda: OPS.rope_split(torch.randn(1, 3, 6 * 8), torch.ones(1, 3, 8), torch.ones(1, 3, 8),
                           2, 2),  # a head size of 8
    lambda: OPS.rope_split(torch.randn(1, 3, 5 * 16), torch.ones(1, 3, 16),
                           torch.ones(1, 3, 16), 2, 2),  # columns not 2 + 2 + 2 heads
    lambda: OPS.rope_split(torch.randn(1, 3, 6 * 16), torch.ones(1, 2, 16),
                           torch.ones(1, 2, 16), 2, 2),  # cos for 2 positions, not 3
])
def test_bad_inputs_are_refused(call):
    with pytest.raises(RuntimeError):
        call()


def tiny(config_cls: str, **extra) -> nn.Module:
    if config_cls == "MistralConfig":
        extra.setdefault("sliding_window", None)
    config = getattr(transformers, config_cls)(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.2, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def prepared(model: nn.Module) -> nn.Module:
    fuse_siblings(model)
    pack_linears(model)
    return model


@pytest.mark.parametrize("config_cls", ["LlamaConfig", "MistralConfig", "Qwen2Config"])
def test_a_fused_model_routes_its_norms_and_mlps_and_keeps_its_logits(config_cls,
                                                                        monkeypatch):
    stock = tiny(config_cls)
    model = prepared(copy.deepcopy(stock))
    ids = torch.arange(40)[None]
    with torch.inference_mode():
        before = model(ids).logits
    layers = model.config.num_hidden_layers
    # norms and the final norm, MLPs, attentions
    assert fuse_elementwise(model) == 2 * layers + 1 + layers + layers
    calls = []
    for name in ("silu_mul", "rope_split"):
        real = getattr(OPS, name)
        monkeypatch.setattr(OPS, name, lambda *a, name=name, real=real: calls.append(
            (name, tuple(a[0].shape))) or real(*a))
    with torch.inference_mode():
        got = model(ids).logits
        want = stock(ids).logits
    assert calls == [("rope_split", (1, 40, (4 + 2 * 2) * 16)),
                     ("silu_mul", (1, 40, 2 * 160))] * layers
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, before, rtol=1e-4, atol=1e-4)


def test_another_familys_modules_unfused_ones_and_windowed_attention_keep_their_forwards():
    gemma = prepared(tiny("Gemma2Config", head_dim=16))
    assert fuse_elementwise(gemma) == 0  # 1 + weight norms, GELU-tanh MLPs, soft-capping
    llama = tiny("LlamaConfig")
    pack_linears(llama)  # packed, q/k/v and gate/up not fused: attentions and MLPs stay
    layers = llama.config.num_hidden_layers
    assert fuse_elementwise(llama) == 2 * layers + 1
    for layer in llama.model.layers:
        assert "forward" not in layer.mlp.__dict__ and "forward" not in layer.self_attn.__dict__
    mistral = prepared(tiny("MistralConfig", sliding_window=8))
    assert fuse_elementwise(mistral) == 2 * layers + 1 + layers  # not the windowed attentions
    assert all("forward" not in layer.self_attn.__dict__ for layer in mistral.model.layers)


def test_a_routed_module_given_a_tensor_the_kernels_do_not_take_runs_its_own_forward():
    model = prepared(tiny("LlamaConfig"))
    fuse_elementwise(model)
    norm, mlp = model.model.norm, model.model.layers[0].mlp
    x = torch.randn(64, 3).t()  # not contiguous
    with torch.inference_mode():
        want = hf_rms_norm(x.contiguous(), norm.weight, norm.variance_epsilon)
        torch.testing.assert_close(norm(x), want)
        y = mlp(x)
        assert y.shape == (3, 64) and torch.isfinite(y).all()
