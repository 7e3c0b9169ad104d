"""Engine configuration and the facts about the loaded model that callers need."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculativeConfig:
    """Speculative decoding; ``method`` None = off. CLI: ``--spec-*``."""

    method: str | None = None  # None | "ngram" | "draft"
    num_spec_tokens: int = 4  # k: tokens proposed per sequence per step
    draft_model: str | None = None  # method "draft": HF dir / .gguf / "default" / "self:N"
    ngram_min: int = 1  # n-gram lookup tries n = ngram_max down to ngram_min
    ngram_max: int = 4
    # Speculation turns off for a step when more sequences run than this: a big batch is
    # already compute bound and the k extra rows per sequence would only slow it down.
    disable_batch_size: int = 8
    enabled_by_default: bool = True  # for requests that leave speculative.enabled unset
    # How the target scores proposals: "batch_expansion" (k + 1 single-token queries per
    # sequence, one batched attention for the whole step) or "multi_token" (one causal
    # query of k + 1 tokens per sequence; the KV prefix is gathered once, but attention
    # runs per sequence). Both give the same scores.
    scorer: str = "batch_expansion"


@dataclass
class EngineConfig:
    """Knobs of the engine; the CLI flags of ``genserve serve`` map onto these 1:1."""

    model: str = "default"  # HF directory, .gguf file, or "default" (embedded SmolLM2)
    max_model_len: int | None = None  # None = min(model's max positions, 4096)
    max_num_seqs: int = 64  # sequences running in one step
    max_num_batched_tokens: int = 512  # token budget of one step (chunked prefill)
    kv_cache_memory: int = 1 << 30  # bytes for the KV cache
    block_size: int = 16  # tokens per KV block
    dtype: str = "auto"  # auto = fp32 on CPU, bf16 on CUDA
    device: str = "auto"  # auto = cuda if available else cpu
    max_waiting: int = 1024  # waiting-queue bound; beyond it generate() raises QueueFullError
    max_top_logprobs: int = 20
    # Run batched processors' prepare in a worker thread during the forward. None = auto:
    # only when the forward leaves a CPU core free (CUDA, or more cores than torch uses);
    # on a CPU whose cores the forward saturates, overlapping measured slower (make bench).
    overlap_prepare: bool | None = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)


@dataclass
class ModelInfo:
    model_id: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    spec_method: str = ""  # "" = speculative decoding off
    spec_k: int = 0


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""
