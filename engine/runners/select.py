"""Which model runner runs a config, and building it.

Two runners: the torch runner (``engine.runners.torch``: HF directories and GGUF through
transformers, CPU or CUDA) and the llama.cpp runner (``engine.runners.llamacpp``: a .gguf
on CPU, quantised weights run by its SIMD kernels, several times faster there). ``auto``
picks llama.cpp for a .gguf on CPU when the ``llama_cpp`` package is importable, torch
otherwise. Each runner is imported only when chosen.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.loading.model_loader import resolve_device, resolve_model
from engine.runners.base import Runner

if TYPE_CHECKING:
    from engine.runners.torch import ModelRunner

log = logging.getLogger(__name__)

RUNNERS = ("auto", "torch", "llamacpp")


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


@dataclass(frozen=True)
class RunnerChoice:
    name: str  # "torch" | "llamacpp"
    why: str  # one line for the start-up log


def choose_runner(config: EngineConfig) -> str:
    """"torch" or "llamacpp" for ``config``; ValueError when the choice cannot run."""
    return runner_choice(config).name


def runner_choice(config: EngineConfig) -> RunnerChoice:
    """The runner for ``config`` and why (``auto``: llama.cpp for a .gguf on the CPU,
    whose quantised kernels beat fp32 torch there at every measured row once the file runs
    as Q8_0 in 512-token ubatches; torch for HF directories, CUDA, or without the package).
    ValueError when a forced choice cannot run."""
    if config.runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {config.runner!r}")
    if config.runner == "torch":
        return RunnerChoice("torch", "--runner torch")
    if config.tensor_parallel_size > 1:
        if config.runner == "llamacpp":
            raise ValueError(f"--tensor-parallel-size {config.tensor_parallel_size} needs "
                             f"--runner torch: the llama.cpp runner runs on one device")
        return RunnerChoice("torch", "auto: --tensor-parallel-size shards on the torch "
                                     "runner only")
    gguf = resolve_model(config.model, config.revision).gguf_file is not None
    cpu = resolve_device(config.device).type == "cpu"
    if config.runner == "auto":
        if not gguf:
            return RunnerChoice("torch", "auto: not a .gguf (llama.cpp runs only GGUF)")
        if not cpu:
            return RunnerChoice("torch", f"auto: device {config.device} is not the CPU")
        if not llama_cpp_available():
            return RunnerChoice("torch", "auto: llama-cpp-python is not installed")
        return RunnerChoice("llamacpp", "auto: a .gguf on the CPU runs its quantised "
                            "weights on llama.cpp (--runner torch: fp32 through "
                            "transformers)")
    if not gguf:
        raise ValueError(f"--runner llamacpp needs a .gguf model; {config.model!r} is not one")
    if not cpu:
        raise ValueError(f"--runner llamacpp runs on the CPU; --device {config.device} "
                         f"needs --runner torch")
    if not llama_cpp_available():
        raise ValueError("--runner llamacpp needs the llama-cpp-python package "
                         "(make setup installs it)")
    return RunnerChoice("llamacpp", "--runner llamacpp")


def torch_runner(runner: Runner) -> ModelRunner:
    """``runner`` as the torch runner, for callers that reach into its model (benches)."""
    from engine.runners.torch import ModelRunner

    if not isinstance(runner, ModelRunner):
        raise TypeError(f"needs the torch runner; this engine runs {runner.name}")
    return runner


def create_runner(config: EngineConfig, share_weights: Runner | None = None) -> Runner:
    """The runner for ``config``; ``share_weights`` (torch only) reuses a loaded model."""
    if share_weights is None:
        choice = runner_choice(config)
        log.info("runner: %s (%s)", choice.name, choice.why)
        if choice.name == "llamacpp":
            from engine.runners.llamacpp import LlamaCppRunner

            return LlamaCppRunner(config)
    from engine.runners.torch import ModelRunner

    if share_weights is not None and not isinstance(share_weights, ModelRunner):
        raise ValueError("sharing weights needs the torch runner")
    if share_weights is not None and share_weights.tp is not None:
        raise ValueError("a tensor-parallel runner's sharded weights cannot be shared")
    if share_weights is None and config.tensor_parallel_size > 1:
        return _tensor_parallel_runner(config)
    return ModelRunner(config, share_weights)


def _tensor_parallel_runner(config: EngineConfig) -> ModelRunner:
    """Rank 0's runner: refuse what cannot be sharded before any worker starts, then
    launch the workers and load this rank's shard."""
    from engine.loading.model_loader import load_config
    from engine.runners.torch import ModelRunner
    from engine.runners.torch.tp_shard import check_tensor_parallel
    from engine.runners.torch.tp_worker import launch_leader, node_layout

    node_layout(config.tensor_parallel_size, config.tp_nnodes)
    source = resolve_model(config.model, config.revision)
    check_tensor_parallel(load_config(source, config.trust_remote_code),
                          config.tensor_parallel_size, config.trust_remote_code)
    group = launch_leader(config)
    try:
        return ModelRunner(config, tp=group)
    except BaseException:
        group.close(wait_s=2.0)
        raise
