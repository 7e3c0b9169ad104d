"""Megatron-style sharding of a transformers model in place, for tensor parallelism.

Each decoder layer's q/k/v and gate/up projections are column-parallel (a rank keeps its
heads' rows, its slice of the intermediate size), o_proj and down_proj row-parallel (the
matching input columns) followed by an all-reduce of the partial outputs. Fused
projections (Phi-3's ``qkv_proj``, ``gate_up_proj``) are sharded part by part, so a rank's
slice of the fused weight is [its q rows; its k rows; its v rows]. The model's own modules
run unchanged (every architecture keeps going through the attention hook, with H/N query
and KV/N key/value heads); only the Linear weights are swapped for shards and the
row-parallel ones' forward wrapped.

Embedding and LM head are replicated, not vocab-parallel: rank 0 computes the logits
itself, so a step needs no all-gather and the logits equal what the one-device head gives
on the same hidden state; workers skip the head (``drop_head``). The cost is the head's
weights held whole on rank 0 (a few per cent of a 7B+ model).

Refused, with the reason, before any worker starts: head counts or intermediate size that
do not divide by N, mixture-of-experts layers (experts are not sharded), norms over all
heads (OLMo-2's q/k norm needs the full projection) and any layer part it does not know.

LoRA adapters (lora.py) follow each layer's cut, recorded on it as a ``LinearShard``: a
column-parallel layer's input is whole, so it keeps A whole and B's rows of its outputs
(fused parts cut part by part, as the weight); a row-parallel layer keeps A's columns of
its inputs and B whole, and adds its partial LoRA term before the all-reduce (the
all-reduce is a forward hook that runs after the LoRA hook), so the sum over ranks is
exactly ``x A^T B^T``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from engine.runners.torch.attention import UnsupportedModelFeature
from engine.runners.torch.tp_group import all_reduce

ATTN_COLUMN = ("q_proj", "k_proj", "v_proj")
ATTN_ROW = ("o_proj",)
MLP_COLUMN = ("gate_proj", "up_proj", "c_fc")
MLP_ROW = ("down_proj", "c_proj")
PER_HEAD_NORMS = ("q_norm", "k_norm")  # allowed when they normalise one head (head_dim)
HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads")
MOE_CONFIG_KEYS = ("num_local_experts", "num_experts", "moe_intermediate_size", "n_routed_experts")


def _refuse(config: Any, n: int, why: str) -> UnsupportedModelFeature:
    return UnsupportedModelFeature(
        f"{getattr(config, 'model_type', 'model')}: --tensor-parallel-size {n} cannot "
        f"shard this model: {why}")


def _shape(config: Any) -> tuple[int, int, int, int]:
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return heads, kv, head_dim, text.hidden_size


def check_config(config: Any, n: int) -> None:
    """What the config alone tells: divisibility and experts."""
    text = config.get_text_config()
    heads, kv, _, _ = _shape(config)
    problems = []
    if heads % n:
        problems.append(f"num_attention_heads={heads} does not divide by {n}")
    if kv % n:
        problems.append(f"num_key_value_heads={kv} does not divide by {n} (KV heads are "
                        f"split, never replicated)")
    inter = getattr(text, "intermediate_size", None)
    if inter is not None and inter % n:
        problems.append(f"intermediate_size={inter} does not divide by {n}")
    moe = [k for k in MOE_CONFIG_KEYS if getattr(text, k, None)]
    if moe:
        problems.append(f"mixture-of-experts layers ({', '.join(moe)}): experts are not "
                        f"sharded; serve it with --tensor-parallel-size 1")
    if problems:
        raise _refuse(config, n, "; ".join(problems))


def decoder_layers(model: Any) -> nn.ModuleList:
    """The model's ModuleList of decoder layers (as many as ``num_hidden_layers``)."""
    count = model.config.get_text_config().num_hidden_layers
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == count and all(
                hasattr(layer, "self_attn") for layer in mod):
            return mod
    raise UnsupportedModelFeature(f"{getattr(model.config, 'model_type', 'model')}: no "
                                  f"list of decoder layers with self_attn to shard")


def _params(mod: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(mod.named_parameters())


def check_model(model: nn.Module, n: int) -> None:
    """What the modules tell (a meta-device model suffices): every layer part with weights
    is one this module shards or a replicated norm."""
    heads, kv, head_dim, hidden = _shape(model.config)
    for i, layer in enumerate(decoder_layers(model)):
        for name, child in layer.named_children():
            if name == "self_attn":
                linears = {*ATTN_COLUMN, *ATTN_ROW, "qkv_proj"}
                for sub, mod in child.named_children():
                    if sub in linears or not _params(mod):
                        continue
                    if sub in PER_HEAD_NORMS and all(p.numel() == head_dim
                                                     for _, p in _params(mod)):
                        continue
                    raise _refuse(model.config, n, f"layer {i} self_attn.{sub} spans all "
                                  f"heads (a norm over the whole projection)")
            elif name == "mlp":
                linears = {*MLP_COLUMN, *MLP_ROW, "gate_up_proj"}
                for sub, mod in child.named_children():
                    if sub not in linears and _params(mod):
                        raise _refuse(model.config, n, f"layer {i} mlp.{sub} (experts or "
                                      f"routers are not sharded)")
            else:
                for pname, p in _params(child):
                    if p.numel() != hidden:
                        raise _refuse(model.config, n, f"layer {i} {name}.{pname} is not "
                                      f"a norm the ranks can replicate")
        if not hasattr(layer, "mlp"):
            raise _refuse(model.config, n, f"layer {i} has no mlp")


def check_tensor_parallel(config: Any, n: int, trust_remote_code: bool = False) -> None:
    """Before any worker starts: the config's checks, then the module structure of the
    model built on the meta device (no weights, milliseconds)."""
    from transformers import AutoModelForCausalLM

    check_config(config, n)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    check_model(model, n)


@dataclass(frozen=True)
class LinearShard:
    """How one rank's Linear was cut from the full layer, so that anything else sized for
    the full layer (a LoRA adapter's A and B) is cut the same way."""

    kind: Literal["column", "row"]
    full_in: int
    full_out: int
    parts: tuple[int, ...]  # column: the full output's (fused) parts, each split over ranks
    rank: int
    size: int  # ranks in the group

    def lora(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of a LoRA pair made for the full layer (``a [r, in]``,
        ``b [out, r]``): B's output rows (column-parallel) or A's input columns
        (row-parallel)."""
        if self.kind == "column":
            return a, _rows(b, list(self.parts), self.rank, self.size)
        step = self.full_in // self.size
        return a[:, self.rank * step:(self.rank + 1) * step], b


def linear_shard(mod: nn.Module) -> LinearShard | None:
    """The cut ``shard_model`` made of ``mod`` (None: a whole, replicated layer)."""
    return mod.__dict__.get("_genserve_tp_shard")


def _rows(w: torch.Tensor, parts: list[int], rank: int, n: int) -> torch.Tensor:
    """Rank's slice of each part of a column-parallel (fused) weight or bias, in order."""
    out, start = [], 0
    for size in parts:
        step = size // n
        out.append(w[start + rank * step:start + (rank + 1) * step])
        start += size
    return torch.cat(out) if len(out) > 1 else out[0]


def _column(mod: nn.Linear, parts: list[int], rank: int, n: int) -> None:
    mod.__dict__["_genserve_tp_shard"] = LinearShard("column", mod.in_features,
                                                     mod.out_features, tuple(parts), rank, n)
    with torch.no_grad():
        mod.weight = nn.Parameter(_rows(mod.weight, parts, rank, n).clone(),
                                  requires_grad=False)
        if mod.bias is not None:
            mod.bias = nn.Parameter(_rows(mod.bias, parts, rank, n).clone(),
                                    requires_grad=False)
    mod.out_features = mod.weight.shape[0]


def _row(mod: nn.Linear, rank: int, n: int) -> None:
    """Input columns of this rank; the bias is added once, by rank 0, before the sum."""
    mod.__dict__["_genserve_tp_shard"] = LinearShard("row", mod.in_features,
                                                     mod.out_features, (), rank, n)
    step = mod.in_features // n
    with torch.no_grad():
        mod.weight = nn.Parameter(mod.weight[:, rank * step:(rank + 1) * step].clone(),
                                  requires_grad=False)
        if mod.bias is not None and rank != 0:
            mod.register_parameter("bias", None)
    mod.in_features = step


def shard_model(model: nn.Module, rank: int, n: int) -> None:
    """Replace every decoder layer's projection weights with this rank's shard."""
    check_config(model.config, n)
    check_model(model, n)
    heads, kv, head_dim, _ = _shape(model.config)
    for layer in decoder_layers(model):
        attn: Any = layer.self_attn
        mlp: Any = layer.mlp
        for name in ATTN_COLUMN:
            if hasattr(attn, name):
                size = (heads if name == "q_proj" else kv) * head_dim
                _column(getattr(attn, name), [size], rank, n)
        if hasattr(attn, "qkv_proj"):
            _column(attn.qkv_proj, [heads * head_dim, kv * head_dim, kv * head_dim], rank, n)
            # Phi-3 splits the fused output by the config's head counts: a copy of them.
            attn.config = copy.copy(attn.config)
            attn.config.num_attention_heads = heads // n
            attn.config.num_key_value_heads = kv // n
        for attr in HEAD_COUNT_ATTRS:
            if isinstance(getattr(attn, attr, None), int):
                setattr(attn, attr, getattr(attn, attr) // n)
        for name in ATTN_ROW:
            _row(getattr(attn, name), rank, n)
        for name in MLP_COLUMN:
            if hasattr(mlp, name):
                _column(getattr(mlp, name), [getattr(mlp, name).out_features], rank, n)
        if hasattr(mlp, "gate_up_proj"):
            half = mlp.gate_up_proj.out_features // 2
            _column(mlp.gate_up_proj, [half, half], rank, n)
        for name in MLP_ROW:
            if hasattr(mlp, name):
                _row(getattr(mlp, name), rank, n)


def _reduce_output(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor
                   ) -> torch.Tensor:
    return all_reduce(out)


def reduce_row_parallel(model: nn.Module) -> int:
    """Give every row-parallel layer its all-reduce: a forward hook, so it follows
    whichever forward the layer has (oneDNN-packed or plain); LoRA's hook, registered
    later, is prepended, so its partial term is summed too. Returns how many."""
    count = 0
    for mod in model.modules():
        shard = linear_shard(mod)
        if shard is not None and shard.kind == "row" and \
                "_genserve_tp_reduce" not in mod.__dict__:
            mod.__dict__["_genserve_tp_reduce"] = mod.register_forward_hook(_reduce_output)
            count += 1
    return count


class NoHead(nn.Module):
    """A worker's LM head: rank 0 alone computes logits, so a worker returns none (an
    empty last dimension) and holds no head weights; ``weight`` keeps the shape for
    whoever asks the vocabulary size."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        weight = head.weight
        assert isinstance(weight, torch.Tensor)
        self.weight = nn.Parameter(torch.empty(1, dtype=weight.dtype,
                                               device=weight.device).expand(weight.shape),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A view of ``x``, not a new tensor: the compiled step must still compute the last
        # layer (and its all-reduces, which rank 0 waits in) for an output nobody reads.
        return x[..., :0]


def drop_head(model: Any) -> None:
    """A worker's model: its LM head replaced by ``NoHead``."""
    model.set_output_embeddings(NoHead(model.get_output_embeddings()))
