"""Speculative decoding's settings (CLI: ``--spec-*``)."""

from __future__ import annotations

from dataclasses import dataclass


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
