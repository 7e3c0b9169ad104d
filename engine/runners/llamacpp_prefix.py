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

With a host tier (``llamacpp_host_blocks.py``, on by default) a cached block no sequence
holds leaves the cells at the next step that runs anything: its rows are copied to host
memory and its keeper lets go (``demote``); a sequence that finds it gets it written back
(``share``). Such blocks then cost llama.cpp's steps nothing, so the scheduler keeps as
many as the host budget holds instead of a few cells' worth. A kept partial last block
(``keep_tail``) goes the same way, and comes back into the sequence granted it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from engine.runners.llamacpp_host_blocks import HostBlocks, StateFormatError, runs

log = logging.getLogger(__name__)

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
                 pending: Callable[[int], bool] = lambda seq_id: False,
                 host: HostBlocks | None = None, host_blocks: int = 0) -> None:
        """``keepers``: the llama.cpp sequence ids reserved for cached cells (beyond the
        running sequences'); ``slot_of``: the llama.cpp sequence id of an engine sequence;
        ``pending``: whether a sequence's KV is still being computed outside llama.cpp;
        ``host``: where idle blocks go, ``host_blocks`` of them at most."""
        self.host = host
        self.demoting = host is not None  # off if llama.cpp's state is not as expected
        self.max_idle_blocks = host_blocks if host else max(1, max_idle_cells // block_size)
        self._cell_idle_blocks = max(1, max_idle_cells // block_size)
        self.lib = llama_cpp
        self.memory = memory
        self.block_size = block_size
        self.keepers = keepers
        self.slot_of = slot_of
        self.kv_pending = pending
        self._where: dict[int, tuple[int, int]] = {}  # block -> (keeper, index)
        # partial last blocks (``keep_tail``) in cells: block -> (keeper, index, cells);
        # with a host tier they leave the cells when idle as full blocks do
        self._tails: dict[int, tuple[int, int, int]] = {}
        self._host_tails: dict[int, int] = {}  # block -> index, of tails in host memory
        # engine seq id -> a granted tail: (block, keeper or None if in host, index)
        self._grants: dict[int, tuple[int, int | None, int]] = {}
        self._used_at: dict[int, set[int]] = {}  # index -> keepers holding a block there

    @property
    def num_kept(self) -> int:
        """Full blocks whose KV is kept (in cells or in host memory)."""
        return len(self._where.keys() | set(self.host or ())) - len(self._host_tails)

    @property
    def host_bytes(self) -> int:
        return self.host.nbytes if self.host is not None else 0

    @property
    def idle_blocks_cost_steps(self) -> bool:
        """Whether idle blocks stay in llama.cpp's cells (see ``BlockKeeper``)."""
        return not self.demoting

    def keep(self, seq_id: int, block_table: list[int], index: int) -> bool:
        keeper = self._copy_to_keeper(seq_id, block_table, index)
        if keeper is None:
            return False
        self._hold(block_table[index], keeper, index)
        return True

    def keep_tail(self, seq_id: int, block_table: list[int], index: int, n: int) -> bool:
        """The first ``n`` cells of the partial block at ``index`` (its computed tokens;
        cells past them may hold rejected speculative proposals) go to a keeper free
        there."""
        keeper = self._copy_to_keeper(seq_id, block_table, index, n)
        if keeper is None:
            return False
        self._tails[block_table[index]] = (keeper, index, n)
        self._used_at.setdefault(index, set()).add(keeper)
        return True

    def _copy_to_keeper(self, seq_id: int, block_table: list[int], index: int,
                        n: int | None = None) -> int | None:
        """Share ``seq_id``'s cells at block ``index`` (its first ``n`` positions, None =
        all) with a keeper free there; which."""
        src = self.slot_of(seq_id)
        if src is None:
            return None
        keeper = self._free_keeper(index, block_table[index - 1] if index else None)
        if keeper is None:
            return None
        bs = self.block_size
        end = (index + 1) * bs if n is None else index * bs + n
        self.lib.llama_memory_seq_cp(self.memory, src, keeper, index * bs, end)
        return keeper

    def grant_tail(self, seq_id: int, block: int) -> None:
        if block in self._tails:
            keeper, index, _ = self._tails.pop(block)
            self._grants[seq_id] = (block, keeper, index)
        else:
            self._grants[seq_id] = (block, None, self._host_tails.pop(block))

    def take_grant(self, seq_id: int, dst: int) -> None:
        """A new llama.cpp sequence ``dst`` for ``seq_id`` gets its granted tail's cells
        (from a keeper, or written back from host memory)."""
        grant = self._grants.pop(seq_id, None)
        if grant is None:
            return
        block, keeper, index = grant
        bs = self.block_size
        if keeper is not None:
            self.lib.llama_memory_seq_cp(self.memory, keeper, dst, index * bs,
                                         (index + 1) * bs)
            self._release(keeper, index)
            return
        assert self.host is not None
        scratch = self.host.scratch
        self.host.copy_in([block], index, lambda p0, p1: self.lib.llama_memory_seq_cp(
            self.memory, scratch, dst, p0, p1))
        self.host.drop(block)

    def forget_grant(self, seq_id: int) -> None:
        grant = self._grants.pop(seq_id, None)
        if grant is None:
            return
        block, keeper, index = grant
        if keeper is not None:
            self._release(keeper, index)
        elif self.host is not None:
            self.host.drop(block)

    def _hold(self, block: int, keeper: int, index: int) -> None:
        self._where[block] = (keeper, index)
        self._used_at.setdefault(index, set()).add(keeper)

    def evict(self, block: int) -> None:
        if block in self._tails:
            keeper, index, _ = self._tails.pop(block)
            self._release(keeper, index)
            return
        if self.host is not None:
            self.host.drop(block)
            self._host_tails.pop(block, None)
        where = self._where.pop(block, None)
        if where is None:
            return
        keeper, index = where
        self._release(keeper, index)

    def _release(self, keeper: int, index: int, end: int | None = None) -> None:
        """``keeper`` lets go of its blocks at ``index`` (up to ``end``, one call)."""
        bs = self.block_size
        end = index + 1 if end is None else end
        self.lib.llama_memory_seq_rm(self.memory, keeper, index * bs, end * bs)
        for i in range(index, end):
            self._used_at[i].discard(keeper)

    def demote(self, blocks: list[int]) -> None:
        """``blocks`` are idle (cached, held by no sequence) and a step is about to run:
        with a host tier their rows move to host memory and their cells are freed (partial
        last blocks too: wherever their few cells lie, llama.cpp's attention walks every
        cell below them; a chat's decoding after a burst of other requests ran ~15%
        slower with 16 of them left above its own cells)."""
        if self.host is None or not self.demoting:
            return
        by_keeper: dict[int, list[tuple[int, int, int, int]]] = {}
        bs = self.block_size
        for b in blocks:
            if b in self._where:
                keeper, index = self._where[b]
                by_keeper.setdefault(keeper, []).append((b, keeper, index, bs))
            elif b in self._tails:
                keeper, index, n = self._tails[b]
                by_keeper.setdefault(keeper, []).append((b, keeper, index, n))
        for keeper, ranges in by_keeper.items():
            try:
                self.host.copy_out(ranges)
            except StateFormatError as e:
                log.warning("llama.cpp runner: idle cached blocks stay in llama.cpp's cells "
                            "(its sequence state is not laid out as expected: %s)", e)
                self.demoting = False
                self.max_idle_blocks = self._cell_idle_blocks
                return
            for block, _, index, _ in ranges:
                if self._where.pop(block, None) is None:
                    del self._tails[block]
                    self._host_tails[block] = index
            for _, lo, hi in runs(ranges):
                self._release(keeper, lo, hi)

    def share(self, blocks: list[int], dst: int, seq_id: int | None = None) -> None:
        """Give llama.cpp sequence ``dst`` the cells of ``blocks`` (cached, at indices
        ``0 .. len(blocks) - 1``), then the tail granted to ``seq_id``: blocks in host
        memory are written back first (each into a keeper when one is free at its index),
        then one ``seq_cp`` per run of blocks in one keeper."""
        bs = self.block_size
        given: set[int] = set()
        if self.host is not None:
            start = None
            for i in range(len(blocks) + 1):
                away = i < len(blocks) and blocks[i] not in self._where
                if away and start is None:
                    start = i
                elif not away and start is not None:
                    given |= self._restore(blocks, start, i, dst)
                    start = None
        keepers = [None if b in given else self._where[b][0] for b in blocks]
        start = 0
        for i in range(1, len(blocks) + 1):
            if i < len(blocks) and keepers[i] == keepers[start]:
                continue
            keeper = keepers[start]
            if keeper is not None:
                self.lib.llama_memory_seq_cp(self.memory, keeper, dst, start * bs, i * bs)
            start = i
        if seq_id is not None:
            self.take_grant(seq_id, dst)

    def _restore(self, blocks: list[int], start: int, end: int, dst: int) -> set[int]:
        """Write ``blocks[start:end]`` back from host memory into ``dst`` and, where one is
        free at their index, a keeper (the host copy then goes; a block with no keeper
        keeps it and stays findable); returns those blocks, now ``dst``'s."""
        assert self.host is not None
        bs = self.block_size
        run = blocks[start:end]
        homes: list[int | None] = []
        for i, b in enumerate(run, start):
            keeper = self._free_keeper(i, blocks[i - 1] if i else None)
            homes.append(keeper)
            if keeper is not None:  # taken now, so the next block's parent finds it
                self._hold(b, keeper, i)
        scratch = self.host.scratch

        def place(p0: int, p1: int) -> None:
            self.lib.llama_memory_seq_cp(self.memory, scratch, dst, p0, p1)
            for i in range(p0 // bs, (p1 - 1) // bs + 1):
                keeper = homes[i - start]
                if keeper is not None:
                    self.lib.llama_memory_seq_cp(self.memory, scratch, keeper,
                                                 max(p0, i * bs), min(p1, (i + 1) * bs))

        self.host.copy_in(run, start, place)
        for b, keeper in zip(run, homes, strict=True):
            if keeper is not None:
                self.host.drop(b)
        return set(run)

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
