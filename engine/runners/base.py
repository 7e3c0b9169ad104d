"""The contract between the engine and a model runner: the rows and prefill work of a
step, what a runner exposes (``Runner``), what its warm-up reports, and the defaults every
runner shares. Runner-neutral on purpose: the step loop, the scheduler and speculation
import this module, never a runner's own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.kv_cache import BlockKeeper

if TYPE_CHECKING:
    from engine.adapters import LoraAdapter

DEFAULT_MAX_MODEL_LEN = 4096


def config_eos_ids(*configs: Any) -> set[int]:
    """The EOS ids the configs name, united (``eos_token_id``: an int, a list or None):
    what every runner reads from a model's config and generation config."""
    ids: set[int] = set()
    for config in configs:
        eos = getattr(config, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(eos)
    return ids


@dataclass
class DecodeRow:
    """One query token at ``position`` attending to the first ``position + 1`` cache slots."""

    token_id: int
    position: int
    block_table: list[int]
    seq_id: int = -1  # the engine's sequence (runners that keep state per sequence)
    adapter_slot: int = 0  # the LoRA adapter slot the row runs with (0 = the base model)


@dataclass
class PrefillWork:
    token_ids: list[int]
    start_pos: int  # tokens of the sequence already cached
    block_table: list[int]
    sample: bool  # does the last token's logits row get sampled?
    num_logits: int = 1  # with ``sample``: logits rows of the last tokens returned
    # Tokens of the chunk (0-based) whose logits rows are also returned, after every other
    # row of the step: prompt logprobs, asked for by a request
    prompt_rows: range = range(0)
    seq_id: int = -1  # the engine's sequence (runners that keep state per sequence)
    adapter_slot: int = 0  # the LoRA adapter slot the chunk runs with (0 = the base model)
    # Tokens of the whole sequence being prefilled (its prompt; with its output when
    # recomputed after preemption); 0 = not said (a runner then treats the chunk alone)
    seq_len: int = 0


@dataclass
class BuildReport:
    rows: str  # "1", "2-64" (CPU graphs) or "8x1024" (a CUDA bucket: rows x context)
    seconds: float
    status: str  # "compiled", "captured", "native", "skipped (budget)", "failed: ..."

    @property
    def ok(self) -> bool:
        return self.status in ("compiled", "captured", "native")


@dataclass
class WarmupReport:
    """What a runner built before serving (compiled or captured decode steps)."""

    graphs: list[BuildReport] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ready(self) -> list[str]:
        return [g.rows for g in self.graphs if g.ok]


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
    # Block tables may share blocks between sequences (the scheduler's prefix caching)
    supports_prefix_caching: bool
    # Keeps cached blocks' KV when it lives outside the block table (llama.cpp); None when
    # the block table is the KV (torch)
    block_keeper: BlockKeeper | None
    # LoRA adapter slots 1..max_loras that rows may name (``adapter_slot``); 0 = this
    # runner serves no adapters (the registry refuses them, naming the runner)
    max_loras: int
    # One step may hold rows of several adapter slots; False: the scheduler gives each
    # step the rows of one slot (llama.cpp sets adapters per context, not per sequence)
    supports_mixed_adapters: bool
    # Of an adapter directory holding both PEFT files and a GGUF LoRA file, reads the GGUF
    # (llama.cpp loads it as it is); False: the PEFT files (torch)
    prefers_gguf_adapters: bool

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

    def check_adapter(self, adapter: LoraAdapter) -> None:
        """``AdapterError`` when ``adapter`` does not fit the model (a target module it
        lacks, shapes), without loading it or needing a slot: a request is refused before
        it waits for one."""

    def load_adapter(self, slot: int, adapter: LoraAdapter) -> None:
        """Make ``slot`` run ``adapter`` (replacing what it held; no row uses the slot
        now). Called off the engine thread, while steps run. ``AdapterError`` when the
        adapter does not fit the model (a target module it lacks, shapes)."""
    @property
    def failure(self) -> str | None:
        """Why the runner can run no more steps (a tensor-parallel worker lost); None while
        it can. The step loop checks it between steps."""
        ...

    def close(self) -> None:
        """Release what outlives the process's objects (tensor-parallel workers)."""
        ...
