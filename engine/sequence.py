"""Requests and their sequences: the engine's bookkeeping of what is generated where."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv_cache import ROOT_HASH
from engine.logits_process import BoundProcessor
from engine.outputs import CompletionDelta, FinishReason, RequestTimes, TokenLogprob, Usage
from engine.sampling_params import SamplingParams
from engine.stop_checker import OutputState

if TYPE_CHECKING:
    from engine.adapters import AdapterLease


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One of a request's ``n`` samples: its tokens, KV blocks and per-sequence state.

    ``processors`` holds, in the params' order, each shared processor or the product a
    factory made for this sequence alone; products are released to their factory when the
    sequence ends. ``num_preemptions`` tells a draft model its cached copy is stale.
    """

    seq_id: int
    request: Request
    index: int
    prompt_token_ids: list[int]
    output: OutputState
    processors: list[BoundProcessor] = field(default_factory=list)
    sampling_key: int = 0  # its random stream (engine.counter_rng): from the seed if any
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # leading tokens whose KV is in the cache
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, in order
    num_cached_blocks: int = 0  # leading blocks of block_table known to the prefix cache
    num_preemptions: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    pending: CompletionDelta | None = None  # output produced since the last RequestOutput
    # the emitted text, kept only while a processor will check the finished output
    checked_text: list[str] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def delta(self) -> CompletionDelta:
        if self.pending is None:
            self.pending = CompletionDelta(index=self.index)
        return self.pending


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # monotonic time of the time limit
    sequences: list[Sequence] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    # With params.prompt_logprobs: filled by the first sequence's prefill, position by
    # position (a recomputed prefix is not recorded twice); sent once when complete.
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs_sent: bool = False
    # The LoRA adapter it runs with (None = the base model), held until it finishes
    adapter: AdapterLease | None = None
    cache_root: bytes = ROOT_HASH  # parent hash of its first KV block (kv_cache.root_hash)
    times: RequestTimes = field(init=False)

    def __post_init__(self) -> None:
        self.times = RequestTimes(self.arrival_time)

    @property
    def adapter_slot(self) -> int:
        return self.adapter.slot if self.adapter is not None else 0

    @property
    def prompt_logprobs_ready(self) -> bool:
        return (self.prompt_logprobs is not None and not self.prompt_logprobs_sent
                and len(self.prompt_logprobs) >= len(self.prompt_token_ids) - 1)

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.sequences)
