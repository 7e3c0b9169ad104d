"""The torch prefill's causal attention of a prompt chunk on top of cached tokens (blocked
GEMMs for bf16, SDPA's flash kernel split at the past for float32): SDPA's result with the
chunk's mask, and SDPA itself for anything but that plain case."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from engine.runners import blocked_attention
from engine.runners.blocked_attention import blocked_causal_attention, split_causal_attention

BOTH = pytest.mark.parametrize("attention", [blocked_causal_attention, split_causal_attention],
                               ids=["blocked", "split"])


def _qkv(heads=6, kv_heads=2, n_q=23, past=0, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, n_q, d, generator=g)
    k = torch.randn(1, kv_heads, past + n_q, d, generator=g)
    v = torch.randn(1, kv_heads, past + n_q, d, generator=g)
    return q, k, v


def _reference(q, k, v, scale):
    """SDPA with the causal mask of rows at positions past .. past + L - 1."""
    n_q, n_kv = q.shape[2], k.shape[2]
    mask = torch.ones(n_q, n_kv, dtype=torch.bool).tril(n_kv - n_q)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2)


MODULE = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)


@BOTH
@pytest.mark.parametrize("rows", [4, 7, 256])
@pytest.mark.parametrize("past", [0, 5, 40])
def test_a_chunk_on_cached_tokens_equals_sdpa_with_its_causal_mask(monkeypatch, attention,
                                                                  rows, past):
    monkeypatch.setattr(blocked_attention, "ROWS", rows)
    q, k, v = _qkv(past=past)
    out, _ = attention(MODULE, q, k, v, None, scaling=0.3, position_ids=None, use_cache=True)
    assert out.shape == (1, q.shape[2], q.shape[1], q.shape[3])
    torch.testing.assert_close(out, _reference(q, k, v, 0.3), atol=1e-5, rtol=1e-5)


@BOTH
def test_chunks_give_the_rows_of_the_whole_prompt(monkeypatch, attention):
    monkeypatch.setattr(blocked_attention, "ROWS", 8)
    q, k, v = _qkv(n_q=30)
    whole, _ = attention(MODULE, q, k, v, None, scaling=0.25)
    parts = [attention(MODULE, q[:, :, s:e], k[:, :, :e], v[:, :, :e], None,
                       scaling=0.25)[0] for s, e in ((0, 11), (11, 12), (12, 30))]
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-6, rtol=1e-6)


def test_a_memory_bound_on_scores_shrinks_the_blocks_not_the_result(monkeypatch):
    monkeypatch.setattr(blocked_attention, "SCORES_BYTES", 1)  # 16 rows a block at least
    q, k, v = _qkv(n_q=50, past=3)
    out, _ = blocked_causal_attention(MODULE, q, k, v, None, scaling=0.2)
    torch.testing.assert_close(out, _reference(q, k, v, 0.2), atol=1e-5, rtol=1e-5)


@BOTH
@pytest.mark.parametrize("case", ["sliding_window", "softcap", "s_aux", "batch_2", "dropout",
                                  "module_window", "not_causal", "value_width"])
def test_anything_but_plain_causal_attention_goes_to_sdpa(monkeypatch, attention, case):
    calls = []

    def sdpa(*args, **kwargs):
        calls.append(kwargs)
        return "sdpa", None

    monkeypatch.setattr(blocked_attention, "sdpa_attention_forward", sdpa)
    q, k, v = _qkv()
    module, kwargs, dropout = MODULE, {}, 0.0
    if case in ("sliding_window", "softcap"):
        kwargs[case] = 4
    elif case == "s_aux":
        kwargs["s_aux"] = torch.zeros(6)
    elif case == "batch_2":
        q, k, v = (torch.cat([t, t]) for t in (q, k, v))
    elif case == "dropout":
        dropout = 0.1
    elif case == "value_width":
        v = torch.cat([v, v], dim=-1)
    elif case == "module_window":
        module = types.SimpleNamespace(num_key_value_groups=3, sliding_window=4)
    else:
        kwargs["is_causal"] = False
    out, _ = attention(module, q, k, v, None, dropout=dropout, scaling=0.3, **kwargs)
    assert out == "sdpa" and len(calls) == 1


def _tiny(family: str):
    """A tiny random model with sliding-window layers shorter than the test's prompt:
    Mistral (every layer), Gemma 3 (local layers between global ones)."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, MistralConfig

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, sliding_window=8)
    config = (MistralConfig(**common) if family == "mistral" else
              Gemma3TextConfig(**common, sliding_window_pattern=2, query_pre_attn_scalar=16,
                               final_logit_softcapping=None))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("name", [blocked_attention.NAME, blocked_attention.SPLIT_NAME])
@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_a_sliding_window_model_in_chunks_equals_its_eager_attention(family, name):
    """The torch prefill runs the model with this attention in chunks on a cache, with no
    mask of its own: the sliding layers (which go to SDPA) must still see only their
    window, as transformers' eager attention does over the whole prompt."""
    from transformers import DynamicCache

    model = _tiny(family)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model.set_attn_implementation("eager")
        want = model(ids).logits[0]
        model.set_attn_implementation(name)
        cache, rows = DynamicCache(), []
        for start, end in ((0, 24), (24, 33), (33, 40)):
            hidden = model.model(input_ids=ids[:, start:end], cache=cache,
                                 use_cache=True).last_hidden_state
            rows.append(model.lm_head(hidden[0]))
    torch.testing.assert_close(torch.cat(rows), want, atol=1e-4, rtol=1e-4)
