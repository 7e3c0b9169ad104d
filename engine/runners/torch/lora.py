"""Per-row LoRA in one packed forward: rows of the base model and of several adapters mix.

Every linear layer of the decoder (not the LM head) gets a forward hook and two stacked
weights holding every adapter slot side by side, each slot ``R = max_lora_rank`` wide
(an adapter of lower rank is zero-padded, its scaling folded into B):

    A_cat [in, S * R]    B_cat [S * R, out]      (S = max_loras; slot 0, the base, has none)

A step passes each token's slot as a mask ``[T, S * R]`` (ones over the token's own
slot's R columns, zeros elsewhere: all zero for base rows); the hook adds

    out += ((x @ A_cat) * mask) @ B_cat        (one mm, one mul, one addmm per layer)

so each token gets exactly its own adapter's ``x A^T B^T`` (zero for base rows): no loop
over rows, slots or layers in Python, fixed shapes whatever the mix (the compiled decode
step and CUDA graphs take it as is). The price is the LoRA matmuls over every slot,
``S * R * (in + out)`` multiply-adds per token and layer, against ``in * out`` for the
layer itself (18% for S * R = 64 over SmolLM2-135M's layers). Eagerly, a step with no
adapter row skips the hooks entirely, and a layer no resident adapter targets skips its
own.

On oneDNN-packed CPU layers (packed_linear.py) the ``x @ A_cat`` rides on the base GEMM:
a layer some slot adapts has ``[W; A_catᵀ]`` packed as its weight and a forward that
slices the two apart (``_fold``), leaving one mul and one addmm (small MKL calls are
overhead bound: 1.13-1.17x on 32 mixed clients, docs/adapters.md).

With tensor parallelism each rank's stacks hold its share of every adapter, cut as its
layer was (``tp_shard.LinearShard``): B's output rows of a column-parallel layer, A's
input columns of a row-parallel one, whose partial LoRA term the all-reduce then sums
(the hook is prepended, so it runs before the all-reduce hook). Adapters are checked
against the full layer's shape, on rank 0, before any rank writes them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.adapters import AdapterError, LoraAdapter
from engine.runners.torch.gguf_lora import gguf_as_peft
from engine.runners.torch.packed_linear import base_weight, call_packed, packed_key, set_packed
from engine.runners.torch.tp_shard import LinearShard, linear_shard


@dataclass(eq=False)
class _Stack:
    a: torch.Tensor  # [in, S * R]   (this rank's share with tensor parallelism)
    b: torch.Tensor  # [S * R, out]
    fan_in: int  # the full layer's, as adapters are made for it
    fan_out: int
    shard: LinearShard | None  # how this rank's layer was cut (None: whole)
    module: nn.Linear
    targeted: set[int] = field(default_factory=set)  # slots whose adapter targets this layer
    # The layer's forward while A is folded into its packed weight (``_fold``), else None
    folded: Callable[[torch.Tensor], torch.Tensor] | None = None


class _StepMask(threading.local):
    """The running forward's token mask, per thread: a draft model sharing these layers
    (self-draft) or a background compile never sees another thread's step."""

    mask: torch.Tensor | None = None  # [T, S * R]
    always: bool = False  # compute every hooked layer (a CUDA graph being captured)


class LoraLayers:
    """The adapter slots of one model: stacked weights and the hooks that apply them."""

    def __init__(self, model: Any, max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.slots = max_loras
        self.rank = max_rank
        self.device = device
        self.dtype = dtype
        self.stacks: dict[str, _Stack] = {}
        self.config = model.config  # what reading a GGUF adapter needs (architecture, heads)
        self.current = _StepMask()
        # Compiled steps read the mask from here (rows filled before each run): one
        # tensor for the graphs' lifetime, sized by ``reserve_static``.
        self.static_mask = torch.zeros(1, max_loras * max_rank, dtype=dtype, device=device)
        # Set once compiled steps are built: each layer then stays folded or not (``_fold``)
        self.folds_frozen = False
        head = model.get_output_embeddings()
        width = max_loras * max_rank
        for name, mod in model.named_modules():
            if not isinstance(mod, nn.Linear) or mod is head:
                continue
            shard = linear_shard(mod)
            stack = _Stack(torch.zeros(mod.in_features, width, dtype=dtype, device=device),
                           torch.zeros(width, mod.out_features, dtype=dtype, device=device),
                           shard.full_in if shard else mod.in_features,
                           shard.full_out if shard else mod.out_features, shard, mod)
            self.stacks[name] = stack
            # First among the layer's hooks: a row-parallel layer's partial LoRA term must
            # be in its all-reduce (tp_shard.reduce_row_parallel).
            mod.register_forward_hook(partial(_apply, self, stack), prepend=True)

    # ---- adapters --------------------------------------------------------------------

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write ``adapter`` into ``slot`` of every layer (zeros where it has no weights),
        after checking that it fits: ``AdapterError`` otherwise, nothing written."""
        self.write(slot, self.check(slot, adapter))

    def check(self, slot: int, adapter: LoraAdapter) -> LoraAdapter:
        """``adapter`` in PEFT's layout (a GGUF file read back), once it fits the model's
        full layers: ``AdapterError`` otherwise (ValueError for a slot out of range)."""
        if not 1 <= slot <= self.slots:
            raise ValueError(f"adapter slot {slot} outside 1..{self.slots}")
        if adapter.gguf is not None:  # llama.cpp's layout: read back into PEFT's
            adapter = gguf_as_peft(adapter, self.config, self.stacks)
        aid = adapter.adapter_id
        if adapter.rank > self.rank:
            raise AdapterError(aid, f"rank {adapter.rank} exceeds the server's limit "
                               f"{self.rank} (--max-lora-rank)")
        for target in adapter.target_modules:
            if not any(name == target or name.endswith("." + target) for name in self.stacks):
                raise AdapterError(aid, f"target module {target!r}: the model has no linear "
                                   f"layer of that name")
        for name, weights in adapter.weights.items():
            stack = self.stacks.get(name)
            if stack is None:
                raise AdapterError(aid, f"target module {name!r}: the model has no linear "
                                   f"layer of that name (the LM head and embeddings cannot "
                                   f"be adapted)")
            fan_in, fan_out = stack.fan_in, stack.fan_out
            if weights.a.shape[1] != fan_in or weights.b.shape[0] != fan_out:
                raise AdapterError(aid, f"module {name!r}: lora_A {list(weights.a.shape)} / "
                                   f"lora_B {list(weights.b.shape)} do not fit the layer "
                                   f"({fan_in} -> {fan_out})")
        return adapter

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy a checked adapter into ``slot`` (this rank's share of each layer)."""
        cols = slice((slot - 1) * self.rank, slot * self.rank)
        with torch.no_grad():
            for name, stack in self.stacks.items():
                w = adapter.weights.get(name)
                if w is None and slot not in stack.targeted:
                    continue  # the slot's columns are zero and stay so: nothing to re-pack
                stack.a[:, cols].zero_()
                stack.b[cols].zero_()
                if w is None:
                    stack.targeted.discard(slot)
                else:
                    r = w.a.shape[0]  # a GGUF adapter's pairs may differ in rank
                    a, b = stack.shard.lora(w.a, w.b) if stack.shard else (w.a, w.b)
                    stack.a[:, cols.start:cols.start + r].copy_(a.T)
                    stack.b[cols.start:cols.start + r].copy_(b.T)
                    stack.targeted.add(slot)
                self._fold(stack)

    def _fold(self, stack: _Stack) -> None:
        """A packed (CPU fp32) layer that some slot adapts gets ``[W; A_catᵀ]`` packed as
        its weight: one oneDNN GEMM gives the base output and ``x @ A_cat``, and only the
        ``addmm_`` of B is left (measured 1.13-1.17x on 32 mixed clients, base-only steps
        0.99-1.03x: docs/adapters.md). Re-packed after every write of a slot; a layer no
        slot adapts gets its plain packed weight back. Once compiled steps exist, a layer
        keeps the fold it has (``freeze_folds``)."""
        mod = stack.module
        key = packed_key(mod)
        if key is None or (self.folds_frozen and stack.folded is None):
            return  # not packed, or left unfolded: the hook adds its LoRA term
        out = mod.weight.shape[0]
        w = base_weight(key, out)
        if not stack.targeted and not self.folds_frozen:
            set_packed(key, w, mod.bias)
            mod.__dict__["forward"] = mod.__dict__["_genserve_forward"]
            mod.__dict__.pop(FOLDED, None)
            stack.folded = None
            return
        width = self.slots * self.rank
        bias = None if mod.bias is None else torch.cat([mod.bias, mod.bias.new_zeros(width)])
        set_packed(key, torch.cat([w, stack.a.T]), bias)
        if stack.folded is None:
            stack.folded = partial(_folded_forward, self, stack, key, out)
        mod.__dict__["forward"] = stack.folded
        mod.__dict__[FOLDED] = True

    def freeze_folds(self) -> None:
        """Compiled steps are about to be built: from now on a layer stays folded or
        unfolded as it is, whatever the slots hold. A graph bakes in each layer's forward
        and its packed weight's width, and runs without re-checking them, so folding a
        layer afterwards broke its shape check (an adapter loaded after the compile: found
        by a soak), and a fold during the trace broke the trace. A folded layer no slot
        adapts any more adds zero columns; an unfolded one gets its LoRA term from the
        hook, as before folding existed."""
        self.folds_frozen = True

    # ---- steps -----------------------------------------------------------------------

    def mask_for(self, slots: Sequence[int]) -> torch.Tensor:
        """``[len(slots), S * R]``: ones over each row's slot's columns (none for slot 0,
        the base model)."""
        idx = torch.tensor(slots, dtype=torch.long)
        mask = F.one_hot(idx, self.slots + 1)[:, 1:].repeat_interleave(self.rank, dim=1)
        return mask.to(self.device, self.dtype, non_blocking=True)

    @contextmanager
    def step(self, slots: Sequence[int]) -> Iterator[None]:
        """An eager forward whose token ``i`` runs adapter slot ``slots[i]``; a step of
        base rows only adds nothing (the hooks return at once)."""
        if not any(slots):
            yield
            return
        self.current.mask = self.mask_for(slots)
        try:
            yield
        finally:
            self.current.mask = None

    def reserve_static(self, rows: int) -> None:
        """Size the compiled steps' mask for up to ``rows`` tokens; call before building
        any graph (they keep the tensor they were built with)."""
        if rows > self.static_mask.shape[0]:
            self.static_mask = torch.zeros(rows, self.slots * self.rank, dtype=self.dtype,
                                           device=self.device)

    def fill_static(self, slots: Sequence[int]) -> None:
        """The compiled step's mask rows for ``slots`` (padding rows are slot 0)."""
        n = len(slots)
        if any(slots):
            self.static_mask[:n].copy_(self.mask_for(slots))
        else:
            self.static_mask[:n].zero_()

    @contextmanager
    def capturing(self, rows: int) -> Iterator[None]:
        """A CUDA graph being captured: every hooked layer runs, reading the static mask
        (its first ``rows`` rows), so replays apply whatever ``fill_static`` wrote."""
        self.current.mask, self.current.always = self.static_mask[:rows], True
        try:
            yield
        finally:
            self.current.mask, self.current.always = None, False


# Set on a layer while its forward is the folded one; packing or unpacking the layer
# (packed_linear) replaces its forward and drops the flag.
FOLDED = "_genserve_lora_folded"


def _folded_forward(lora: LoraLayers, stack: _Stack, key: int, out_features: int,
                    x: torch.Tensor) -> torch.Tensor:
    """A folded layer's forward: base output and ``x @ A_cat`` from one packed GEMM."""
    width = lora.slots * lora.rank
    full = call_packed(key, out_features + width, x)
    out = full[..., :out_features]
    mask = (lora.static_mask[:x.shape[-2]] if torch.compiler.is_dynamo_compiling()
            else lora.current.mask)
    if mask is not None:
        xa = full[..., out_features:].reshape(-1, width)
        out.view(-1, out_features).addmm_(xa * mask, stack.b)
    return out


def _apply(lora: LoraLayers, stack: _Stack, module: nn.Module, args: tuple[Any, ...],
           out: torch.Tensor) -> torch.Tensor | None:
    if module.__dict__.get(FOLDED, False):  # (a flag: dynamo cannot trace ``is`` on partials)
        return None  # the folded forward added the LoRA term
    x = args[0]  # [1, T, in]: the packed step
    mask: torch.Tensor | None
    # The compiled decode step (dynamo tracing): always in the graph. Not
    # ``is_compiling()``: a process-wide flag, so eager steps on the engine thread read it
    # True while the step compiles in the background and ran the static mask (base output
    # for adapter rows, ~15 s after SERVING: found by a soak).
    if torch.compiler.is_dynamo_compiling():
        mask = lora.static_mask[:x.shape[-2]]
    else:
        mask = lora.current.mask
        if mask is None or not (stack.targeted or lora.current.always):
            return None
    flat = out.view(-1, out.shape[-1])
    flat.addmm_((x.view(-1, x.shape[-1]) @ stack.a).mul_(mask), stack.b)
    return out
