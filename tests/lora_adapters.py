"""Tiny random PEFT LoRA adapters for the tiny test model, and transformers references
with the LoRA merged into the weights (peft is a test dependency only)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# Two adapters over different layers and ranks (a2 with rslora scaling), so a mixed batch
# exercises slots that target different modules.
ADAPTERS = {
    "a1": dict(seed=1, targets=["q_proj", "v_proj", "down_proj"], rank=4),
    "a2": dict(seed=2, targets=["k_proj", "o_proj", "gate_proj", "up_proj"], rank=8,
               rslora=True),
}


def save_lora(model_dir: Path, directory: Path, *, seed: int, targets: list[str],
              rank: int = 4, rslora: bool = False) -> Path:
    """A PEFT LoRA adapter of ``model_dir`` with random A and B (B is zero in a fresh
    adapter: it would change nothing), saved to ``directory``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                 target_modules=targets, use_rslora=rslora,
                                                 init_lora_weights=False))
    peft_model.save_pretrained(directory)
    return directory


def merged_model(model_dir: Path, adapter_dir: Path | None):
    """transformers' model with the adapter merged into its weights (None: the base)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()


def hf_greedy(model, ids: list[int], new: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False)
    return out[0, len(ids):].tolist()


def write_gguf_lora(path: Path, tensors: dict, *, arch: str = "llama",
                    general_type: str = "adapter", adapter_type: str = "lora",
                    alpha: float | None = 0.0, extra: dict | None = None) -> Path:
    """A llama.cpp LoRA GGUF as ``convert_lora_to_gguf.py`` writes one (``tensors``: GGUF
    name -> numpy array, e.g. "blk.0.attn_q.weight.lora_a" [r, in]); the keyword arguments
    make it wrong on purpose. ``extra``: more keys, name -> (value, GGUFValueType, the
    element type of an array or None)."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(general_type)
    w.add_string(gguf.Keys.Adapter.TYPE, adapter_type)
    if alpha is not None:
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for key, (value, vtype, sub) in (extra or {}).items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_lora_of(cache: Path, src: str, base, path: Path, dtype: type = np.float32) -> Path:
    """The PEFT adapter ``src`` of ``cache`` as a llama.cpp LoRA GGUF at ``path``, through
    the project's PEFT -> GGUF conversion for the model ``base``
    (``engine.runners.llamacpp_lora.BaseModel``), lora_b unscaled and the scaling given as
    ``adapter.lora.alpha`` (llama.cpp multiplies by alpha / rank), as llama.cpp's
    ``convert_lora_to_gguf.py`` writes it (its default outtype is f16)."""
    from engine.adapters import read_adapter
    from engine.runners.llamacpp_lora import adapter_tensors

    adapter = read_adapter(cache, src, 64)
    tensors = adapter_tensors(adapter, base)
    for name in tensors:
        if name.endswith(".lora_b"):
            tensors[name] = tensors[name] / np.float32(adapter.scaling)
    return write_gguf_lora(path, {n: t.astype(dtype) for n, t in tensors.items()},
                           arch=base.arch, alpha=adapter.scaling * adapter.rank)


def tiny_llama_base():
    """The tiny test model (tests/conftest.py) as the GGUF conversion sees it."""
    from engine.runners.llamacpp_lora import BaseModel

    return BaseModel("llama", n_layer=2, n_head=4, n_head_kv=2, permuted_qk=True)
