"""oneDNN-packed linear layers: same results as ``F.linear``, memory not held twice, exactly
undone for stock transformers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.runners.torch.packed_linear import (
    can_pack,
    is_packed,
    pack_linears,
    stock_transformers,
    unpack_linears,
)

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32),
                                reason="torch built without oneDNN")


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 24)
        self.head = nn.Linear(24, 50, bias=False)
        self.out = nn.Linear(16, 50, bias=False)
        self.out.weight = self.embed.weight  # tied, as in SmolLM2

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(torch.relu(self.proj(h))) + self.out(h)


def test_packed_layers_match_f_linear_for_any_row_count():
    torch.manual_seed(0)
    model = Tied()
    ids = [torch.randint(0, 50, (1, n)) for n in (1, 2, 9, 40)]
    with torch.inference_mode():
        want = [model(x) for x in ids]
        assert pack_linears(model) == 3
        got = [model(x) for x in ids]
    assert is_packed(model)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_untied_weights_are_not_held_twice_and_tied_ones_stay():
    model = Tied()
    embed_before = model.embed.weight.detach().clone()
    pack_linears(model)
    assert model.proj.weight.stride() == (0, 0)  # a placeholder: no second copy
    assert model.proj.weight.shape == (24, 16)  # callers still read the shape
    assert model.out.weight is model.embed.weight  # the embedding still reads it
    assert torch.equal(model.embed.weight, embed_before)


def test_unpack_restores_the_exact_weights_and_plain_forward():
    torch.manual_seed(1)
    model = Tied()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pack_linears(model)
    unpack_linears(model)
    assert not is_packed(model)
    assert "forward" not in model.proj.__dict__
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_repacking_restores_the_same_objects_compiled_graphs_guard_on():
    """A compiled step guards on each packed layer's ``forward`` and ``weight`` objects:
    unpacked and packed again (the benchmark's eager baselines), a layer must get the very
    same ones, or the next compiled step fails its guards and falls back to eager."""
    torch.manual_seed(2)
    model = Tied()
    pack_linears(model)
    forward, weight = model.proj.forward, model.proj.weight
    x = torch.randint(0, 50, (1, 5))
    with torch.inference_mode():
        want = model(x)
        unpack_linears(model)
        pack_linears(model)
        got = model(x)
    assert model.proj.forward is forward and model.proj.weight is weight
    torch.testing.assert_close(got, want)


def test_packing_twice_is_a_no_op():
    model = Tied()
    pack_linears(model)
    assert pack_linears(model) == 0


def test_stock_transformers_unpacks_inside_and_repacks_after(tiny_model_dir):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=1 << 20))
    model = engine.runner.model
    assert is_packed(model)  # the default on CPU in fp32
    with stock_transformers(model):
        assert not is_packed(model)
        assert model.config._attn_implementation == "sdpa"
    assert is_packed(model)
    assert model.config._attn_implementation != "sdpa"
