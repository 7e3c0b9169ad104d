"""The llama.cpp runner's host tier (``HostBlocks``) against a model of llama.cpp's cells
and sequence states: rows go out and come back byte for byte, in position order whatever
order llama.cpp writes its cells in, with one call per run of a sequence's blocks."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from engine.runners.llamacpp_host_blocks import (
    HostBlocks,
    StateFormatError,
    available_memory,
    check_budget,
    parse_state,
    runs,
    write_state,
)

BS = 4
LAYERS = 2
ROW = 6  # bytes of each K and V row
KINDS = [(1, ROW)] * (2 * LAYERS)
HEADER = b"GGSQ\x02\x00\x00\x00"
SCRATCH = 9


class Cells:
    """llama.cpp's memory as far as the host tier uses it: each sequence's positions and
    each position's rows (one per K and V part); a state lists a sequence's cells in the
    order ``order`` puts them (llama.cpp writes them in cell order, not position order)."""

    def __init__(self, order=lambda positions: positions) -> None:
        self.seqs: dict[int, dict[int, list[bytes]]] = {}
        self.order = order
        self.calls: list[str] = []

    def put(self, seq: int, positions: range) -> None:
        rng = np.random.default_rng(seq)
        for p in positions:
            self.seqs.setdefault(seq, {})[p] = [rng.bytes(ROW) for _ in KINDS]

    def llama_memory_seq_cp(self, memory, src, dst, p0, p1) -> None:
        self.calls.append("seq_cp")
        for p, rows in self.seqs.get(src, {}).items():
            if p0 <= p < p1:
                self.seqs.setdefault(dst, {})[p] = rows

    def llama_memory_seq_rm(self, memory, seq, p0, p1) -> None:
        self.calls.append("seq_rm")
        held = self.seqs.get(seq, {})
        for p in [p for p in held if p0 < 0 or p0 <= p < p1]:
            del held[p]

    def _state(self, seq: int) -> bytes:
        positions = np.array(self.order(sorted(self.seqs.get(seq, {}))), dtype=np.int32)
        parts = [np.frombuffer(b"".join(self.seqs[seq][int(p)][i] for p in positions),
                               np.uint8).reshape(len(positions), ROW)
                 for i in range(len(KINDS))]
        return write_state(HEADER, KINDS, positions, parts).tobytes()

    def llama_state_seq_get_size(self, ctx, seq) -> int:
        return len(self._state(seq))

    def llama_state_seq_get_data(self, ctx, buf, size, seq) -> int:
        data = self._state(seq)
        ctypes.memmove(buf, data, len(data))
        return len(data)

    def llama_state_seq_set_data(self, ctx, buf, size, seq) -> int:
        state = parse_state(ctypes.string_at(buf, size))
        for i, p in enumerate(state.positions):
            self.seqs.setdefault(seq, {})[int(p)] = [bytes(part[i]) for part in state.parts]
        return size


def host(cells: Cells, capacity: int = 8, cell_bytes: int = ROW * len(KINDS)) -> HostBlocks:
    return HostBlocks(cells, None, None, BS, SCRATCH, capacity=capacity,
                      cell_bytes=cell_bytes)


def test_runs_group_consecutive_indices_of_one_sequence():
    ranges = [(10, 1, 0, BS), (11, 1, 1, BS), (12, 2, 2, BS), (13, 1, 2, BS), (14, 1, 4, 1)]
    assert runs(ranges) == [(1, 0, 3), (1, 4, 5), (2, 2, 3)]


@pytest.mark.parametrize("order", [lambda ps: ps, lambda ps: ps[::-1],
                                   lambda ps: ps[1::2] + ps[::2]],
                         ids=["in-order", "reversed", "interleaved"])
def test_blocks_go_out_and_come_back_byte_for_byte_whatever_the_cell_order(order):
    cells = Cells(order)
    cells.put(1, range(0, 3 * BS))  # a sequence's blocks 0, 1, 2
    cells.put(2, range(3 * BS, 4 * BS))  # another's block 3
    want = {p: cells.seqs[1 if p < 3 * BS else 2][p] for p in range(4 * BS)}
    h = host(cells)
    h.copy_out([(100, 1, 0, BS), (101, 1, 1, BS), (102, 1, 2, BS), (103, 2, 3, BS)])
    assert SCRATCH not in cells.seqs or not cells.seqs[SCRATCH]  # the scratch let go
    for block, first in ((100, 0), (101, BS), (102, 2 * BS), (103, 3 * BS)):
        rows = h.rows(block)
        for i in range(BS):
            assert [bytes(r[i]) for r in rows] == want[first + i]
    assert h.nbytes == 4 * BS * ROW * len(KINDS)
    placed: list[tuple[int, int]] = []
    cells.seqs[1].clear()
    h.copy_in([100, 101, 102, 103], 0, lambda p0, p1: (
        placed.append((p0, p1)), cells.llama_memory_seq_cp(None, SCRATCH, 5, p0, p1)))
    assert placed == [(0, 4 * BS)]
    assert cells.seqs[5] == want


def test_consecutive_blocks_of_a_sequence_are_copied_in_one_call():
    cells = Cells()
    cells.put(1, range(0, 5 * BS))
    h = host(cells)
    h.copy_out([(100 + i, 1, i, BS) for i in range(5)])
    assert cells.calls.count("seq_cp") == 1


def test_slots_are_reused_and_added_past_the_capacity():
    cells = Cells()
    cells.put(1, range(0, 3 * BS))
    h = host(cells, capacity=2)
    h.copy_out([(100, 1, 0, BS), (101, 1, 1, BS), (102, 1, 2, BS)])  # one more than the capacity
    assert set(h) == {100, 101, 102}
    h.drop(100)
    h.drop(100)  # dropping twice frees one slot once
    assert h.nbytes == 2 * BS * ROW * len(KINDS)
    cells.put(3, range(0, BS))
    h.copy_out([(200, 3, 0, BS)])
    assert [bytes(r[0]) for r in h.rows(200)] == cells.seqs[3][0]
    assert [bytes(r[0]) for r in h.rows(101)] == cells.seqs[1][BS]  # untouched


def test_cells_unlike_the_runners_count_are_refused_and_nothing_is_stored():
    cells = Cells()
    cells.put(1, range(0, BS))
    h = host(cells, cell_bytes=ROW * len(KINDS) + 2)
    with pytest.raises(StateFormatError, match="cells of 24 bytes where the runner counts 26"):
        h.copy_out([(100, 1, 0, BS)])
    assert list(h) == [] and h.nbytes == 0


def test_a_partial_last_block_goes_out_with_its_run_and_comes_back_alone_or_after_it():
    cells = Cells(lambda ps: ps[::-1])
    cells.put(1, range(0, 2 * BS + 3))  # two full blocks and 3 cells of a third
    want = dict(cells.seqs[1])
    h = host(cells)
    h.copy_out([(100, 1, 0, BS), (101, 1, 1, BS), (102, 1, 2, 3)])
    assert cells.calls.count("seq_cp") == 1  # the run's whole range: the tail's 3 cells
    assert h.nbytes == (2 * BS + 3) * ROW * len(KINDS)
    assert [len(r) for r in h.rows(102)] == [3] * len(KINDS)
    h.copy_in([100, 101, 102], 0, lambda p0, p1: cells.llama_memory_seq_cp(
        None, SCRATCH, 5, p0, p1))
    assert cells.seqs[5] == want
    h.copy_in([102], 2, lambda p0, p1: cells.llama_memory_seq_cp(None, SCRATCH, 6, p0, p1))
    assert cells.seqs[6] == {p: want[p] for p in range(2 * BS, 2 * BS + 3)}
    h.drop(102)
    assert h.nbytes == 2 * BS * ROW * len(KINDS)


def test_cells_missing_from_a_block_are_refused():
    cells = Cells()
    cells.put(1, range(0, BS - 1))  # a block said to be full has a cell missing
    h = host(cells)
    with pytest.raises(StateFormatError, match="3 cells for 1 blocks"):
        h.copy_out([(100, 1, 0, BS)])
    assert list(h) == []


def test_a_host_budget_larger_than_the_memory_available_is_refused_naming_the_flag():
    check_budget(1 << 30, 2 << 30)
    check_budget(1 << 30, None)  # unknown: allowed
    with pytest.raises(ValueError, match=r"--prefix-cache-host-memory: 3.00 GiB .* more than "
                                         r"the 2.00 GiB of memory available"):
        check_budget(3 << 30, 2 << 30)


def test_the_memory_available_is_read_from_this_machine():
    avail = available_memory()
    assert avail is not None and avail > 0


def test_many_blocks_are_copied_out_in_batches_of_bounded_bytes(monkeypatch):
    import engine.runners.llamacpp_host_blocks as hb

    monkeypatch.setattr(hb, "COPY_BYTES", 2 * BS * ROW * len(KINDS))  # two blocks a batch
    cells = Cells(lambda ps: ps[::-1])
    cells.put(1, range(0, 4 * BS + 2))
    want = dict(cells.seqs[1])
    h = host(cells)
    h.copy_out([(100 + i, 1, i, BS) for i in range(4)] + [(104, 1, 4, 2)])
    assert cells.calls.count("seq_cp") == 3  # 2 + 2 + 1 blocks
    h.copy_in([100 + i for i in range(5)], 0, lambda p0, p1: cells.llama_memory_seq_cp(
        None, SCRATCH, 5, p0, p1))
    assert cells.seqs[5] == want


def test_a_state_with_a_stream_per_sequence_is_read_and_written_in_that_layout():
    """--kv-streams: llama.cpp writes a sequence's state with every stream's cell count,
    the sequence's cells under its own stream (here the third of four) and nothing under
    the others; it is read as that sequence's cells, written back with the same stream
    count, and a sequence in two streams is refused."""
    rng = np.random.default_rng(0)
    positions = np.arange(5, 11, dtype=np.int32)
    parts = [np.frombuffer(rng.bytes(len(positions) * ROW), np.uint8).reshape(-1, ROW)
             for _ in KINDS]
    one = write_state(HEADER, KINDS, positions, parts).tobytes()
    body = one[len(HEADER) + 4:]  # this stream's cell count and cells
    empty = (0).to_bytes(4, "little")
    data = HEADER + (4).to_bytes(4, "little") + empty * 2 + body + empty
    state = parse_state(data)
    assert state.streams == 4 and state.header == HEADER
    assert (state.positions == positions).all()
    assert all((a == b).all() for a, b in zip(state.parts, parts, strict=True))
    again = parse_state(write_state(HEADER, KINDS, positions, parts, streams=4).tobytes())
    assert again.streams == 4 and (again.positions == positions).all()
    assert all((a == b).all() for a, b in zip(again.parts, parts, strict=True))
    with pytest.raises(StateFormatError, match="several KV streams"):
        parse_state(HEADER + (2).to_bytes(4, "little") + body + body)
