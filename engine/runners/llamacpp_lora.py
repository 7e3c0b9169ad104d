"""PEFT LoRA adapters as llama.cpp adapter GGUFs: converted once, then loaded by llama.cpp.

Why: llama.cpp loads LoRA only from a GGUF (``general.type = adapter``, ``adapter.type =
lora``, tensors ``<base tensor>.lora_a`` / ``.lora_b``), while adapters come as PEFT
directories. The conversion follows llama.cpp's ``convert_lora_to_gguf.py``:

- a PEFT module name maps to the base GGUF's tensor name through gguf-py's name map of the
  model's architecture (``model.layers.3.self_attn.q_proj`` -> ``blk.3.attn_q.weight``);
- ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` are written as they are (ggml's
  ``ne`` order reverses them to the base weight's ``[in, out]``), except that on an
  architecture llama.cpp runs with interleaved ("normal") RoPE the base converter permuted
  the rows of q/k, so ``lora_B`` of q/k gets the same row permutation;
- PEFT's per-module scaling (``lora_alpha / r``, rsLoRA's ``/ sqrt(r)``, rank and alpha
  patterns) is folded into ``lora_B`` and ``adapter.lora.alpha`` is 0, which llama.cpp
  reads as "scale 1": every module then scales exactly as PEFT does.

What llama.cpp itself checks at load (a tensor the base model lacks, a shape that does not
fit, an architecture mismatch) comes back as its error text; what it cannot check (a PEFT
module without a GGUF name, a rank mismatch between A and B, a DoRA or biased adapter)
is refused here. Both raise ``AdapterError`` naming the adapter and the reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the written file changes: cached conversions are then redone
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter this model cannot run; the message names the adapter and why."""


@dataclass(frozen=True)
class BaseModel:
    """What the conversion needs of the loaded GGUF."""

    arch: str  # general.architecture
    n_layer: int
    n_head: int
    n_head_kv: int
    permuted_qk: bool  # llama.cpp runs it with interleaved RoPE: q/k rows were permuted


def adapter_gguf(adapter_id: str, directory: Path, base: BaseModel, cache_dir: Path) -> Path:
    """The llama.cpp adapter GGUF of the adapter in ``directory``: a ``.gguf`` it holds,
    else its PEFT files converted (once: the result is kept in ``cache_dir`` under a key of
    the files' contents and the base model)."""
    ggufs = sorted(directory.glob("*.gguf"))
    if ggufs:
        if len(ggufs) > 1:
            raise AdapterError(f"adapter {adapter_id!r}: {len(ggufs)} .gguf files in "
                               f"{directory}; expected one")
        return ggufs[0]
    config_path, weights_path = directory / PEFT_CONFIG, directory / PEFT_WEIGHTS
    try:
        config_bytes = config_path.read_bytes()
        weights_bytes = weights_path.read_bytes()
    except OSError as e:
        raise AdapterError(f"adapter {adapter_id!r}: cannot read {e.filename}: "
                           f"{e.strerror}") from e
    key = hashlib.sha256(f"{FORMAT}|{base}|".encode() + config_bytes + b"|" + weights_bytes)
    out = cache_dir / f"lora-{key.hexdigest()[:32]}.gguf"
    if out.is_file():
        return out
    tensors = convert(adapter_id, _json(adapter_id, config_bytes), _safetensors(
        adapter_id, weights_bytes), base)
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".tmp-lora-", suffix=".gguf")
    os.close(fd)
    try:
        write_gguf(Path(tmp), base.arch, tensors)
        os.replace(tmp, out)  # atomic: a crash never leaves a half file under the name
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _json(adapter_id: str, data: bytes) -> dict[str, Any]:
    try:
        config = json.loads(data)
    except ValueError as e:
        raise AdapterError(f"adapter {adapter_id!r}: {PEFT_CONFIG} is not JSON: {e}") from e
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {adapter_id!r}: {PEFT_CONFIG} is not a JSON object")
    return config


def _safetensors(adapter_id: str, data: bytes) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return {k: v.float().numpy() for k, v in load(data).items()}
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise AdapterError(f"adapter {adapter_id!r}: {PEFT_WEIGHTS} is unreadable: "
                           f"{e}") from e


def convert(adapter_id: str, config: dict[str, Any], weights: dict[str, np.ndarray],
            base: BaseModel) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 data of the adapter's ``lora_a`` / ``lora_b`` pairs."""
    import gguf

    def refuse(reason: str) -> AdapterError:
        return AdapterError(f"adapter {adapter_id!r}: {reason}")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"PEFT type {config.get('peft_type')!r} is not supported (LORA only)")
    if config.get("use_dora"):
        raise refuse("DoRA (use_dora) is not supported by the llama.cpp runner")
    arch = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}.get(base.arch)
    if arch is None:
        raise refuse(f"gguf-py has no tensor names for architecture {base.arch!r}")
    names = gguf.get_tensor_name_map(arch, base.n_layer)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in weights.items():
        if key.endswith(".base_layer.weight"):
            continue  # a copy of a base weight PEFT saves beside an lm_head/embedding LoRA
        module, _, part = key.removeprefix(_PREFIX).rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise refuse(f"tensor {key!r} is not a LoRA A/B weight (biases, embedding "
                         "LoRA and modules_to_save are not supported by the llama.cpp "
                         "runner)")
        pairs.setdefault(module, {})[part[0]] = value
    if not pairs:
        raise refuse(f"{PEFT_WEIGHTS} holds no LoRA weights")
    out: dict[str, np.ndarray] = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise refuse(f"module {module!r} has lora_{next(iter(ab))} without its pair")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise refuse(f"module {module!r}: lora_A {list(a.shape)} and lora_B "
                         f"{list(b.shape)} are not a rank-r pair")
        name = names.get_name(module)
        if name is None:
            raise refuse(f"target module {module!r} is not a weight of this "
                         f"{base.arch} model")
        b = b * _scaling(config, module, a.shape[0])
        if base.permuted_qk and module.endswith(("q_proj", "k_proj")):
            heads = base.n_head if module.endswith("q_proj") else base.n_head_kv
            if b.shape[0] % (2 * heads):
                raise refuse(f"module {module!r}: lora_B has {b.shape[0]} rows, not a "
                             f"multiple of {heads} heads")
            b = _permute_for_rope(b, heads)
        out[name + ".weight.lora_a"] = np.ascontiguousarray(a, dtype=np.float32)
        out[name + ".weight.lora_b"] = np.ascontiguousarray(b, dtype=np.float32)
    return out


def _scaling(config: dict[str, Any], module: str, rank: int) -> float:
    """PEFT's scaling of ``module``: its alpha (``alpha_pattern`` or ``lora_alpha``) over
    its rank, or over the rank's square root with rsLoRA."""
    from peft.utils.other import get_pattern_key

    alpha_pattern = config.get("alpha_pattern") or {}
    key = get_pattern_key(list(alpha_pattern), module)
    alpha = float(alpha_pattern.get(key, config.get("lora_alpha", 8)))
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _permute_for_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from HF's rotate-half order to llama.cpp's interleaved pairs (the
    base converter's ``LlamaModel.permute``)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 0.0)  # scaling folded into lora_b
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
