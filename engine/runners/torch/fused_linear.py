"""Sibling projections that read the same input run as one matrix product.

Every decoder layer computes q, k and v from the same hidden states, and gate and up
from the same normed states: five matrix products where two would do. At one decode row
each is a matrix-vector product bound by reading its weight, and the small ones (k and
v of a grouped-query model: 1,024 of 4,096 columns on Llama-3-8B) leave most of the GPU
idle, so cuBLAS splits their sums and reduces them in an extra kernel. One product over
the concatenated weight reads the same bytes in fewer, larger launches (vLLM and
llama.cpp fuse the same way: ``QKVParallelLinear``, ``MergedColumnParallelLinear``).

The layers stay as transformers wrote them: each member keeps its ``nn.Linear`` with its
weight a view into the fused weight (no memory twice, ``stock_transformers`` restores
plain layers in place), and its forward computes the fused product and returns its own
columns. Eagerly the first member's call computes the product and its siblings reuse it
when called with the very same input tensor (any other input is computed in full, so a
model that feeds them different inputs is still right). Under ``torch.compile`` each
member traces the full product and ``dedupe_products`` (run by the piecewise backend)
keeps one per input.

On the CPU, packed_linear.py packs the fused layer for oneDNN in place of its members.
Not applied with adapter slots (LoRA hooks and folds into each member layer).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# Attribute names of projections that read one input, as transformers' families name
# them (Phi-3 already fuses its own: ``qkv_proj``, ``gate_up_proj``).
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

_GROUPS = "_genserve_fused"  # on the parent module: its FusedGroups
_FORWARD = "_genserve_fused_forward"  # on a member: its forward while fused
_MEMBER = "_genserve_fused_member"  # on a member: its weight is rows of a group's


class _LastProduct(threading.local):
    """The last eager product of a group, per thread (a self-draft shares the layers)."""

    x: torch.Tensor | None = None
    y: torch.Tensor | None = None
    served = 0  # members that took their columns of ``y``


@dataclass(eq=False)
class FusedGroup:
    """Members of one parent module whose weights are rows of one fused weight."""

    linear: nn.Linear  # the fused layer: [sum of outs, in]
    members: list[nn.Linear]
    offsets: list[int]  # each member's first output column in the fused product
    last: _LastProduct = field(default_factory=_LastProduct)

    def point_members(self) -> None:
        """Each member's weight (and bias) a view of its rows of the fused layer's: after
        fusing, and whenever the fused weight is swapped (packed_linear.py packs the
        fused layer and leaves a zero-stride placeholder, whose rows hold no memory)."""
        w, b = self.linear.weight, self.linear.bias
        for m, start in zip(self.members, self.offsets, strict=True):
            end = start + m.out_features
            m.weight = nn.Parameter(w[start:end], requires_grad=False)
            if b is not None:
                m.bias = nn.Parameter(b[start:end], requires_grad=False)

    def product(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            y = self.linear(x)  # every member traces it; dedupe_products keeps one
        else:
            last = self.last
            if last.x is x and last.y is not None:
                y = last.y
            else:
                y = self.linear(x)
                last.x, last.y, last.served = x, y, 0
            last.served += 1
            if last.served == len(self.members):  # every member served: let them go
                last.x = last.y = None
        start = self.offsets[index]
        return y[..., start:start + self.members[index].out_features]


def _fusable(members: list[nn.Module | None]) -> bool:
    """Plain dense layers of one input size, dtype and device, all with a bias or none."""
    if not all(type(m) is nn.Linear for m in members):
        return False
    layers = [m for m in members if isinstance(m, nn.Linear)]
    return (len({(m.in_features, m.weight.dtype, m.weight.device, m.bias is None)
                 for m in layers}) == 1
            and all(m.weight.is_contiguous() for m in layers))


def fuse_siblings(model: nn.Module) -> int:
    """Fuse every group of sibling projections in ``model``; returns how many groups.
    Idempotent: a model fused before (and unfused by ``unfuse_siblings``) gets its very
    forwards back (compiled graphs guard on their identity)."""
    count = 0
    with torch.no_grad():
        for parent in model.modules():
            groups: list[FusedGroup] | None = parent.__dict__.get(_GROUPS)
            if groups is None:
                groups = []
                for names in SIBLINGS:
                    members = [getattr(parent, n, None) for n in names]
                    if _fusable(members):
                        groups.append(_fuse([m for m in members if isinstance(m, nn.Linear)]))
                if not groups:
                    continue
                parent.__dict__[_GROUPS] = groups
            for group in groups:
                for member in group.members:
                    member.__dict__["forward"] = member.__dict__[_FORWARD]
                count += 1
    if count:
        log.info("fused %d groups of sibling projections (q/k/v, gate/up)", count)
    return count


def _fuse(members: list[nn.Linear]) -> FusedGroup:
    weight = torch.cat([m.weight for m in members])
    bias = None
    if members[0].bias is not None:
        bias = torch.cat([m.bias for m in members if m.bias is not None])
    fused = nn.Linear(members[0].in_features, weight.shape[0], bias=bias is not None,
                      device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    offsets, start = [], 0
    for m in members:
        offsets.append(start)
        start += m.out_features
    group = FusedGroup(fused, members, offsets)
    group.point_members()  # views: the separate weights are freed
    for i, m in enumerate(members):
        m.__dict__[_FORWARD] = partial(group.product, i)
        m.__dict__[_MEMBER] = True
    return group


def fused_groups(mod: nn.Module) -> list[FusedGroup]:
    """The fused groups whose members are ``mod``'s children."""
    return mod.__dict__.get(_GROUPS, [])


def is_member(mod: nn.Module) -> bool:
    """Whether ``mod``'s weight is rows of a fused group's (its group's layer holds it)."""
    return _MEMBER in mod.__dict__


def unfuse_siblings(model: nn.Module) -> None:
    """Plain layers again (their weights stay views of the fused weight: same values)."""
    for parent in model.modules():
        for group in fused_groups(parent):
            for member in group.members:
                member.__dict__.pop("forward", None)


def is_fused(model: nn.Module) -> bool:
    return any("forward" in m.__dict__ and _FORWARD in m.__dict__ for m in model.modules())


def _products() -> tuple:
    """The call targets of one layer's product in a traced graph."""
    targets: list = [F.linear, torch._C._nn.linear]
    packed = getattr(torch.ops.genserve, "packed_linear", None)  # once packed_linear.py ran
    if packed is not None:
        targets += [packed, packed.default]
    native = getattr(torch.ops, "genserve_gemm", None)  # the native panels, called directly
    for name in ("linear", "linear_quantized"):
        op = getattr(native, name, None) if native is not None else None
        if op is not None:
            targets += [op, op.default]
    return tuple(targets)


def dedupe_products(gm: torch.fx.GraphModule) -> int:
    """Keep one of identical ``linear`` calls (same input, weight and bias) in a traced
    graph: the fused siblings each trace the full product. Returns how many went."""
    seen: dict[tuple, torch.fx.Node] = {}
    removed = 0
    products = _products()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in products:
            continue
        key = (node.target, node.args, tuple(sorted(node.kwargs.items())))
        try:
            hash(key)
        except TypeError:
            continue
        kept = seen.setdefault(key, node)
        if kept is not node:
            node.replace_all_uses_with(kept)
            gm.graph.erase_node(node)
            removed += 1
    if removed:
        gm.graph.lint()
        gm.recompile()
    return removed
