"""The scheduler's view of the paged KV cache: block ids, with automatic prefix caching.

A sequence holds ``ceil(tokens / block_size)`` blocks of its runner's cache (the torch
runner's tensors are in engine/runners/torch/kv_tensors.py). A *full* block of computed
tokens is identified by a hash chained over its parent block's hash and its own token ids
(vLLM's automatic prefix caching), so a later prompt that starts with the same tokens
reuses those blocks instead of computing them again. Blocks are reference-counted; a
cached block that no sequence uses stays in the cache and is evicted least recently used
only when a new block is needed, so caching never takes room a request would have had.
When the allocator runs dry the scheduler preempts a sequence (recompute later).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

ROOT_HASH = b"genserve-prefix-v1"  # the parent of a base-model sequence's first block


def root_hash(adapter_fingerprint: bytes | None = None) -> bytes:
    """The parent of a sequence's first block: the KV of a prompt run under a LoRA adapter
    is that adapter's own, so each adapter's blocks hash apart (from the base's too)."""
    if adapter_fingerprint is None:
        return ROOT_HASH
    return hashlib.blake2b(ROOT_HASH + b"/lora/" + adapter_fingerprint, digest_size=16).digest()


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The identity of a full block: its tokens after everything before them."""
    return hashlib.blake2b(parent + np.asarray(token_ids, dtype=np.int64).tobytes(),
                           digest_size=16).digest()


def tail_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The identity of a partial last block (a finished sequence's last 1..bs-1 computed
    tokens after ``parent``): hashed apart from full blocks, so never found as one."""
    return hashlib.blake2b(parent + b"/tail/" + np.asarray(token_ids, dtype=np.int64)
                           .tobytes(), digest_size=16).digest()


class BlockKeeper(Protocol):
    """A runner whose KV lives outside the scheduler's block table (llama.cpp keeps it in
    its own cells) keeps a cached block's KV alive from the moment the scheduler caches it
    until the allocator evicts it, and so can hand it to a later sequence."""

    # Most cached blocks no sequence holds that it keeps (the least recently used beyond
    # are evicted); where ``idle_blocks_cost_steps`` the scheduler divides it by the
    # number of running sequences: llama.cpp's attention walks every cell up to the
    # highest one in use, so each idle block left in its cells costs every row of every
    # step. A keeper that moves idle blocks out of the cells (``demote``) costs none.
    max_idle_blocks: int

    @property
    def idle_blocks_cost_steps(self) -> bool:
        """Whether idle blocks stay in the runner's cache, where each costs every step."""
        ...

    @property
    def host_bytes(self) -> int:
        """Host memory holding blocks' KV outside the runner's cache (metrics)."""
        ...

    def keep(self, seq_id: int, block_table: list[int], index: int) -> bool:
        """Keep the KV of ``block_table[index]``, computed by sequence ``seq_id``; False
        when it cannot (the block then stays private: not findable)."""
        ...

    def evict(self, block: int) -> None:
        """The allocator dropped ``block``'s content: its KV may go."""
        ...

    def demote(self, blocks: list[int]) -> None:
        """``blocks`` became idle (cached, held by no sequence) since the last step that
        ran, and are still idle as the next one is about to run."""
        ...

    def keep_tail(self, seq_id: int, block_table: list[int], index: int, n: int) -> bool:
        """Keep the KV of the first ``n`` positions (its computed tokens) of the partial
        block ``block_table[index]`` of sequence ``seq_id``, which is being freed; False
        when it cannot."""
        ...

    def grant_tail(self, seq_id: int, block: int) -> None:
        """Kept tail ``block`` becomes sequence ``seq_id``'s: its KV goes to that sequence
        when the runner first sees it (or goes with ``forget_grant``)."""
        ...

    def forget_grant(self, seq_id: int) -> None:
        """Drop a granted tail the sequence did not take (not scheduled after all)."""
        ...

    def kv_pending(self, seq_id: int) -> bool:
        """Whether sequence ``seq_id``'s computed tokens are not in the runner's cache yet
        (a prompt prefilled elsewhere, handed over at its end): none of its blocks can be
        kept until then."""
        ...


@dataclass
class PrefixCacheStats:
    """Cumulative, in vLLM's units: prompt tokens looked up and tokens found cached."""

    queries: int = 0
    hits: int = 0


class BlockAllocator:
    """Block ids with reference counts. O(1) allocate/free; never hands out a block in
    use. Freed blocks whose content is known (hashed) wait, least recently used first, to
    be found again or evicted."""

    def __init__(self, num_blocks: int, caching: bool = False,
                 on_evict: Callable[[int], None] | None = None,
                 max_evictable: int | None = None, track_idle: bool = False) -> None:
        """``on_evict``: told each time a cached block's content is dropped;
        ``max_evictable``: most cached blocks nobody holds (None: all free blocks);
        ``track_idle``: remember blocks gone idle for ``take_idle``."""
        self.num_blocks = num_blocks
        self.caching = caching
        self.on_evict = on_evict
        self.max_evictable = max_evictable
        self.track_idle = track_idle
        self._free = list(range(num_blocks - 1, -1, -1))  # never used or content dropped
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unused: LRU first
        self._newly_idle: dict[int, None] = {}  # went evictable since take_idle
        self.stats = PrefixCacheStats()

    @property
    def num_used(self) -> int:
        """Blocks some sequence holds (cached blocks nobody holds are free to take)."""
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks whose content is known and can be found by a later prompt."""
        return len(self._by_hash)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks, or None (and nothing taken) when fewer are free; cached blocks
        nobody holds are evicted, least recently used first, when the free list is short."""
        if n > len(self._free) + len(self._evictable):
            return None
        cut = max(0, len(self._free) - n)  # (a negative start would slice from the end)
        taken = self._free[cut:]
        del self._free[cut:]
        while len(taken) < n:
            taken.append(self._evict())
        for b in taken:
            self._refs[b] = 1
        return taken

    def _evict(self) -> int:
        """The least recently used cached block nobody holds, its content dropped."""
        block, _ = self._evictable.popitem(last=False)
        del self._by_hash[self._hash_of.pop(block)]
        if self.on_evict is not None:
            self.on_evict(block)
        return block

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block (and empty ``blocks``)."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                    if self.track_idle:
                        self._newly_idle[b] = None
                else:
                    self._free.append(b)
        blocks.clear()
        self._trim()

    def take_idle(self) -> list[int]:
        """The cached blocks nobody holds that became so since the last call."""
        idle = [b for b in self._newly_idle if b in self._evictable]
        self._newly_idle.clear()
        return idle

    def limit_evictable(self, n: int) -> None:
        """Keep at most ``n`` cached blocks nobody holds (least recently used go now)."""
        self.max_evictable = n
        self._trim()

    def _trim(self) -> None:
        if self.max_evictable is not None:
            while len(self._evictable) > self.max_evictable:
                self._free.append(self._evict())

    def lookup(self, hashes: list[bytes], block_size: int, num_tokens: int) -> list[int]:
        """The cached blocks of the longest run of ``hashes`` (the full blocks of a prompt of
        ``num_tokens`` tokens, in order), each with a reference taken for the caller."""
        found: list[int] = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            found.append(b)
        for b in found:
            self._ref(b)
        self.stats.queries += num_tokens
        self.stats.hits += len(found) * block_size
        return found

    def cache(self, block: int, h: bytes) -> bool:
        """``block`` now holds the full block identified by ``h``; False when it stays
        private (a block with the same content is cached already and keeps its place)."""
        if h in self._by_hash or block in self._hash_of:
            return False
        self._by_hash[h] = block
        self._hash_of[block] = h
        return True

    def take(self, h: bytes) -> int | None:
        """The cached block ``h``, taken (one reference) and made private: its content is
        about to change (a kept partial block that a new sequence continues)."""
        b = self._by_hash.get(h)
        if b is None:
            return None
        self._ref(b)
        self.uncache(b)
        return b

    def _ref(self, block: int) -> None:
        """One more holder of cached ``block`` (no longer evictable)."""
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1

    def forget(self, block: int, h: bytes) -> bool:
        """Drop cached ``block`` if it still holds ``h`` and nobody holds it; True if so."""
        if self._hash_of.get(block) != h or self._refs[block]:
            return False
        del self._evictable[block]
        self.uncache(block)
        self._free.append(block)
        return True

    def uncache(self, block: int) -> None:
        """Forget a held block's content (its runner could not keep its KV): private again,
        freed as any other when its holders let go."""
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._by_hash[h]
