"""Which model runner runs a config, and the contract every runner keeps for the engine.

Two runners: ``ModelRunner`` (torch: HF directories and GGUF through transformers, CPU or
CUDA) and ``LlamaCppRunner`` (llama.cpp: a .gguf on CPU, quantised weights run by its SIMD
kernels, several times faster there). ``auto`` picks llama.cpp for a .gguf on CPU when the
``llama_cpp`` package is importable, torch otherwise.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Protocol

import torch

from engine.compiled_step import WarmupReport
from engine.config import EngineConfig
from engine.model_loader import resolve_device, resolve_model
from engine.model_runner import DecodeRow, ModelRunner, PrefillWork

log = logging.getLogger(__name__)

RUNNERS = ("auto", "torch", "llamacpp")


class Runner(Protocol):
    """What the engine, the scheduler and the speculator use of a runner."""

    name: str  # "torch" | "llamacpp"
    quantization: str  # weights as they run: "float32", "Q4_1", ...
    tokenizer: Any
    model_id: str
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int  # KV capacity the scheduler hands out, in blocks of block_size tokens
    max_rows_per_seq: int

    @property
    def row_cost(self) -> float:
        """What one more query row of a sequence adds to a decode step, as a share of a
        one-row step (speculation's verify rows); 0 = nearly free, nothing to weigh."""
        ...

    def eos_token_ids(self) -> list[int]: ...

    def warmup(self, buckets: list[int] | None = None,
               budget_s: float | None = None) -> WarmupReport: ...

    def execute(self, decodes: list[DecodeRow], prefills: list[PrefillWork]) -> torch.Tensor:
        """Logits ``[rows, vocab]``: one row per decode row, then ``num_logits`` per sampled
        prefill, then each prefill's ``prompt_rows``."""
        ...

    def release(self, seq_id: int) -> None:
        """The scheduler freed ``seq_id``'s blocks (finished, aborted or preempted)."""
        ...


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def choose_runner(config: EngineConfig) -> str:
    """"torch" or "llamacpp" for ``config``; ValueError when the choice cannot run."""
    if config.runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {config.runner!r}")
    if config.runner == "torch":
        return "torch"
    gguf = resolve_model(config.model).gguf_file is not None
    cpu = resolve_device(config.device).type == "cpu"
    if config.runner == "auto":
        return "llamacpp" if gguf and cpu and llama_cpp_available() else "torch"
    if not gguf:
        raise ValueError(f"--runner llamacpp needs a .gguf model; {config.model!r} is not one")
    if not cpu:
        raise ValueError(f"--runner llamacpp runs on the CPU; --device {config.device} "
                         f"needs --runner torch")
    if not llama_cpp_available():
        raise ValueError("--runner llamacpp needs the llama-cpp-python package "
                         "(make setup installs it)")
    return "llamacpp"


def torch_runner(runner: Runner) -> ModelRunner:
    """``runner`` as the torch runner, for callers that reach into its model (benches)."""
    if not isinstance(runner, ModelRunner):
        raise TypeError(f"needs the torch runner; this engine runs {runner.name}")
    return runner


def create_runner(config: EngineConfig, share_weights: Runner | None = None) -> Runner:
    """The runner for ``config``; ``share_weights`` (torch only) reuses a loaded model."""
    if share_weights is not None:
        if not isinstance(share_weights, ModelRunner):
            raise ValueError("sharing weights needs the torch runner")
        return ModelRunner(config, share_weights)
    if choose_runner(config) == "llamacpp":
        from engine.llamacpp_runner import LlamaCppRunner

        return LlamaCppRunner(config)
    return ModelRunner(config)
