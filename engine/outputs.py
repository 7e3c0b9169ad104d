"""What the engine hands back: per-step deltas for each sequence of a request."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.Enum):
    EOS = "eos"
    LENGTH = "length"
    STOP_SEQUENCE = "stop_sequence"
    STOP_TOKEN = "stop_token"
    TIME_LIMIT = "time_limit"
    ABORTED = "aborted"
    ERROR = "error"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int = 0  # 1-based rank of token_id in its row (1 = the most likely)


@dataclass
class CompletionDelta:
    """New output of one sequence since the previous ``RequestOutput``.

    ``text`` is only text that can no longer be retracted (a possible stop-sequence
    prefix is held back until resolved). ``finish_reason`` is set once, on the last delta.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = None
    error: str | None = None
    # ERROR because the output failed its processor's finished-output check (the text is
    # whole and the request did not fail), not because the engine or a processor failed
    rejected: bool = False
    # ERROR because the request's own spec could not be enforced (a processor raised
    # ``RequestSpecError``): bad input, named by this field (relative to the request's
    # structured-output options), never a server failure
    invalid_field: str | None = None

    def add(self, delta: CompletionDelta) -> None:
        """Append a later delta of the same sequence."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_sequence = delta.stop_sequence
            self.error = delta.error
            self.rejected = delta.rejected
            self.invalid_field = delta.invalid_field


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass
class RequestTimes:
    """When a request passed each stage (``time.monotonic()``): the queue, prefill, decode
    and end-to-end latency metrics are differences of these."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    deltas: list[CompletionDelta]
    finished: bool
    usage: Usage
    # With ``SamplingParams.prompt_logprobs``: prompt tokens 1.. under the positions before
    # them (token 0 has none), once, on the first output after the whole prompt is computed.
    prompt_logprobs: list[TokenLogprob] | None = None
    times: RequestTimes | None = None  # on the finished output only

    def add(self, later: RequestOutput) -> None:
        """Fold a later output of the same request into this one (a stream consumer that
        fell behind gets one output, and one message, for several steps)."""
        mine = {d.index: d for d in self.deltas}
        for d in later.deltas:
            if d.index in mine:
                mine[d.index].add(d)
            else:
                self.deltas.append(d)
                mine[d.index] = d
        self.finished, self.usage = later.finished, later.usage
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.times = later.times or self.times


@dataclass
class Completion(CompletionDelta):
    """A whole sequence's output, accumulated from its deltas (``add``)."""


@dataclass
class SpecStats:
    """Cumulative since start; the only place speculation is counted server-wide."""

    steps: int = 0  # verification passes (one per step that speculated)
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens emitted by verified sequences (accepted + one each)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_requests: int
    kv_blocks_total: int
    kv_blocks_used: int
    num_preemptions: int
    spec: SpecStats = field(default_factory=SpecStats)  # zeros when it does not speculate
    prefix_cache_queries: int = 0  # prompt tokens looked up (vLLM's units)
    prefix_cache_hits: int = 0  # prompt tokens found cached
    prefix_cache_blocks: int = 0  # blocks findable now
    prefix_cache_host_bytes: int = 0  # idle cached blocks' KV in host memory (llama.cpp)
    # requests (not sequences) with a sequence running / with every sequence waiting
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_adapter_waiting: int = 0  # requests waiting for a LoRA adapter slot (not yet queued)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / max(1, self.kv_blocks_total)
