"""Per-request sampling and stopping parameters, validated on construction.

Every check raises ``ParamError`` (a ``ValueError``) carrying the parameter's name, so the
service maps it to its own field names without re-validating or reading the message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from engine.logits_process import LogitsProcessor, LogitsProcessorFactory

# Penalty bounds follow vLLM / OpenAI.
PENALTY_RANGE = (-2.0, 2.0)
# Below this a temperature is greedy (as vLLM): dividing logits by ~1e-40 overflows to
# inf/NaN and would pick token 0 over and over.
GREEDY_BELOW_TEMPERATURE = 1e-5


class ParamError(ValueError):
    """A bad sampling parameter; ``param`` is its name (``stop_sequences`` for ``stop``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}{'' if message.startswith('[') else ' '}{message}")
        self.param = param


def _finite(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise ParamError(name, f"must be a finite number, got {value!r}")


@dataclass
class SamplingParams:
    """What to sample and when to stop, for one request (all its ``n`` sequences).

    ``temperature == 0`` is greedy. ``top_k == 0``, ``top_p == 1``, ``min_p == 0``,
    ``typical_p == 1`` and penalties of 1/0 disable the corresponding step.
    ``logits_processors`` holds, in order, stateless processors (shared by every sequence)
    and factories (called once per sequence; see ``engine.logits_process``).
    """

    n: int = 1
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_sequence: bool = False
    time_limit_s: float | None = None

    logprobs: bool = False
    top_logprobs: int = 0
    # None = no prompt logprobs; k >= 0 = each prompt token's logprob and rank, with the
    # top k of its position (costs a logits row per prompt token: asked for, not default)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    speculative: bool | None = None  # None = the server's default (when it speculates)

    logits_processors: list[LogitsProcessor | LogitsProcessorFactory | Any] = field(
        default_factory=list
    )

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ParamError("n", f"must be an integer >= 1, got {self.n!r}")
        _finite("temperature", self.temperature)
        if self.temperature < 0:
            raise ParamError("temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            self.temperature = 0.0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ParamError("top_k", f"must be an integer >= 0 (0 = disabled), got {self.top_k!r}")
        _finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError("top_p", f"must be in (0, 1], got {self.top_p}")
        _finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ParamError("min_p", f"must be in [0, 1], got {self.min_p}")
        _finite("typical_p", self.typical_p)
        if not 0.0 < self.typical_p <= 1.0:
            raise ParamError("typical_p", f"must be in (0, 1], got {self.typical_p}")
        _finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ParamError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _finite(name, value)
            if not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                raise ParamError(name, f"must be in [-2, 2], got {value}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ParamError("seed", f"must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ParamError("max_new_tokens", f"must be >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.min_new_tokens, int) or self.min_new_tokens < 0:
            raise ParamError("min_new_tokens", f"must be >= 0, got {self.min_new_tokens!r}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ParamError("min_new_tokens", f"({self.min_new_tokens}) must be <= "
                             f"max_new_tokens ({self.max_new_tokens})")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise ParamError("stop_sequences", f"[{i}] must be a non-empty string")
        for i, t in enumerate(self.stop_token_ids):
            if not isinstance(t, int) or t < 0:
                raise ParamError("stop_token_ids",
                                 f"[{i}] must be a non-negative integer, got {t!r}")
        if self.time_limit_s is not None:
            _finite("time_limit_ms", self.time_limit_s)
            if self.time_limit_s <= 0:
                raise ParamError("time_limit_ms", "must be > 0")
        if not isinstance(self.top_logprobs, int) or self.top_logprobs < 0:
            raise ParamError("top_logprobs", f"must be >= 0, got {self.top_logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or self.prompt_logprobs < 0):
            raise ParamError("prompt_logprobs", f"must be >= 0, got {self.prompt_logprobs!r}")
        for i, p in enumerate(self.logits_processors):
            if not callable(p) and not isinstance(p, LogitsProcessorFactory):
                raise ParamError("logits_processors", f"[{i}] must be a callable processor or "
                                 f"a factory with create()/release(), got {type(p).__name__}")

    @property
    def greedy(self) -> bool:
        """Argmax decoding (a temperature under ``GREEDY_BELOW_TEMPERATURE`` is stored as 0)."""
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Any of the repetition / presence / frequency penalties set."""
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0)

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)
