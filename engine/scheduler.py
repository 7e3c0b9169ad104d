"""Continuous batching: which sequences run this step, and how many of their tokens.

The scheduler owns the KV blocks: it allocates them as sequences grow (prefill chunks,
decodes, room for speculative proposals), frees them when a sequence ends, and preempts
by recompute when they run out. Each step spends a token budget: running sequences first
(decodes, and prefills that were chunked), in arrival order, then waiting ones while
seats and blocks last. When blocks run dry the most recently arrived running sequence is
preempted: its blocks are freed and it goes back to the front of the queue, keeping its
output tokens and processor state, to be prefilled again later.

No head-of-line blocking behind a long prompt (vLLM's long-prefill limits): a prefill
gets at most ``long_prefill_token_threshold`` tokens a step, so a step stays short and
leaves budget for others, and a prompt with more than that left to prefill ("long")
starts only while fewer than ``max_long_partial_prefills`` long ones are prefilling;
shorter prompts behind it in the queue are admitted meanwhile. A short request arriving
during a long prefill thus gets its first token in the next step. A prefill with no other
sequence in the engine takes ``ALONE_CHUNK_FACTOR`` times the threshold (within the
budget): small chunks cost prefill throughput, and while it is alone they shorten no
one's step; one arriving waits out at most one such chunk.

With prefix caching (engine/kv_cache.py) a sequence about to be prefilled first takes the
cached blocks of its longest cached run of full blocks and computes only the rest (at
least its last token, whose logits it samples); every full block of computed tokens is
made findable as soon as it is computed. A request's ``n`` samples are admitted after the
first has prefilled the prompt, so they share its blocks (one prefill).

A runner that cannot mix LoRA adapters in one step (llama.cpp sets them per context)
gets steps of one adapter slot each (``mixed_adapters=False``): the slots with sequences
take turns of ``adapter_turn_steps`` steps, in slot order from the one after the last
served, so every running sequence advances that many tokens per round of turns and none
starves. A slot with nothing it can run (no seats or blocks for its waiting prompts)
passes its turn. Turns of several steps because each change of adapter costs llama.cpp a
rebuild of its graphs: with two slots, 8 + 8 requests ran 0.74-0.79x of 16 base requests
switching every step and ~1.0x with turns of 4 (docs/llamacpp-runner.md).
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.kv_cache import BlockAllocator, BlockKeeper, block_hash, tail_hash
from engine.sequence import SeqStatus, Sequence

# A lone long prefill's chunk, in thresholds. Measured 2026-11-26 (quiet, default model,
# the llama.cpp runner's torch bf16 prefill, 2 rounds): 3,000 tokens in 256-token chunks
# 5.8-6.3 s, in 512 5.3 s, whole 4.9-5.0 s; 1,024 tokens 1.47-1.50 / 1.39-1.45 / 1.30 s.
# Twice, not the whole prompt: a request arriving meanwhile waits out the chunk.
ALONE_CHUNK_FACTOR = 2

# Partial last blocks of finished sequences kept for a runner that keeps KV itself (the
# llama.cpp runner): a chat's next turn resends the previous answer, whose last 1-15
# tokens fill no full block. Each holds a few of the runner's cells until it goes idle
# (then host memory, where the runner has a host tier; its cells otherwise), so only the
# most recent few are kept.
MAX_TAILS = 16


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens to compute, starting at seq.num_computed_tokens
    samples: bool  # the chunk reaches the sequence's last token: its logits are sampled


class Scheduler:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int,
                 on_free: Callable[[Sequence], None] | None = None,
                 long_prefill_token_threshold: int = 0,
                 max_long_partial_prefills: int = 1,
                 prefix_caching: bool = False, keeper: BlockKeeper | None = None,
                 mixed_adapters: bool = True, adapter_turn_steps: int = 4) -> None:
        """``on_free``: told each time a sequence's blocks are freed (finish, abort,
        preemption), for a runner that keeps state of its own per sequence.
        ``keeper``: with prefix caching, a runner whose KV lives outside the block table
        (llama.cpp) keeps each cached block's KV until it is evicted.
        ``long_prefill_token_threshold``: 0 = a prefill may take the whole budget (and
        no prompt counts as long)."""
        if long_prefill_token_threshold < 0 or max_long_partial_prefills < 1:
            raise ValueError("long_prefill_token_threshold must be >= 0 and "
                             "max_long_partial_prefills >= 1")
        self.on_free = on_free
        self.keeper = keeper if prefix_caching else None
        self.allocator = BlockAllocator(
            num_blocks, caching=prefix_caching,
            on_evict=self.keeper.evict if self.keeper else None,
            max_evictable=self.keeper.max_idle_blocks if self.keeper else None,
            track_idle=self.keeper is not None)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_long_partial_prefills = max_long_partial_prefills
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.mixed_adapters = mixed_adapters
        self.adapter_turn_steps = adapter_turn_steps
        self.last_adapter_slot = -1  # the slot of the last step (-1: none yet)
        self._turn_steps = 0  # steps the last slot has run in its current turn
        self._tails: OrderedDict[int, bytes] = OrderedDict()  # kept partial block -> hash

    @property
    def capacity(self) -> int:
        """Tokens the whole cache holds: no sequence can grow past it."""
        return self.allocator.num_blocks * self.block_size

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        self.cache_blocks(seq)
        if self.keeper is not None:
            self._keep_tail(seq, self.keeper)
        self.allocator.free(seq.block_table)
        seq.num_cached_blocks = 0
        if self.on_free is not None:
            self.on_free(seq)

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for the first ``num_tokens`` positions of ``seq``; False (nothing taken)
        when too few are free. Never preempts: speculation only uses spare blocks."""
        need = -(-num_tokens // self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        blocks = self.allocator.allocate(need)
        if blocks is None:
            return False
        seq.block_table.extend(blocks)
        return True

    # ---- prefix caching ------------------------------------------------------------

    def _hash_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Extend ``seq.block_hashes`` over its first ``num_tokens`` tokens' full blocks."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.request.cache_root
            seq.block_hashes.append(block_hash(parent, seq.tokens(i * bs, (i + 1) * bs)))

    def cache_blocks(self, seq: Sequence) -> None:
        """Make ``seq``'s full blocks of computed tokens findable by later prompts."""
        if not self.allocator.caching:
            return
        if self.keeper is not None and self.keeper.kv_pending(seq.seq_id):
            return  # retried after the runner has the KV (num_cached_blocks unchanged)
        full = min(seq.num_computed_tokens, seq.num_tokens, len(seq.block_table) *
                   self.block_size) // self.block_size
        if full <= seq.num_cached_blocks:
            return
        self._hash_blocks(seq, full * self.block_size)
        for i in range(seq.num_cached_blocks, full):
            block = seq.block_table[i]
            if (self.allocator.cache(block, seq.block_hashes[i]) and self.keeper is not None
                    and not self.keeper.keep(seq.seq_id, seq.block_table, i)):
                self.allocator.uncache(block)
        seq.num_cached_blocks = full

    def _keep_tail(self, seq: Sequence, keeper: BlockKeeper) -> None:
        """A sequence being freed leaves its partial last block findable (a runner that
        keeps KV itself: ``BlockKeeper.keep_tail``), after its cached full blocks."""
        bs = self.block_size
        computed = min(seq.num_computed_tokens, seq.num_tokens, len(seq.block_table) * bs)
        index, n = divmod(computed, bs)
        if not n or seq.num_cached_blocks < index or keeper.kv_pending(seq.seq_id):
            return
        parent = seq.block_hashes[index - 1] if index else seq.request.cache_root
        block, h = seq.block_table[index], tail_hash(parent, seq.tokens(index * bs, computed))
        if not self.allocator.cache(block, h):
            return
        if not keeper.keep_tail(seq.seq_id, seq.block_table, index, n):
            self.allocator.uncache(block)
            return
        self._tails[block] = h
        while len(self._tails) > MAX_TAILS:
            old, old_h = self._tails.popitem(last=False)
            if self.allocator.forget(old, old_h):
                keeper.evict(old)

    def _use_cached(self, seq: Sequence) -> None:
        """A sequence about to be prefilled from scratch starts from its longest cached
        run of full blocks (never its last token: that one's logits are sampled), and then
        a kept partial block that continues it."""
        if not self.allocator.caching or seq.block_table or seq.num_computed_tokens:
            return
        req = seq.request
        if (seq.index == 0 and req.prompt_logprobs is not None
                and len(req.prompt_logprobs) < len(req.prompt_token_ids) - 1):
            return  # its prompt logprobs need every prompt position's logits, as in vLLM
        usable = (seq.num_tokens - 1) // self.block_size
        self._hash_blocks(seq, usable * self.block_size)
        blocks = self.allocator.lookup(seq.block_hashes[:usable], self.block_size,
                                       seq.num_tokens)
        seq.block_table.extend(blocks)
        seq.num_cached_blocks = len(blocks)
        seq.num_computed_tokens = len(blocks) * self.block_size
        if self.keeper is not None and self._tails:
            self._use_tail(seq, self.keeper)
        if seq.index == 0 and seq.num_preemptions == 0:
            seq.request.usage.cached_prompt_tokens = seq.num_computed_tokens

    def _use_tail(self, seq: Sequence, keeper: BlockKeeper) -> None:
        """The longest kept partial block whose tokens come next in ``seq`` becomes its
        next block (taken private: the sequence writes the rest of it)."""
        bs, hit = self.block_size, len(seq.block_table)
        start = hit * bs
        room = min(bs - 1, seq.num_tokens - 1 - start)
        if room <= 0:
            return
        parent = seq.block_hashes[hit - 1] if hit else seq.request.cache_root
        tokens = seq.tokens(start, start + room)
        for n in range(room, 0, -1):
            block = self.allocator.take(tail_hash(parent, tokens[:n]))
            if block is not None:
                break
        else:
            return
        self._tails.pop(block, None)
        keeper.grant_tail(seq.seq_id, block)
        seq.block_table.append(block)
        seq.num_computed_tokens += n
        self.allocator.stats.hits += n

    def _drop_cached(self, seq: Sequence) -> None:
        """Give back the cached blocks a sequence took but will not run with this step."""
        if self.keeper is not None:
            self.keeper.forget_grant(seq.seq_id)
        self.allocator.free(seq.block_table)
        seq.num_computed_tokens = seq.num_cached_blocks = 0

    def _sibling_prefilling(self, seq: Sequence) -> bool:
        """Another sample of ``seq``'s request is computing the prompt now: wait for its
        blocks instead of computing them again."""
        if not self.allocator.caching or len(seq.prompt_token_ids) <= self.block_size:
            return False  # no full block to share: nothing to wait for
        return any(
            s is not seq and s.status is SeqStatus.RUNNING
            and s.num_computed_tokens < len(s.prompt_token_ids)
            for s in seq.request.sequences)

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _is_long(self, seq: Sequence) -> bool:
        """More left to prefill than one step may give a prefill."""
        t = self.long_prefill_token_threshold
        return 0 < t < seq.num_tokens - seq.num_computed_tokens

    def _chunk(self, seq: Sequence, budget: int, alone: bool) -> int:
        """``alone``: no other sequence is running or waiting, so nobody's step is
        lengthened by a bigger chunk; a request arriving meanwhile waits out at most one."""
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        t = self.long_prefill_token_threshold
        return min(n, t * ALONE_CHUNK_FACTOR if alone else t) if t else n

    def schedule(self) -> list[ScheduledSeq]:
        keeper = self.keeper
        if keeper is not None:
            # Idle cells left in llama.cpp cost each running row (see BlockKeeper): with
            # 32 streaming clients and no shared prefix, 2,048 idle cells made its steps
            # 1.45x slower (238 vs 347 tok/s, quiet machine); under load fewer are kept.
            cap = keeper.max_idle_blocks
            if keeper.idle_blocks_cost_steps:
                cap //= max(1, len(self.running))
            self.allocator.limit_evictable(max(1, cap))
        out = self._schedule_turns()
        if keeper is not None and out:
            idle = self.allocator.take_idle()
            if idle:
                keeper.demote(idle)
        return out

    def _schedule_turns(self) -> list[ScheduledSeq]:
        if self.mixed_adapters:
            return self._schedule(None)
        for slot in self._adapter_turns():
            out = self._schedule(slot)
            if out:
                same = slot == self.last_adapter_slot
                self._turn_steps = self._turn_steps + 1 if same else 1
                self.last_adapter_slot = slot
                return out
        return []

    def _adapter_turns(self) -> list[int]:
        """The adapter slots with sequences in the order they get this step: the last
        served first while its turn lasts, then from the one after it."""
        slots = sorted({s.request.adapter_slot
                        for s in itertools.chain(self.running, self.waiting)})
        i = bisect.bisect_right(slots, self.last_adapter_slot)
        turns = slots[i:] + slots[:i]  # the last served, if it has sequences, is last
        if turns and turns[-1] == self.last_adapter_slot \
                and self._turn_steps < self.adapter_turn_steps:
            turns.insert(0, turns.pop())
        return turns

    def _schedule(self, adapter_slot: int | None) -> list[ScheduledSeq]:
        """This step's work; ``adapter_slot``: only sequences of that slot."""
        out: list[ScheduledSeq] = []
        budget = self.max_num_batched_tokens
        preempted = False
        long_prefills = 0
        alone = len(self.running) + len(self.waiting) == 1
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if adapter_slot is not None and seq.request.adapter_slot != adapter_slot:
                i += 1
                continue
            n = self._chunk(seq, budget, alone)
            while not self.reserve(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            long_prefills += self._is_long(seq)
            out.append(self._scheduled(seq, n))
            budget -= n
            i += 1
        if preempted:  # memory is short: admit nobody new this step
            return out
        j = 0  # waiting sequences in arrival order; long ones over the limit are passed
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[j]
            if adapter_slot is not None and seq.request.adapter_slot != adapter_slot:
                j += 1
                continue
            if self._sibling_prefilling(seq):
                j += 1
                continue
            self._use_cached(seq)
            is_long = self._is_long(seq)
            if is_long and long_prefills >= self.max_long_partial_prefills:
                self._drop_cached(seq)
                j += 1
                continue
            n = self._chunk(seq, budget, alone)
            if not self.reserve(seq, seq.num_computed_tokens + n):
                self._drop_cached(seq)
                break
            del self.waiting[j]
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            long_prefills += is_long
            out.append(self._scheduled(seq, n))
            budget -= n
        return out

    @staticmethod
    def _scheduled(seq: Sequence, n: int) -> ScheduledSeq:
        return ScheduledSeq(seq, n, seq.num_computed_tokens + n == seq.num_tokens)
