"""Fused sibling projections (q/k/v, gate/up as one product): same outputs as the plain
layers eagerly and compiled, one product per input in a compiled graph, weights shared
(not copied), stock transformers restored inside ``stock_transformers``, and layers the
fusion must leave alone (packed, adapters, other shapes) left alone."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.runners.torch import fused_linear
from engine.runners.torch.fused_linear import (
    dedupe_products,
    fuse_siblings,
    is_fused,
    unfuse_siblings,
)
from engine.runners.torch.model_runner import ModelRunner
from engine.runners.torch.packed_linear import is_packed, stock_transformers


def _model(tiny_model_dir) -> nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits


def test_fused_model_gives_the_plain_model_logits(tiny_model_dir):
    model = _model(tiny_model_dir)
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    want = _logits(model, ids)
    layers = len(model.model.layers)
    assert fuse_siblings(model) == 2 * layers  # q/k/v and gate/up of every layer
    assert is_fused(model)
    torch.testing.assert_close(_logits(model, ids), want, rtol=1e-5, atol=1e-5)


def test_members_hold_views_of_the_fused_weight_not_copies(tiny_model_dir):
    model = _model(tiny_model_dir)
    attn = model.model.layers[0].self_attn
    q_before = attn.q_proj.weight.clone()
    fuse_siblings(model)
    (group,) = attn.__dict__[fused_linear._GROUPS]
    fused = group.linear.weight
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()
    assert attn.k_proj.weight.data_ptr() == fused[attn.q_proj.out_features:].data_ptr()
    torch.testing.assert_close(attn.q_proj.weight, q_before, rtol=0, atol=0)


def test_siblings_reuse_one_eager_product_for_the_same_input(tiny_model_dir, monkeypatch):
    model = _model(tiny_model_dir)
    fuse_siblings(model)
    calls = []
    group = model.model.layers[0].self_attn.__dict__[fused_linear._GROUPS][0]
    real = group.linear.forward
    monkeypatch.setattr(group.linear, "forward", lambda x: calls.append(x) or real(x))
    attn = model.model.layers[0].self_attn
    x = torch.randn(3, attn.q_proj.in_features)
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert len(calls) == 1
    for out, layer in ((q, attn.q_proj), (k, attn.k_proj), (v, attn.v_proj)):
        torch.testing.assert_close(out, x @ layer.weight.T, rtol=1e-5, atol=1e-5)
    # any call order shares one product
    v2, q2, k2 = attn.v_proj(x), attn.q_proj(x), attn.k_proj(x)
    assert len(calls) == 2
    torch.testing.assert_close(torch.cat([q2, k2, v2], -1), torch.cat([q, k, v], -1))
    # a sibling fed another input computes it in full (still right, never stale)
    other = torch.randn(3, attn.q_proj.in_features)
    attn.q_proj(x)
    torch.testing.assert_close(attn.k_proj(other), other @ attn.k_proj.weight.T,
                               rtol=1e-5, atol=1e-5)
    assert len(calls) == 4


def test_compiled_graph_keeps_one_product_per_input(tiny_model_dir):
    model = _model(tiny_model_dir)
    fuse_siblings(model)
    attn = model.model.layers[0].self_attn
    seen: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        before = sum(n.target in fused_linear._products() for n in gm.graph.nodes)
        dedupe_products(gm)
        after = sum(n.target in fused_linear._products() for n in gm.graph.nodes)
        seen.extend([before, after])
        return gm.forward

    fn = torch.compile(lambda x: attn.q_proj(x) + attn.k_proj(x).sum() + attn.v_proj(x).sum(),
                       backend=backend, fullgraph=True)
    x = torch.randn(2, attn.q_proj.in_features)
    with torch.inference_mode():
        got = fn(x)
    want = x @ attn.q_proj.weight.T + (x @ attn.k_proj.weight.T).sum() \
        + (x @ attn.v_proj.weight.T).sum()
    assert seen == [3, 1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_stock_transformers_runs_plain_layers_inside_and_fuses_again_after(tiny_model_dir):
    model = _model(tiny_model_dir)
    fuse_siblings(model)
    q = model.model.layers[0].self_attn.q_proj
    forward = q.__dict__["forward"]
    with stock_transformers(model):
        assert not is_fused(model)
        assert "forward" not in q.__dict__
    assert q.__dict__["forward"] is forward  # the very object: compiled graphs guard on it
    unfuse_siblings(model)
    assert not is_fused(model)


def _runner(model_dir, **kw) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(model_dir), device="cpu",
                                    kv_cache_memory=1 << 20, **kw))


def test_runner_fuses_plain_and_packed_layers_but_not_adapter_layers(tiny_model_dir,
                                                                     tmp_path):
    assert is_fused(_runner(tiny_model_dir, pack_weights=False).model)
    assert is_fused(_runner(tiny_model_dir, pack_weights=True).model)
    # adapter slots hook (and on packed layers fold into) each layer: left plain
    assert not is_fused(_runner(tiny_model_dir, pack_weights=False,
                                adapter_cache=str(tmp_path)).model)
    assert not is_fused(_runner(tiny_model_dir, pack_weights=True,
                                adapter_cache=str(tmp_path)).model)


def test_packed_fused_layers_give_the_plain_logits_and_unpack_exactly(tiny_model_dir):
    """On the CPU the fused layer is what oneDNN packs: its members hold no dense weight
    while packed, the logits are the plain model's, and stock transformers gets back
    every member's exact weight."""
    want_model = _model(tiny_model_dir)
    ids = torch.randint(0, 1000, (1, 11), generator=torch.Generator().manual_seed(1))
    want = _logits(want_model, ids)
    model = _runner(tiny_model_dir, pack_weights=True).model
    assert is_packed(model) and is_fused(model)
    q = model.model.layers[0].self_attn.q_proj
    assert q.weight.stride() == (0, 0)  # a placeholder's rows: no memory
    with stock_transformers(model):
        assert not is_packed(model) and not is_fused(model)
        for mine, plain in zip(model.modules(), want_model.modules(), strict=True):
            if isinstance(mine, nn.Linear):
                assert torch.equal(mine.weight, plain.weight)
        got = _logits(model, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # plain layers: exactly HF
    assert is_packed(model) and is_fused(model)
    assert q.weight.stride() == (0, 0)


def test_layers_of_other_input_sizes_or_kinds_are_not_fused():
    parent = nn.Module()
    parent.q_proj, parent.k_proj = nn.Linear(8, 8), nn.Linear(8, 4)
    parent.v_proj = nn.Linear(6, 4)  # another input size
    parent.gate_proj, parent.up_proj = nn.Linear(8, 8, bias=False), nn.Linear(8, 8)
    assert fuse_siblings(parent) == 0  # bias on one of gate/up only
