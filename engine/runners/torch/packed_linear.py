"""fp32 linear layers on CPU with weights packed once, at load: by the runner's own kernel
(native_gemm.py) where it builds (x86 with AVX2/FMA), else by oneDNN.

``F.linear`` hands each call to MKL's sgemm, which repacks the weight on every call and
handles a few rows badly: measured on this 2-core CPU (SmolLM2-135M shapes, weights not in
cache), the model's matmuls took 52 ms for 1 row, 85 ms for 2 and 104 ms for 9. With the
weights reordered once into oneDNN's blocked layout they took 37, 40 and 52 ms: a decode
step of one sequence is faster, and the 1 + k rows of a speculative verify step, or a batch
of decodes, cost little more than one row. The results differ from ``F.linear`` only in
summation order (about 1e-5 relative). Both packed products give a row the same bits
whatever the other rows (the runner's batch invariance rests on it); the native kernel also
reads the weights at memory speed for one row, where oneDNN used ~one core's bandwidth.

A packed layer's plain weight is replaced by a zero-stride placeholder of the same shape
(so the memory is not held twice), except where the weight is shared with another module
(a tied input embedding still reads it). Fused sibling projections (fused_linear.py: q/k/v,
gate/up) are packed as their group's one layer, whose one GEMM replaces the members' (the
members' weights become rows of the group's placeholder). ``unpack_linears`` restores
every layer exactly (the benchmark measures stock transformers on the same model object).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from engine.runners.torch import native_gemm
from engine.runners.torch.attention import ATTN_NAME
from engine.runners.torch.fused_linear import (
    fuse_siblings,
    fused_groups,
    is_fused,
    is_member,
    unfuse_siblings,
)

log = logging.getLogger(__name__)

# oneDNN's reorder takes the expected row count as a hint; 64 measured well from 1 row to
# a batch of decodes (1, 2, 9 and 17 rows).
ROWS_HINT = 64


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Packing pays on CPU in fp32 where torch has oneDNN; CUDA runs cuBLAS as is."""
    return (device.type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available())


# GENSERVE_QUANTIZED_PANELS=0 keeps every native layer in fp32 panels (for comparison).
QUANTIZED_ENV = "GENSERVE_QUANTIZED_PANELS"


@dataclass
class PackedLayer:
    weight: torch.Tensor  # oneDNN's opaque tensor, the native panels, or their quantised ints
    bias: torch.Tensor | None
    width: int  # output features (a LoRA fold's extra rows included)
    scales: torch.Tensor | None = None  # quantised panels' block scales
    bits: int = 32  # 4 or 8 for quantised panels

    @property
    def onednn(self) -> bool:
        """Packed for oneDNN: an opaque tensor no compiled graph or native step can read."""
        return self.weight.is_mkldnn

    def dense(self) -> torch.Tensor:
        """The weight as ``[width, in]``."""
        if self.onednn:
            return self.weight.to_dense()
        if self.scales is not None:
            return native_gemm.dequantize(self.weight, self.scales, self.bits, self.width)
        return native_gemm.unpack(self.weight, self.width)

    def nbytes(self) -> int:
        if self.onednn:  # an opaque tensor: its dense size
            return self.weight.numel() * 4
        extra = self.scales.nbytes if self.scales is not None else 0
        return self.weight.nbytes + extra


# Packed layers by key. The compiled decode step (compiled_step.py) cannot trace an
# opaque oneDNN tensor, so under torch.compile a layer calls the custom op below with its
# key: one black-box call per layer in the graph, the compiled code around it.
_LAYERS: dict[int, PackedLayer] = {}
_next_key = 0
_generation = 0  # bumped whenever a layer is packed or unpacked: holders of panels refresh


def generation() -> int:
    """Changes whenever any layer's packed weight does (native_decode.py holds the panels)."""
    return _generation


def _changed() -> None:
    global _generation
    _generation += 1


def _linear(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    layer = _LAYERS[key]
    if layer.scales is not None:
        return native_gemm.linear_quantized(x, layer.weight, layer.scales, layer.bits,
                                            layer.width, layer.bias)
    if layer.onednn:
        return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], "")
    return native_gemm.linear(x, layer.weight, layer.width, layer.bias)


def _pack(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLayer:
    """The native kernel's panels (quantised where the weight is exactly so), else oneDNN's."""
    width = int(weight.shape[0])
    if not native_gemm.available():
        return PackedLayer(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ROWS_HINT),
                           bias, width)
    if os.environ.get(QUANTIZED_ENV, "1") != "0":
        quantized = native_gemm.pack_quantized(weight)
        if quantized is not None:
            q, scales, bits = quantized
            return PackedLayer(q, bias, width, scales, bits)
    return PackedLayer(native_gemm.pack(weight), bias, width)


# ``out_features`` is in the call (not only behind the key) so that a compiled graph's
# cache key (inductor's on-disk FX graph cache) tells apart layers of different widths
# with the same key number: another model's, or another tensor-parallel rank's shard.
packed_linear = torch.library.custom_op("genserve::packed_linear", mutates_args=())(_linear)


@packed_linear.register_fake
def _(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def _packed_forward(key: int, out_features: int, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        layer = _LAYERS[key]
        if layer.onednn:  # an opaque tensor: behind the key
            return torch.ops.genserve.packed_linear(x, key, out_features)
        # The native kernel's panels are plain tensors: the graph takes them as inputs and
        # calls the C++ op itself, without the keyed Python op's ~20 us round trip a layer
        # (a one-row step 12% faster on the default model).
        if layer.scales is not None:
            return torch.ops.genserve_gemm.linear_quantized(
                x, layer.weight, layer.scales, layer.bits, layer.width, layer.bias)
        return torch.ops.genserve_gemm.linear(x, layer.weight, layer.width, layer.bias)
    return _linear(x, key, out_features)


def packed_key(mod: nn.Module) -> int | None:
    """The layer's key while it is packed, else None."""
    key = mod.__dict__.get("_genserve_key")
    return key if key in _LAYERS else None


def base_weight(key: int, out_features: int) -> torch.Tensor:
    """The packed layer's own weight ``[out, in]``, dense (without extra rows a fold added)."""
    return _LAYERS[key].dense()[:out_features]


def set_packed(key: int, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Pack ``weight`` (``[out + extra, in]``) for layer ``key``: LoRA folds its A into the
    layer this way (lora.py), so one GEMM gives the base output and ``x @ A``."""
    _LAYERS[key] = _pack(weight, bias)
    _changed()


def call_packed(key: int, width: int, x: torch.Tensor) -> torch.Tensor:
    """``x`` through layer ``key``'s packed weight, ``width`` output columns."""
    return _packed_forward(key, width, x)


def _layers(model: nn.Module) -> Iterator[nn.Module]:
    """The model's modules, with each fused group's layer (fused_linear.py) in place of
    its members: the group's one product is what runs, so it is what gets packed."""
    for mod in model.modules():
        yield from (group.linear for group in fused_groups(mod))
        if not is_member(mod):
            yield mod


def _point_members(model: nn.Module) -> None:
    """Members of fused groups view their rows of the group's weight as it is now."""
    for mod in model.modules():
        for group in fused_groups(mod):
            group.point_members()


def pack_linears(model: nn.Module) -> int:
    """Pack every ``nn.Linear`` weight of ``model``; returns how many."""
    shared = _shared_weights(model)
    keys: list[int] = []
    dense_bytes = 0
    with torch.no_grad():
        for mod in _layers(model):
            if not isinstance(mod, nn.Linear) or mod.__dict__.get("_genserve_key") in _LAYERS:
                continue
            # A layer keeps its key when packed again, so compiled graphs (which call the
            # op with it) stay valid across unpack/pack (the benchmark's baselines).
            key = mod.__dict__.get("_genserve_key")
            if key is None:
                global _next_key
                key, _next_key = _next_key, _next_key + 1
                mod.__dict__["_genserve_key"] = key
            _LAYERS[key] = _pack(mod.weight.detach(), mod.bias)
            _changed()
            keys.append(key)
            dense_bytes += mod.weight.numel() * 4
            # A plain instance attribute: nn.Module.__call__ finds it before the class's.
            # Packed again, a layer gets the very objects it had (forward, placeholder):
            # compiled graphs guard on their identity.
            mod.__dict__.pop("_genserve_lora_folded", None)  # lora.FOLDED: not folded now
            mod.__dict__["forward"] = mod.__dict__.setdefault(
                "_genserve_forward",
                functools.partial(_packed_forward, key, int(mod.weight.shape[0])))
            if mod.weight.data_ptr() not in shared:
                if "_genserve_placeholder" not in mod.__dict__:
                    placeholder = torch.empty(1, dtype=mod.weight.dtype).expand(
                        mod.weight.shape)
                    mod.__dict__["_genserve_placeholder"] = nn.Parameter(
                        placeholder, requires_grad=False)
                mod.weight = mod.__dict__["_genserve_placeholder"]
        _point_members(model)  # placeholder rows: the dense weight is not held twice
    count = len(keys)
    if count:
        layers = [_LAYERS[k] for k in keys]
        quantized = [layer for layer in layers if layer.scales is not None]
        log.info("packed %d linear layers for %s%s", count,
                 "the native fp32 GEMM" if native_gemm.available() else "oneDNN",
                 f" ({len(quantized)} of them as the exact 4/8-bit blocks their weights "
                 f"were dequantised from, expanded in registers: "
                 f"{sum(x.nbytes() for x in layers) / 2**20:.0f} MiB instead of "
                 f"{dense_bytes / 2**20:.0f})"
                 if quantized else "")
    return count


def unpack_linears(model: nn.Module) -> None:
    """Undo ``pack_linears``: plain ``nn.Linear`` layers with their exact weights."""
    with torch.no_grad():
        for mod in _layers(model):
            key = mod.__dict__.get("_genserve_key")
            if key not in _LAYERS:
                continue
            packed = _LAYERS.pop(key)
            _changed()
            del mod.forward
            mod.__dict__.pop("_genserve_lora_folded", None)  # lora.FOLDED
            if isinstance(mod, nn.Linear) and mod.weight.stride() == (0, 0):
                # [:out]: a layer LoRA folded into holds extra rows (lora.py)
                mod.weight = nn.Parameter(packed.dense()[:mod.weight.shape[0]],
                                          requires_grad=False)
        _point_members(model)


def is_packed(model: nn.Module) -> bool:
    return any(m.__dict__.get("_genserve_key") in _LAYERS for m in model.modules())


def _shared_weights(model: nn.Module) -> set[int]:
    """Data pointers of parameters that more than one module holds (tied embeddings)."""
    seen: dict[int, int] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            seen[p.data_ptr()] = seen.get(p.data_ptr(), 0) + 1
    return {ptr for ptr, n in seen.items() if n > 1}


@contextmanager
def stock_transformers(model: nn.Module) -> Iterator[nn.Module]:
    """The engine's model as stock transformers runs it (SDPA attention, plain
    ``F.linear`` per layer, no fused siblings), for references and baselines that must
    measure transformers itself."""
    packed, fused = is_packed(model), is_fused(model)
    unpack_linears(model)
    unfuse_siblings(model)
    set_attn = cast(Callable[[str], None], model.set_attn_implementation)
    set_attn("sdpa")
    try:
        yield model
    finally:
        set_attn(ATTN_NAME)
        if packed:
            pack_linears(model)
        if fused:
            fuse_siblings(model)
