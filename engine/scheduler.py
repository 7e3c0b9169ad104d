"""Continuous batching: which sequences run this step, and how many of their tokens.

Each step spends a token budget: running sequences first (decodes, and prefills that were
chunked), in arrival order, then waiting ones while seats and KV blocks last. When the
KV cache runs dry the most recently arrived running sequence is preempted by recompute:
its blocks are freed and it goes back to the front of the queue, keeping its output
tokens and processor state, to be prefilled again later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache import BlockAllocator
from engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens to compute, starting at seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last known token, so its logits are sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq.block_table)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def ensure_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        blocks = self.allocator.allocate(need)
        if blocks is None:
            return False
        seq.block_table.extend(blocks)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.ensure_blocks(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.ensure_blocks(seq, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return out
