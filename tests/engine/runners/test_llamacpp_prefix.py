"""The llama.cpp runner's keeper of cached cells (engine/runners/llamacpp_prefix.py), on a
model of llama.cpp's cells: each has a position and the set of sequence ids holding it;
``seq_cp`` adds a sequence to cells, ``seq_rm`` takes it off (a cell no one holds is free).
No llama.cpp needed."""

from __future__ import annotations

import itertools

from engine.runners.llamacpp_prefix import CellKeeper

BS = 4
KEEPERS = range(10, 13)


class Cells:
    """llama.cpp's unified KV cells as far as ``llama_memory_seq_cp`` / ``_seq_rm`` go."""

    def __init__(self) -> None:
        self.cells: dict[int, tuple[int, set[int]]] = {}  # cell -> (position, sequences)
        self._ids = itertools.count()
        self.copies: list[tuple[int, int, int, int]] = []

    def decode(self, seq: int, positions: range) -> None:
        for p in positions:
            self.cells[next(self._ids)] = (p, {seq})

    def llama_memory_seq_cp(self, memory, src: int, dst: int, p0: int, p1: int) -> None:
        self.copies.append((src, dst, p0, p1))
        for pos, seqs in self.cells.values():
            if src in seqs and p0 <= pos < p1:
                seqs.add(dst)

    def llama_memory_seq_rm(self, memory, seq: int, p0: int, p1: int) -> None:
        p1 = p1 if p1 >= 0 else 1 << 30
        for cell, (pos, seqs) in list(self.cells.items()):
            if seq in seqs and (p0 < 0 or p0 <= pos < p1):
                seqs.discard(seq)
                if not seqs:
                    del self.cells[cell]

    def held(self, seq: int) -> dict[int, int]:
        """Position -> cell of every cell ``seq`` holds (one per position, or it fails)."""
        out: dict[int, int] = {}
        for cell, (pos, seqs) in self.cells.items():
            if seq in seqs:
                assert pos not in out, f"sequence {seq} holds two cells at position {pos}"
                out[pos] = cell
        return out


def keeper(cells: Cells, slots: dict[int, int], keepers: range = KEEPERS) -> CellKeeper:
    return CellKeeper(cells, None, BS, keepers, slots.get)


def compute(cells: Cells, k: CellKeeper, seq_id: int, slot: int, table: list[int]) -> None:
    """Sequence ``seq_id`` computes ``len(table)`` full blocks in ``slot``, each cached."""
    cells.decode(slot, range(len(table) * BS))
    for i in range(len(table)):
        assert k.keep(seq_id, table, i)


def test_a_prompts_cached_blocks_outlive_it_and_a_hit_shares_them_in_one_copy():
    cells, slots = Cells(), {7: 0}
    k = keeper(cells, slots)
    compute(cells, k, 7, 0, [5, 6, 8])
    prompt_cells = cells.held(0)
    cells.llama_memory_seq_rm(None, 0, -1, -1)  # the sequence finishes
    assert cells.held(0) == {} and len(cells.cells) == 3 * BS  # the keeper holds them
    cells.copies.clear()
    k.share([5, 6], dst=1)  # a later prompt shares two of the three blocks
    assert cells.held(1) == {p: c for p, c in prompt_cells.items() if p < 2 * BS}
    assert len(cells.copies) == 1  # the chain sits in one keeper: one seq_cp


def test_blocks_at_the_same_index_go_to_different_keepers_and_eviction_is_exact():
    cells, slots = Cells(), {1: 0, 2: 1}
    k = keeper(cells, slots)
    compute(cells, k, 1, 0, [10, 11])  # prompt A
    compute(cells, k, 2, 1, [20, 21])  # prompt B: other tokens from block 0 on
    a, b = cells.held(0), cells.held(1)
    for slot in (0, 1):
        cells.llama_memory_seq_rm(None, slot, -1, -1)
    k.evict(11)  # A's second block: only its cells go
    assert set(cells.cells) == set(a.values()) - {a[p] for p in range(BS, 2 * BS)} | set(
        b.values())
    k.share([20, 21], dst=2)
    assert cells.held(2) == b
    # a prompt sharing B's first block computes another second one: with both keepers free
    # at index 1 it joins its parent's, so a hit on it is one copy again
    k.evict(21)
    slots[4] = 4
    k.share([20], dst=4)
    cells.decode(4, range(BS, 2 * BS))
    assert k.keep(4, [20, 22], 1)
    cells.copies.clear()
    k.share([20, 22], dst=5)
    assert len(cells.copies) == 1


def test_a_block_with_no_keeper_free_at_its_index_is_not_kept():
    cells, slots = Cells(), {i: i for i in range(3)}
    k = keeper(cells, slots, keepers=range(10, 12))
    for i in range(2):
        compute(cells, k, i, i, [100 + i])
    cells.decode(2, range(BS))
    before = dict(cells.cells)
    assert not k.keep(2, [102], 0)  # both keepers hold a block at index 0
    assert cells.cells == before and k.num_kept == 2
    k.evict(100)
    assert k.keep(2, [102], 0)  # room again


# ---- idle blocks in host memory ------------------------------------------------------

SCRATCH = 99


class Host:
    """``HostBlocks`` on the model of cells: a block's "rows" are the cells' positions it
    held; written back, they become new cells of the scratch sequence, placed in pieces of
    at most ``piece`` positions (llama.cpp finding no longer run of free cells)."""

    def __init__(self, cells: Cells, piece: int = 1 << 30) -> None:
        self.cells, self.piece, self.scratch = cells, piece, SCRATCH
        self.nbytes = 0
        self._rows: dict[int, list[int]] = {}

    def __contains__(self, block: int) -> bool:
        return block in self._rows

    def __iter__(self):
        return iter(self._rows)

    def copy_out(self, ranges: list[tuple[int, int, int, int]]) -> None:
        for block, seq, index, n in ranges:
            held = self.cells.held(seq)
            self._rows[block] = [p for p in range(index * BS, (index + 1) * BS) if p in held]
            assert len(self._rows[block]) == n

    def copy_in(self, blocks: list[int], first_index: int, place) -> None:
        positions = [p for b in blocks for p in self._rows[b]]
        assert positions == list(range(first_index * BS, first_index * BS + len(positions)))
        for i in range(0, len(positions), self.piece):
            self.cells.llama_memory_seq_rm(None, SCRATCH, -1, -1)
            piece = positions[i:i + self.piece]
            self.cells.decode(SCRATCH, range(piece[0], piece[-1] + 1))
            place(piece[0], piece[-1] + 1)
        self.cells.llama_memory_seq_rm(None, SCRATCH, -1, -1)

    def drop(self, block: int) -> None:
        self._rows.pop(block, None)


def host_keeper(cells: Cells, slots: dict[int, int], keepers: range = KEEPERS,
                piece: int = 1 << 30) -> CellKeeper:
    return CellKeeper(cells, None, BS, keepers, slots.get,
                      host=Host(cells, piece), host_blocks=64)  # type: ignore[arg-type]


def test_idle_blocks_leave_the_cells_and_a_hit_gets_them_back_from_host_memory():
    cells, slots = Cells(), {7: 0}
    k = host_keeper(cells, slots)
    assert not k.idle_blocks_cost_steps and k.max_idle_blocks == 64
    compute(cells, k, 7, 0, [5, 6, 8])
    cells.llama_memory_seq_rm(None, 0, -1, -1)  # the sequence finishes
    k.demote([6, 8])  # block 5 is still someone's: it stays in its keeper's cells
    assert sorted(p for p, _ in cells.cells.values()) == list(range(BS))
    assert set(k.host) == {6, 8} and k.num_kept == 3
    k.share([5, 6, 8], dst=1)
    assert sorted(cells.held(1)) == list(range(3 * BS))  # one cell a position, none missing
    assert set(k.host) == set()  # back in a keeper each: the host copies went
    cells.llama_memory_seq_rm(None, 1, -1, -1)
    for b in (5, 6, 8):
        k.evict(b)
    assert cells.cells == {}  # every kept cell freed


def test_a_run_written_back_in_pieces_and_a_block_with_no_keeper_free_stays_in_host_memory():
    cells, slots = Cells(), {1: 0, 2: 1}
    k = host_keeper(cells, slots, keepers=range(10, 11), piece=3)  # one keeper
    compute(cells, k, 1, 0, [10, 11])
    cells.llama_memory_seq_rm(None, 0, -1, -1)
    k.demote([10, 11])
    compute(cells, k, 2, 1, [20])  # another prompt's block takes the keeper at index 0
    k.share([10, 11], dst=2)  # pieces of 3 positions: 4 writes for 8 positions
    assert sorted(cells.held(2)) == list(range(2 * BS))
    assert 10 in k.host and 11 not in k.host  # index 0 had no keeper free: kept in host
    cells.llama_memory_seq_rm(None, 2, -1, -1)
    k.share([10, 11], dst=3)  # found again: 10 from host memory, 11 from its keeper
    assert sorted(cells.held(3)) == list(range(2 * BS))
    assert cells.held(SCRATCH) == {}


def test_an_idle_partial_block_leaves_the_cells_and_a_continuing_sequence_gets_it_back():
    cells, slots = Cells(), {1: 0}
    k = host_keeper(cells, slots)
    compute(cells, k, 1, 0, [10, 11])
    cells.decode(0, range(2 * BS, 2 * BS + 3))  # 3 computed tokens of a third block
    assert k.keep_tail(1, [10, 11, 12], 2, 3)
    cells.llama_memory_seq_rm(None, 0, -1, -1)  # the sequence finishes
    k.demote([10, 11, 12])  # idle, tail too: no cell stays taken
    assert cells.cells == {} and set(k.host) == {10, 11, 12} and k.num_kept == 2
    k.share([10, 11], dst=3)  # a continuing prompt: the full blocks, then the tail
    k.grant_tail(2, 12)
    k.take_grant(2, dst=3)
    assert sorted(cells.held(3)) == list(range(2 * BS + 3))
    assert 12 not in k.host and k._grants == {}
    assert cells.held(SCRATCH) == {}


def test_a_partial_block_in_host_memory_goes_when_evicted_or_its_grant_is_dropped():
    cells, slots = Cells(), {1: 0, 2: 1}
    k = host_keeper(cells, slots)
    for seq, slot, block in ((1, 0, 20), (2, 1, 21)):
        cells.decode(slot, range(2))
        assert k.keep_tail(seq, [block], 0, 2)
        cells.llama_memory_seq_rm(None, slot, -1, -1)
    k.demote([20, 21])
    k.evict(20)
    k.grant_tail(5, 21)
    k.forget_grant(5)  # granted, then not scheduled after all
    assert set(k.host) == set() and cells.cells == {}
