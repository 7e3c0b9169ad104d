"""The scheduler's view of the paged KV cache: block ids handed out by a free list.

A sequence holds ``ceil(tokens / block_size)`` blocks of its runner's cache (the torch
runner's tensors are in engine/runners/torch/kv_tensors.py). When the allocator runs dry
the scheduler preempts a sequence (recompute later).
"""

from __future__ import annotations


class BlockAllocator:
    """Free list of block ids. O(1) allocate/free; never hands out a block twice."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        return taken

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        blocks.clear()
