"""LoRA adapters on llama.cpp: GGUF LoRA files loaded as they are, PEFT adapters written
as llama.cpp adapter GGUFs first, into numbered slots, and the one a step runs set on the
context.

A GGUF adapter (read and checked in itself by ``engine.gguf_adapter``) goes to
``llama_adapter_lora_init`` once its architecture is the model's; llama.cpp checks that
every tensor is one of the model's and fits its shape (a NULL adapter otherwise, its log
line becoming the ``AdapterError``'s reason).

Why a conversion: llama.cpp loads LoRA only from a GGUF (``general.type = adapter``,
``adapter.type = lora``, tensors ``<base tensor>.lora_a`` / ``.lora_b``), while adapters
come as PEFT directories (read and checked by ``engine.adapters``). The conversion follows
llama.cpp's ``convert_lora_to_gguf.py``:

- a PEFT module name maps to the base GGUF's tensor name through gguf-py's name map of the
  model's architecture (``model.layers.3.self_attn.q_proj`` -> ``blk.3.attn_q.weight``);
- ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` are written as they are (ggml's
  ``ne`` order reverses them to the base weight's ``[in, out]``), except that a model
  llama.cpp runs with interleaved ("normal") RoPE had the rows of its q/k weights permuted
  by the base converter, so ``lora_B`` of q/k gets the same row permutation;
- PEFT's scaling is already folded into ``lora_B`` (``LoraWeights.b``), and
  ``adapter.lora.alpha`` is 0, which llama.cpp reads as "scale 1".

What llama.cpp checks at load (a tensor the base model lacks, a shape that does not fit)
is checked first against the model file's tensors (``AdapterSlots.check``: a request is
refused before it waits for a slot), and anything llama.cpp still refuses comes back as
its error text in an ``AdapterError``; what it cannot check (a PEFT module with no GGUF
name) is refused before.

Why steps run one adapter: llama.cpp applies adapters per context (``llama_set_adapters_lora``
sets the context's one list, which every token of the next ``llama_decode`` runs through),
not per sequence; so the scheduler gives this runner steps whose rows share one adapter
slot (``Runner.supports_mixed_adapters``), and ``AdapterSlots.activate`` sets that slot's
adapter before the step's decode. A sequence's KV cells keep what its own adapter computed:
llama.cpp never clears or recomputes the cache when adapters change.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.adapters import AdapterError, LoraAdapter


@dataclass(frozen=True)
class BaseModel:
    """What the conversion needs of the loaded GGUF."""

    arch: str  # general.architecture
    n_layer: int
    n_head: int
    n_head_kv: int
    permuted_qk: bool  # llama.cpp runs it with interleaved RoPE: q/k rows were permuted


def tensor_names(adapter: LoraAdapter, base: BaseModel) -> dict[str, str]:
    """Each adapted module's base tensor in the GGUF ("blk.0.attn_q.weight")."""
    import gguf

    arch = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}.get(base.arch)
    if arch is None:
        raise AdapterError(adapter.adapter_id, f"the llamacpp runner has no tensor names for "
                           f"architecture {base.arch!r}")
    names = gguf.get_tensor_name_map(arch, base.n_layer)
    out = {}
    for module in sorted(adapter.weights):
        name = names.get_name(module)
        if name is None:
            raise AdapterError(adapter.adapter_id, f"target module {module!r} is not in this "
                               f"{base.arch} model ({base.n_layer} layers)")
        out[module] = name + ".weight"
    return out


def adapter_tensors(adapter: LoraAdapter, base: BaseModel) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 data of each ``lora_a`` / ``lora_b``."""
    out: dict[str, np.ndarray] = {}
    for module, name in tensor_names(adapter, base).items():
        w = adapter.weights[module]
        a, b = w.a.numpy(), w.b.numpy()
        if base.permuted_qk and module.endswith(("q_proj", "k_proj")):
            heads = base.n_head if module.endswith("q_proj") else base.n_head_kv
            if b.shape[0] % (2 * heads):
                raise AdapterError(adapter.adapter_id, f"module {module!r}: lora_B has "
                                   f"{b.shape[0]} rows, not {heads} heads of even size")
            b = _permute_for_rope(b, heads)
        out[name + ".lora_a"] = np.ascontiguousarray(a, dtype=np.float32)
        out[name + ".lora_b"] = np.ascontiguousarray(b, dtype=np.float32)
    return out


def _permute_for_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from HF's rotate-half order to llama.cpp's interleaved pairs (the
    base converter's ``LlamaModel.permute``)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_adapter_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 0.0)  # PEFT's scaling is in lora_b
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class AdapterSlots:
    """The llama.cpp adapters of a model by slot, and which one its context runs.

    ``load`` runs on the registry's thread while steps run on the engine's: it only adds
    an adapter; the one it replaces is freed by the engine thread once the context no
    longer has it set (``activate``). Loading and freeing both change the model's own set
    of adapters (freeing the model frees what it still holds), hence one lock for them."""

    def __init__(self, llama_cpp: Any, model: Any, ctx: Any, base: BaseModel,
                 model_file: str | None = None) -> None:
        self.lc = llama_cpp
        self.model = model
        self.ctx = ctx
        self.base = base
        self.model_file = model_file  # the GGUF llama.cpp runs: its tensors' shapes
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self._lock = threading.Lock()  # the slot table
        self._model_lock = threading.Lock()  # the model's adapter set: init and free
        self._by_slot: dict[int, Any] = {}
        self._retired: list[Any] = []
        self._active: Any = None  # the adapter set on the context (None: the base model)

    def check(self, adapter: LoraAdapter) -> None:
        """``AdapterError`` unless every tensor of ``adapter`` adapts one of the model's and
        fits its shape: what ``llama_adapter_lora_init`` checks (src/llama-adapter.cpp),
        found without loading it (before a request waits for a slot)."""
        aid = adapter.adapter_id
        if adapter.gguf is not None:
            if adapter.gguf.architecture != self.base.arch:
                raise AdapterError(aid, f"{adapter.gguf.file.name} is an adapter of a "
                                   f"{adapter.gguf.architecture} model, not of this "
                                   f"{self.base.arch} model (general.architecture)")
            shapes, what = adapter.gguf.shapes, {}
        else:
            names = tensor_names(adapter, self.base)
            # PEFT lora_A [r, in], lora_B [out, r]: ggml order reverses each
            shapes = {names[m]: (tuple(w.a.shape[::-1]), tuple(w.b.shape[::-1]))
                      for m, w in adapter.weights.items()}
            what = {name: f" (module {m!r})" for m, name in names.items()}
        base = self._base_shapes()
        if base is None:
            return  # the model's file cannot be read here: llama.cpp checks at load
        for name, (a, b) in sorted(shapes.items()):
            ne = base.get(name)
            if ne is None:
                raise AdapterError(aid, f"tensor {name!r}{what.get(name, '')} is not in this "
                                   f"{self.base.arch} model ({self.base.n_layer} layers)")
            if name.startswith("token_embd"):  # A and B flipped (llama.cpp's get_rows)
                fits = ne[0] == b[1] and ne[1] == a[1]
            else:
                fits = ne[0] == a[0] and ne[1] == b[1]
            if not fits:
                raise AdapterError(aid, f"tensor {name!r}{what.get(name, '')}: lora_a "
                                   f"{list(a)} / lora_b {list(b)} do not fit the model's "
                                   f"{list(ne[:2])} (ggml order)")

    def _base_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """The model file's tensor shapes (ggml order), read once (None: unreadable here;
        llama.cpp's own load still checks)."""
        if self._shapes is None and self.model_file is not None:
            try:
                self._shapes = gguf_tensor_shapes(self.model_file)
            except (OSError, ValueError, struct.error):
                self.model_file = None
        return self._shapes

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        self.check(adapter)
        if adapter.gguf is not None:
            ptr = self._init(adapter, adapter.gguf.file, {})
        else:
            tensors = adapter_tensors(adapter, self.base)
            fd, tmp = tempfile.mkstemp(prefix="genserve-lora-", suffix=".gguf")
            os.close(fd)
            try:
                write_adapter_gguf(Path(tmp), self.base.arch, tensors)
                ptr = self._init(adapter, Path(tmp), {
                    name: m for m, name in tensor_names(adapter, self.base).items()})
            finally:
                os.unlink(tmp)  # llama.cpp copied the tensors into its own buffers
        with self._lock:
            old = self._by_slot.get(slot)
            self._by_slot[slot] = ptr
            if old is not None:
                self._retired.append(old)

    def _init(self, adapter: LoraAdapter, file: Path, modules: dict[str, str]) -> Any:
        """llama.cpp's adapter of ``file`` (its tensors copied into llama.cpp's buffers);
        ``AdapterError`` with llama.cpp's reason when it refuses (``modules``: GGUF tensor
        -> PEFT module, to name them)."""
        from engine.runners.llamacpp import llama_errors

        with self._model_lock, llama_errors(self.lc) as errors:
            ptr = self.lc.llama_adapter_lora_init(self.model, str(file).encode())
        if not ptr:
            raise AdapterError(adapter.adapter_id, _reason(errors, modules))
        return ptr

    def activate(self, slot: int) -> None:
        """Set ``slot``'s adapter on the context (0: none), on the engine thread, before
        the step's ``llama_decode``; then free the adapters slots no longer hold."""
        with self._lock:
            ptr = self._by_slot[slot] if slot else None
            retired, self._retired = self._retired, []
        if ptr is not self._active:
            if ptr is None:
                rc = self.lc.llama_set_adapters_lora(self.ctx, None, 0, None)
            else:
                rc = self.lc.llama_set_adapters_lora(
                    self.ctx, (self.lc.llama_adapter_lora_p_ctypes * 1)(ptr), 1,
                    (ctypes.c_float * 1)(1.0))
            if rc != 0:
                raise RuntimeError(f"llama_set_adapters_lora failed ({rc}) for slot {slot}")
            self._active = ptr
        if retired:
            with self._model_lock:
                for old in retired:
                    self.lc.llama_adapter_lora_free(old)

    def free(self) -> None:
        """Free every adapter before the model (freeing the model frees those it still
        holds: freeing one after it would free it twice)."""
        with self._lock:
            held = [*self._by_slot.values(), *self._retired]
            self._by_slot, self._retired = {}, []
        with self._model_lock:
            for ptr in held:
                self.lc.llama_adapter_lora_free(ptr)


# GGUF metadata value types (gguf-py's GGUFValueType) -> size in bytes; 8 string, 9 array
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape (ggml order) from a GGUF file's header, skipping its metadata.

    Why not ``gguf.GGUFReader``: it builds a numpy view of every vocabulary string (~160
    MB for the default model's 49k tokens, ``engine.loading.gguf_reader``); this walks the
    same layout (GGUF v2/v3, little-endian: magic, version, tensor count, metadata count,
    the metadata, then each tensor's name, dims, type and offset). The default model's 272
    shapes: 0.04 s against 5.6 s (2-core AVX2 EPYC, 2026-11-28), the same shapes.
    ValueError for anything else."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version}")
        at = 24

        def skip(kind: int, at: int) -> int:
            if kind in _SCALAR_SIZES:
                return at + _SCALAR_SIZES[kind]
            if kind == 8:
                return at + 8 + struct.unpack_from("<Q", m, at)[0]
            if kind == 9:
                elem, count = struct.unpack_from("<IQ", m, at)
                at += 12
                if elem in _SCALAR_SIZES:
                    return at + count * _SCALAR_SIZES[elem]
                for _ in range(count):
                    at = skip(elem, at)
                return at
            raise ValueError(f"{path}: metadata value type {kind}")

        for _ in range(n_kv):
            at += 8 + struct.unpack_from("<Q", m, at)[0]  # the key
            at = skip(struct.unpack_from("<I", m, at)[0], at + 4)
        shapes = {}
        for _ in range(n_tensors):
            length = struct.unpack_from("<Q", m, at)[0]
            name = bytes(m[at + 8:at + 8 + length]).decode()
            at += 8 + length
            n_dims = struct.unpack_from("<I", m, at)[0]
            shapes[name] = struct.unpack_from(f"<{n_dims}Q", m, at + 4)
            at += 4 + 8 * n_dims + 4 + 8  # dims, type, offset
        return shapes


def _reason(errors: list[str], modules: dict[str, str]) -> str:
    """llama.cpp's error without its prefix ("llama_adapter_lora_init_impl: failed to
    apply lora adapter: tensor 'blk.0.attn_q.weight' has incorrect shape ..."), each GGUF
    tensor it names followed by the PEFT module (``modules``: GGUF name -> module)."""
    line = next((e for e in reversed(errors) if "lora" in e), errors[-1] if errors else "")
    reason = line.split(": ", 2)[-1] or "no reason given"
    for name, module in modules.items():
        reason = reason.replace(f"'{name}'", f"'{name}' (module '{module}')")
    return "llama.cpp refused it: " + reason
