"""A LoRA adapter given as a GGUF file, as llama.cpp's ``convert_lora_to_gguf.py`` writes it:
read and checked here, loaded by llama.cpp itself (``llama_adapter_lora_init``) or read
back into PEFT's layout by the torch runner (``engine/runners/torch/gguf_lora.py``).

Why check before llama.cpp: its loader aborts the process (a ``GGML_ASSERT``) when a
metadata key it reads has another type than it expects, and ignores tensors that are not
LoRA pairs; and its errors ("model arch and LoRA arch mismatch") do not say what the
adapter is. So the metadata keys llama.cpp reads are checked for type, the tensors for
pairs, and rank and alpha are read here; what only the model can tell (the architecture,
the tensors' shapes) is checked by the runner (``engine/runners/llamacpp_lora.py``).

The format: ``general.type = "adapter"``, ``adapter.type = "lora"``,
``general.architecture`` the base model's, ``adapter.lora.alpha`` (0 or absent: scale 1,
else ``alpha / rank`` per tensor pair), tensors ``<base tensor>.lora_a`` (ggml shape
``[in, r]``, ``[r, n_vocab]`` for ``token_embd``) and ``<base tensor>.lora_b`` (``[r, out]``).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

from engine.adapters import AdapterError, GgufLora, LoraAdapter

# The metadata llama.cpp's adapter loader reads with typed getters, and their types
_STRING_KEYS = ("general.type", "general.architecture", "adapter.type",
                "adapter.lora.task_name", "adapter.lora.prompt_prefix")
ALPHA_KEY = "adapter.lora.alpha"
ALORA_KEY = "adapter.alora.invocation_tokens"
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0")  # what convert_lora_to_gguf.py writes


def read_gguf_adapter(adapter_id: str, file: Path, max_rank: int) -> LoraAdapter:
    """The GGUF LoRA adapter ``file`` of ``adapter_id``, checked in itself (not yet against
    a model): ``AdapterError`` naming what is wrong."""
    import gguf

    name = file.name
    try:
        reader = gguf.GGUFReader(file)
    except Exception as e:  # gguf-py raises many kinds on a malformed file
        raise AdapterError(adapter_id, f"{name} is not a readable GGUF file: {e}") from None
    fields = reader.fields
    for key in _STRING_KEYS:
        if key in fields and fields[key].types != [gguf.GGUFValueType.STRING]:
            raise AdapterError(adapter_id, f"{name}: metadata {key} is not a string")
    if ALPHA_KEY in fields and fields[ALPHA_KEY].types != [gguf.GGUFValueType.FLOAT32]:
        raise AdapterError(adapter_id, f"{name}: metadata {ALPHA_KEY} is not a float32")
    kind = _text(fields, "general.type")
    if kind != "adapter":
        raise AdapterError(adapter_id, f"{name} is not a LoRA adapter GGUF (general.type is "
                           f"{kind!r}, not 'adapter')")
    adapter_type = _text(fields, "adapter.type")
    if adapter_type != "lora":
        raise AdapterError(adapter_id, f"{name}: adapter.type {adapter_type!r} is not "
                           f"supported (only 'lora')")
    architecture = _text(fields, "general.architecture")
    if not architecture:
        raise AdapterError(adapter_id, f"{name} has no general.architecture")
    if ALORA_KEY in fields:
        raise AdapterError(adapter_id, f"{name}: aLoRA ({ALORA_KEY}) is not supported")
    alpha = float(fields[ALPHA_KEY].contents()) if ALPHA_KEY in fields else 0.0
    if not math.isfinite(alpha):
        raise AdapterError(adapter_id, f"{name}: {ALPHA_KEY} is {alpha}")
    for t in reader.tensors:  # llama.cpp's matmuls abort on others (integer, f64)
        if t.tensor_type.name not in TENSOR_TYPES:
            raise AdapterError(adapter_id, f"{name}: tensor {t.name!r} is of type "
                               f"{t.tensor_type.name} (LoRA tensors are "
                               f"{', '.join(TENSOR_TYPES)})")
    shapes = _pair_shapes(adapter_id, name, reader.tensors)
    ranks = {base: _rank(base, a) for base, (a, _) in shapes.items()}
    base, rank = max(ranks.items(), key=lambda item: item[1])
    if rank > max_rank:
        raise AdapterError(adapter_id, f"rank {rank} ({base}) exceeds the server's limit "
                           f"{max_rank} (--max-lora-rank)")
    with file.open("rb") as f:
        fingerprint = hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).digest()
    targets = sorted({tensor.removesuffix(".weight").split(".")[-1] for tensor in ranks})
    return LoraAdapter(adapter_id, file.parent, rank, alpha,
                       alpha / rank if alpha else 1.0, targets, {}, fingerprint,
                       gguf=GgufLora(file, architecture, shapes))


def _text(fields: dict[str, Any], key: str) -> str | None:
    return str(fields[key].contents()) if key in fields else None


def _pair_shapes(adapter_id: str, name: str, tensors: list[Any]
                 ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each adapted base tensor's ``lora_a`` / ``lora_b`` shapes (ggml order), every tensor
    being one of a complete pair of one rank."""
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for t in tensors:
        base, _, part = t.name.rpartition(".")
        if part not in ("lora_a", "lora_b") or not base:
            raise AdapterError(adapter_id, f"{name}: tensor {t.name!r} is not a LoRA tensor "
                               f"(<base tensor>.lora_a / .lora_b)")
        pairs.setdefault(base, {})[part] = tuple(int(n) for n in t.shape)
    if not pairs:
        raise AdapterError(adapter_id, f"{name} holds no LoRA tensors")
    shapes = {}
    for base, ab in sorted(pairs.items()):
        if len(ab) != 2:
            raise AdapterError(adapter_id, f"{name}: {base}.{set(ab).pop()} has no pair")
        a, b = ab["lora_a"], ab["lora_b"]
        if len(a) < 2 or len(b) < 2:
            raise AdapterError(adapter_id, f"{name}: {base}: lora_a {list(a)} / lora_b "
                               f"{list(b)} are not matrices")
        rank_a = _rank(base, a)
        if rank_a != b[0] or rank_a < 1:
            raise AdapterError(adapter_id, f"{name}: {base}: lora_a {list(a)} and lora_b "
                               f"{list(b)} do not share a rank")
        shapes[base] = (a, b)
    return shapes


def _rank(base: str, lora_a: tuple[int, ...]) -> int:
    """ggml order: lora_a [in, r] (token_embd: [r, n_vocab]), lora_b [r, out]."""
    return lora_a[0] if base.startswith("token_embd") else lora_a[1]
