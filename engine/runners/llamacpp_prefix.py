"""Prefix caching on llama.cpp: the KV cells of the scheduler's cached blocks, kept alive
in "keeper" sequence ids and shared with a later sequence that finds them.

Why: llama.cpp keeps KV in its own cells, not in the scheduler's block table, and frees a
cell once no sequence id holds it. The scheduler's block hashes decide what is cached (as
on the torch runner); this module maps each cached block to cells llama.cpp keeps:

- When the scheduler caches block ``b`` at index ``i`` of a sequence (positions
  ``[i * bs, (i + 1) * bs)``), its cells are added to a keeper sequence id with
  ``llama_memory_seq_cp`` (the cells are shared, not copied: ~10-40 us).
- A keeper holds at most one block per index: ``llama_memory_seq_rm`` removes a sequence
  from every cell in a position range, so evicting ``b`` (``seq_rm(keeper, i * bs,
  (i + 1) * bs)``) must not touch another block. A block goes to its parent's keeper when
  that one is free at its index, so a prompt's chain usually sits in one keeper and a hit
  shares it in one call. With no keeper free at an index the block is not kept (the
  scheduler then leaves it private, not findable).
- A sequence that starts from cached blocks gets their cells into its own sequence id with
  ``seq_cp`` (runs of consecutive blocks in one keeper: one call) and computes the rest.

Cells stay accounted in blocks: a kept block is one the allocator counts (held or
evictable), and it leaves its keeper the moment the allocator evicts it, before the step
whose new tokens take its room.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Most cells of cached blocks no sequence holds. llama.cpp's attention (flash attention's
# CPU kernel, and the mask it builds each ubatch) walks every cell up to the highest one in
# use, masked or not, so kept cells that would otherwise be free cost every row of every
# step: with the whole 1 GiB default cache (~46,000 cells) kept, ~270 ns per cell per row
# (9 heads x 30 layers of a mask test) would add ~12 ms of work to each row where a
# one-row step takes ~8 ms (an estimate from the kernel, not measured: the machine was
# too busy). 2,048 cells hold a 1,500-token system prompt; measured 2026-11-26 (one round
# each, quiet machine): traffic with no shared prefix ran 0.90x caching off with 4,096 and
# 0.95x with 2,048.
MAX_IDLE_CELLS = 2048


class CellKeeper:
    """``engine.kv_cache.BlockKeeper`` for the llama.cpp runner."""

    def __init__(self, llama_cpp: Any, memory: Any, block_size: int, keepers: range,
                 slot_of: Callable[[int], int | None],
                 max_idle_cells: int = MAX_IDLE_CELLS,
                 pending: Callable[[int], bool] = lambda seq_id: False) -> None:
        """``keepers``: the llama.cpp sequence ids reserved for cached cells (beyond the
        running sequences'); ``slot_of``: the llama.cpp sequence id of an engine sequence;
        ``pending``: whether a sequence's KV is still being computed outside llama.cpp."""
        self.max_idle_blocks = max(1, max_idle_cells // block_size)
        self.lib = llama_cpp
        self.memory = memory
        self.block_size = block_size
        self.keepers = keepers
        self.slot_of = slot_of
        self.kv_pending = pending
        self._where: dict[int, tuple[int, int]] = {}  # block -> (keeper, index)
        self._used_at: dict[int, set[int]] = {}  # index -> keepers holding a block there

    @property
    def num_kept(self) -> int:
        return len(self._where)

    def keep(self, seq_id: int, block_table: list[int], index: int) -> bool:
        src = self.slot_of(seq_id)
        if src is None:
            return False
        keeper = self._free_keeper(index, block_table[index - 1] if index else None)
        if keeper is None:
            return False
        bs = self.block_size
        self.lib.llama_memory_seq_cp(self.memory, src, keeper, index * bs, (index + 1) * bs)
        self._where[block_table[index]] = (keeper, index)
        self._used_at.setdefault(index, set()).add(keeper)
        return True

    def evict(self, block: int) -> None:
        where = self._where.pop(block, None)
        if where is None:
            return
        keeper, index = where
        bs = self.block_size
        self.lib.llama_memory_seq_rm(self.memory, keeper, index * bs, (index + 1) * bs)
        self._used_at[index].discard(keeper)

    def share(self, blocks: list[int], dst: int) -> None:
        """Give llama.cpp sequence ``dst`` the cells of ``blocks`` (cached, at indices
        ``0 .. len(blocks) - 1``), one ``seq_cp`` per run of blocks in one keeper."""
        bs = self.block_size
        start = 0
        for i in range(1, len(blocks) + 1):
            if i < len(blocks) and self._where[blocks[i]][0] == self._where[blocks[start]][0]:
                continue
            keeper = self._where[blocks[start]][0]
            self.lib.llama_memory_seq_cp(self.memory, keeper, dst, start * bs, i * bs)
            start = i

    def _free_keeper(self, index: int, parent: int | None) -> int | None:
        """A keeper with no block at ``index``: the parent block's if it is free there."""
        used = self._used_at.get(index, ())
        if parent is not None and parent in self._where:
            keeper = self._where[parent][0]
            if keeper not in used:
                return keeper
        if len(used) >= len(self.keepers):
            return None
        return next(k for k in self.keepers if k not in used)
