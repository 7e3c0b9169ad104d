"""Shared fixtures: the default model's tokenizer, and tiny random models built from it.

Unit tests run on a tiny randomly initialised Llama with the real tokenizer (a few layers,
seconds to build); only tests/e2e load the real default model.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def pin_xdist_worker() -> None:
    """Under ``pytest -n N`` (``make test``), give each worker its own share of the cores,
    before torch starts its thread pool: the worker's torch and llama.cpp threads, and the
    servers it spawns, size themselves to that share (``default_threads`` reads the
    affinity) instead of N workers each spinning threads on every core."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= count:
        os.sched_setaffinity(0, cpus[int(worker[2:]) % count::count])


pin_xdist_worker()

import torch  # noqa: E402  (after the pinning: torch sizes its pool at import)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# GENSERVE_SLOW=1: the breadth tier. `make test` (CI) runs every behaviour, on a subset
# where a test repeats one behaviour over many inputs (schemas, random walks); the slow
# tier runs all of them. Only breadth, never a behaviour, may hang on it.
SLOW = bool(os.environ.get("GENSERVE_SLOW"))


@pytest.fixture(scope="session", autouse=True)
def one_parse_per_gguf():
    """Each GGUF file version is parsed once in the session, as inside one conversion
    (engine/loading/gguf_reader.py): gguf-py takes ~2.4 s over the default model's 49k
    vocabulary, and tests load the same files' tokenizers, configs and weights often."""
    try:
        import gguf  # noqa: F401
    except ImportError:  # none on a lent GPU machine: nothing to share
        yield
        return
    from engine.loading.gguf_reader import shared_parses

    with shared_parses():
        yield


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The default model's tokenizer, converted from GGUF once per session.
    ``GENSERVE_TEST_TOKENIZER_DIR``: a saved copy instead, for machines without the default
    model package (a lent GPU machine)."""
    from engine.loading.model_loader import load_tokenizer, resolve_model

    if os.environ.get("GENSERVE_TEST_TOKENIZER_DIR"):
        return Path(os.environ["GENSERVE_TEST_TOKENIZER_DIR"])
    d = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(resolve_model("default")).save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def build_tiny_model(directory: Path, tokenizer_dir: Path, *, num_layers: int = 2,
                     hidden: int = 64, seed: int = 0, max_positions: int = 1024) -> Path:
    """Save a tiny random Llama (real tokenizer, same vocab) to ``directory``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
        tie_word_embeddings=False, initializer_range=0.2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Large init: varied greedy outputs with top-2 margins far above float noise.
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), tokenizer_dir)


@pytest.fixture(scope="session")
def lora_cache(tmp_path_factory, tiny_model_dir) -> Path:
    """An adapter cache with the adapters of ``tests.lora_adapters.ADAPTERS`` (by id)."""
    from tests.lora_adapters import ADAPTERS, save_lora

    root = tmp_path_factory.mktemp("adapters")
    for name, kw in ADAPTERS.items():
        save_lora(tiny_model_dir, root / name, **kw)  # type: ignore[arg-type]
    return root
