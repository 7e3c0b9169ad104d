"""The torch prefill's blocked causal attention: SDPA's result for a prompt chunk on top of
cached tokens, and SDPA itself for anything but that plain case."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from engine.runners import blocked_attention
from engine.runners.blocked_attention import blocked_causal_attention


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


@pytest.mark.parametrize("rows", [4, 7, 256])
@pytest.mark.parametrize("past", [0, 5, 40])
def test_a_chunk_on_cached_tokens_equals_sdpa_with_its_causal_mask(monkeypatch, rows, past):
    monkeypatch.setattr(blocked_attention, "ROWS", rows)
    q, k, v = _qkv(past=past)
    out, _ = blocked_causal_attention(MODULE, q, k, v, None, scaling=0.3, position_ids=None,
                                      use_cache=True)
    assert out.shape == (1, q.shape[2], q.shape[1], q.shape[3])
    torch.testing.assert_close(out, _reference(q, k, v, 0.3), atol=1e-5, rtol=1e-5)


def test_chunks_give_the_rows_of_the_whole_prompt(monkeypatch):
    monkeypatch.setattr(blocked_attention, "ROWS", 8)
    q, k, v = _qkv(n_q=30)
    whole, _ = blocked_causal_attention(MODULE, q, k, v, None, scaling=0.25)
    parts = [blocked_causal_attention(MODULE, q[:, :, s:e], k[:, :, :e], v[:, :, :e], None,
                                      scaling=0.25)[0] for s, e in ((0, 11), (11, 12), (12, 30))]
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-6, rtol=1e-6)


def test_a_memory_bound_on_scores_shrinks_the_blocks_not_the_result(monkeypatch):
    monkeypatch.setattr(blocked_attention, "SCORES_BYTES", 1)  # 16 rows a block at least
    q, k, v = _qkv(n_q=50, past=3)
    out, _ = blocked_causal_attention(MODULE, q, k, v, None, scaling=0.2)
    torch.testing.assert_close(out, _reference(q, k, v, 0.2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["sliding_window", "softcap", "s_aux", "batch_2", "dropout",
                                  "module_window", "not_causal", "value_width"])
def test_anything_but_plain_causal_attention_goes_to_sdpa(monkeypatch, case):
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
    out, _ = blocked_causal_attention(module, q, k, v, None, dropout=dropout, scaling=0.3,
                                      **kwargs)
    assert out == "sdpa" and len(calls) == 1
