"""Cached blocks no sequence uses, kept in host memory instead of llama.cpp's cells.

Why: llama.cpp's attention walks every cell up to the highest one in use, masked or not,
and its split-KV decode kernel (one row over 512+ cells) hands that range out to its
threads in contiguous pieces: idle cached cells inside the range make every step slower
(one row over 900 cells of its own 8.9-10 ms, 12.3-13.1 ms with a few idle cells kept
above them; measured 2026-11-26 on the default model), and they decide where a new
prompt's cells go. Copied out, they cost no step and bound nothing but host memory, so many
more prefixes stay cached than the cells could afford; a prompt that finds one gets it
back with ``llama_state_seq_set_data`` (~15 ms for 900 tokens on the default model)
instead of computing it.

Layout: llama.cpp's sequence state (src/llama-kv-cache.cpp ``state_write``): an 8-byte
header, the stream count, and per stream its cell count (0: nothing more for it; one stream
holds the sequence), each cell's (position, 1, sequence id), ``v_trans`` (0: flash
attention's V rows) and the layer count, per layer the K rows (type, row size, one row a
cell), per layer the V rows. A block is stored as its cells' rows of each of
those parts, in position order; a run of blocks is written back as one state. Anything
else (a transposed V, a second cache as sliding-window models have) is refused, and the
runner keeps idle blocks in its cells as before.
"""

from __future__ import annotations

import ctypes
import mmap
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

HEADER = 8  # bytes before the stream count (copied from the state llama.cpp wrote)
COPY_BYTES = 32 << 20  # blocks' bytes copied out of llama.cpp at a time (bounds the buffers)


class StateFormatError(ValueError):
    """A sequence state not laid out as this module reads it."""


@dataclass
class SeqState:
    """One stream's cells of a sequence state, each part's rows in the cells' order."""

    header: bytes
    positions: np.ndarray  # int32 [cells]
    kinds: list[tuple[int, int]]  # (ggml type, row bytes) of each K then V part
    parts: list[np.ndarray]  # uint8 [cells, row bytes] each
    # KV streams in the state: 1 in a unified cache; one per sequence id with a stream per
    # sequence (--kv-streams), all but the sequence's own written empty
    streams: int = 1


def parse_state(data: bytes | memoryview) -> SeqState:
    """Read a state ``llama_state_seq_get_data`` wrote for one sequence."""
    try:
        (n_stream,) = struct.unpack_from("<I", data, HEADER)
        off = HEADER + 4
        state = None
        for _ in range(n_stream):
            (cells,) = struct.unpack_from("<I", data, off)
            off += 4
            if not cells:  # a stream without the sequence: nothing else written for it
                continue
            if state is not None:
                raise StateFormatError("a sequence in several KV streams")
            state, off = _parse_stream(data, off, cells)
    except struct.error as e:
        raise StateFormatError(f"a state shorter than its layout ({e})") from None
    if off != len(data):
        raise StateFormatError(f"{len(data) - off} bytes after the layers (a second cache?)")
    if state is None:  # a sequence with no cells
        return SeqState(bytes(data[:HEADER]), np.zeros(0, np.int32), [], [], n_stream)
    positions, kinds, parts = state
    return SeqState(bytes(data[:HEADER]), positions, kinds, parts, n_stream)


def _parse_stream(data: bytes | memoryview, off: int, cells: int
                  ) -> tuple[tuple[np.ndarray, list[tuple[int, int]], list[np.ndarray]], int]:
    """One stream's ``cells`` cells from ``off`` on: (positions, kinds, parts), next offset."""
    meta = np.frombuffer(data, np.int32, 3 * cells, off).reshape(cells, 3)
    if (meta[:, 1] != 1).any():
        raise StateFormatError("a cell of several sequences")
    off += 12 * cells
    v_trans, n_layer = struct.unpack_from("<II", data, off)
    off += 8
    if v_trans:
        raise StateFormatError("transposed V rows (no flash attention)")
    kinds, parts = [], []
    for _ in range(2 * n_layer):
        kind, row = struct.unpack_from("<iQ", data, off)
        off += 12
        kinds.append((kind, row))
        parts.append(np.frombuffer(data, np.uint8, cells * row, off).reshape(cells, row))
        off += cells * row
    return (meta[:, 0].copy(), kinds, parts), off


def page_buffer(size: int, populate: bool = False) -> np.ndarray:
    """``size`` bytes of fresh memory, mapped as they are (np.empty asks large arrays for
    huge pages, and where the kernel has none to give, first touching them took ~4x as
    long here), touched now with ``populate``; given back when the array goes."""
    if not size:
        return np.empty(0, np.uint8)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if populate:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    return np.frombuffer(mmap.mmap(-1, size, flags=flags), dtype=np.uint8)


def grown(buf: np.ndarray, size: int) -> np.ndarray:
    """``buf`` when it holds ``size`` bytes, else a new buffer that does (kept by the
    caller for the next use: its pages are paid for once)."""
    return buf if buf.size >= size else page_buffer(size)


def empty_state(header: bytes, kinds: list[tuple[int, int]], positions: np.ndarray,
                streams: int = 1) -> tuple[np.ndarray, list[np.ndarray]]:
    """A state of cells at ``positions`` (one sequence) laid out in a new buffer, each
    part's ``[cells, row bytes]`` rows left for the caller to fill in place: no
    intermediate copies of a prompt's KV. With several ``streams`` the cells go in the
    first and the rest are empty: llama.cpp restores a sequence's state into the
    sequence's own stream whichever entry holds it (src/llama-kv-cache.cpp
    ``state_read``)."""
    n = len(positions)
    size = HEADER + 8 + 12 * n + 8 + sum(12 + n * row for _, row in kinds) \
        + 4 * (streams - 1)
    buf = page_buffer(size)
    buf[:HEADER] = np.frombuffer(header, np.uint8)
    buf[size - 4 * (streams - 1):] = 0  # the other streams' cell counts
    mem = buf.data
    struct.pack_into("<II", mem, HEADER, streams, n)
    off = HEADER + 8
    meta = buf[off:off + 12 * n].view(np.int32).reshape(n, 3)
    meta[:, 0], meta[:, 1], meta[:, 2] = positions, 1, 0
    off += 12 * n
    struct.pack_into("<II", mem, off, 0, len(kinds) // 2)
    off += 8
    parts = []
    for kind, row in kinds:
        struct.pack_into("<iQ", mem, off, kind, row)
        off += 12
        parts.append(buf[off:off + n * row].reshape(n, row))
        off += n * row
    return buf, parts


def write_state(header: bytes, kinds: list[tuple[int, int]], positions: np.ndarray,
                parts: list[np.ndarray], streams: int = 1) -> np.ndarray:
    """The state of cells at ``positions`` (one sequence) with each part's rows."""
    buf, rows = empty_state(header, kinds, positions, streams)
    for dst, src in zip(rows, parts, strict=True):
        dst[:] = src
    return buf


def get_state(llama_cpp: Any, ctx: Any, seq: int,
              alloc: Callable[[int], np.ndarray] = page_buffer) -> memoryview:
    """``seq``'s state as llama.cpp writes it, straight into a buffer of at least its size
    from ``alloc`` (no copy)."""
    size = llama_cpp.llama_state_seq_get_size(ctx, seq)
    buf = alloc(size)
    if llama_cpp.llama_state_seq_get_data(ctx, _ptr(buf), size, seq) != size:
        raise RuntimeError("llama.cpp did not write a sequence state")
    return buf[:size].data


def set_state(llama_cpp: Any, ctx: Any, seq: int, data: bytes | np.ndarray) -> bool:
    """False when llama.cpp has no run of consecutive free cells for it."""
    buf = np.frombuffer(data, dtype=np.uint8)  # read only by llama.cpp: no copy
    return llama_cpp.llama_state_seq_set_data(ctx, _ptr(buf), len(buf), seq) == len(buf)


def _ptr(buf: np.ndarray) -> Any:
    return buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


def available_memory() -> int | None:
    """Bytes of memory this process could still take: the kernel's ``MemAvailable``,
    within the cgroup's limit where one is set; None when neither can be read."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                room = int(limit) - int(f.read())
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail


def check_budget(nbytes: int, available: int | None) -> None:
    """The host tier's memory is taken at start: refuse a budget the machine cannot give
    (the kernel would kill the process while it starts, with no message)."""
    if available is not None and nbytes > available:
        raise ValueError(
            f"--prefix-cache-host-memory: {nbytes / 2**30:.2f} GiB for idle cached blocks "
            f"(allocated at start) is more than the {available / 2**30:.2f} GiB of memory "
            f"available; lower it, or 0 to keep idle cached blocks in llama.cpp's cells")


Range = tuple[int, int, int, int]  # (block, seq, index, cells): a block's cells in a sequence


def runs(ranges: list[Range]) -> list[tuple[int, int, int]]:
    """``(seq, first index, end index)`` of the consecutive indices of one sequence among
    ``ranges``: one llama.cpp call per run instead of one per block (each call walks every
    cell of the cache)."""
    out: list[tuple[int, int, int]] = []
    for _, seq, index, _ in sorted(ranges, key=lambda r: (r[1], r[2])):
        if out and out[-1][0] == seq and out[-1][2] == index:
            out[-1] = (seq, out[-1][1], index + 1)
        else:
            out.append((seq, index, index + 1))
    return out


class HostBlocks:
    """Blocks' KV rows in host memory, copied out of and back into llama.cpp's cells
    through a scratch sequence id no one else uses. A block is one slot of ``[bs, cell
    bytes]`` (each cell's bytes every part's row: K of each layer, then V).

    The slots are allocated and touched at start, ``capacity`` of them (the host budget),
    as vLLM allocates its CPU swap space: a block copied into memory never touched before
    pays for the pages as it goes (here ~0.1 ms a 370 KB block on a warm machine, up to
    ~0.9 ms where the VM backs its memory lazily: 3-15x the copy itself), and a new array
    per block would pay that on every copy-out. Reused slots cost only the copy."""

    SLAB = 64  # slots added at a time should blocks held by sequences outgrow ``capacity``

    def __init__(self, llama_cpp: Any, ctx: Any, memory: Any, block_size: int,
                 scratch: int, capacity: int, cell_bytes: int) -> None:
        self.lib = llama_cpp
        self.ctx = ctx
        self.memory = memory
        self.block_size = block_size
        self.scratch = scratch
        self.nbytes = 0
        self.cell_bytes = cell_bytes
        self._slot: dict[int, np.ndarray] = {}  # block -> its slot, uint8 [bs, cell bytes]
        self._count: dict[int, int] = {}  # block -> cells held (fewer: a partial block)
        self._free: list[np.ndarray] = list(self._slab(capacity))
        self._stage = np.empty(0, dtype=np.uint8)  # a copy-out's cells in position order
        self._state_buf = np.empty(0, dtype=np.uint8)  # llama.cpp's state of them
        self._header = b""
        self._streams = 1
        self._kinds: list[tuple[int, int]] = []
        self._cols: list[slice] = []  # each part's bytes within a cell's

    def _slab(self, n: int) -> np.ndarray:
        """``n`` slots in memory touched now."""
        size = n * self.block_size * self.cell_bytes
        return page_buffer(size, populate=True).reshape(n, self.block_size, self.cell_bytes)

    def __contains__(self, block: int) -> bool:
        return block in self._slot

    def __iter__(self) -> Iterator[int]:
        return iter(self._slot)

    def rows(self, block: int) -> list[np.ndarray]:
        """Each part's ``[cells, row bytes]`` rows of a block held here."""
        cells = self._slot[block][:self._count[block]]
        return [cells[:, c] for c in self._cols]

    def copy_out(self, ranges: list[Range]) -> None:
        """Copy blocks out of the cells of the sequences holding them: ``(block, seq,
        index, cells)`` each (``cells`` < block size: a partial last block, its first
        positions), at most one block an index (llama.cpp's state holds no sequence id,
        only positions), ``COPY_BYTES`` of them at a time through two buffers kept for
        the next copy. Raises ``StateFormatError`` on a layout this module does not read
        (the first batch: nothing stored)."""
        step = max(1, COPY_BYTES // (self.block_size * self.cell_bytes))
        ordered = sorted(ranges, key=lambda r: r[2])  # position order, as the state's
        for i in range(0, len(ordered), step):
            self._copy_out(ordered[i:i + step])

    def _state_buffer(self, size: int) -> np.ndarray:
        """Where llama.cpp writes the scratch sequence's state: a buffer kept for the next
        read (a new one each time paid for fresh pages: 7-120 ms for 3,000 cells)."""
        self._state_buf = grown(self._state_buf, size)
        return self._state_buf

    def _copy_out(self, ranges: list[Range]) -> None:
        bs, lib = self.block_size, self.lib
        for seq, lo, hi in runs(ranges):
            lib.llama_memory_seq_cp(self.memory, seq, self.scratch, lo * bs, hi * bs)
        try:
            state = parse_state(get_state(lib, self.ctx, self.scratch, self._state_buffer))
        finally:
            lib.llama_memory_seq_rm(self.memory, self.scratch, -1, -1)
        if len(state.positions) != sum(r[3] for r in ranges):
            raise StateFormatError(f"{len(state.positions)} cells for {len(ranges)} blocks")
        self._store(state, ranges)

    def copy_out_of(self, seq: int, ranges: list[Range]) -> None:
        """Copy blocks out of sequence ``seq``'s own state, no scratch sequence: with a KV
        stream per sequence (where a scratch sequence would take a whole stream) a
        sequence's state holds its cells alone. ``(block, seq, index, cells)`` each."""
        self._store(parse_state(get_state(self.lib, self.ctx, seq, self._state_buffer)),
                    ranges)

    def _store(self, state: SeqState, ranges: list[Range]) -> None:
        """Each range's cells (found by position in ``state``) into a slot of its own."""
        bs = self.block_size
        if state.kinds != self._kinds:
            ends = np.cumsum([0] + [row for _, row in state.kinds])
            if ends[-1] != self.cell_bytes:
                raise StateFormatError(f"cells of {ends[-1]} bytes where the runner counts "
                                       f"{self.cell_bytes}")
            if self._slot:
                raise StateFormatError("rows laid out unlike the blocks already held")
            self._cols = [slice(int(a), int(b))
                          for a, b in zip(ends[:-1], ends[1:], strict=True)]
        self._header, self._kinds, self._streams = state.header, state.kinds, state.streams
        positions = state.positions
        order = None if (np.diff(positions) > 0).all() else np.argsort(positions,
                                                                         kind="stable")
        if order is not None:
            positions = positions[order]
        picks = []
        for _, _, index, n in ranges:
            lo = int(np.searchsorted(positions, index * bs))
            if not np.array_equal(positions[lo:lo + n], np.arange(index * bs, index * bs + n)):
                raise StateFormatError(f"block {index}'s cells are not where expected")
            picks.append(np.arange(lo, lo + n) if order is None else order[lo:lo + n])
        idx = np.concatenate(picks) if picks else np.zeros(0, np.int64)
        whole = order is None and len(idx) == len(positions)  # all cells, in order
        width = self.cell_bytes
        self._stage = grown(self._stage, len(idx) * width)
        cells = self._stage[:len(idx) * width].reshape(len(idx), width)
        for part, cols in zip(state.parts, self._cols, strict=True):
            cells[:, cols] = part if whole else part[idx]
        start = 0
        for block, _, _, n in ranges:
            slot = self._take_slot()
            slot[:n] = cells[start:start + n]
            self._slot[block], self._count[block] = slot, n
            self.nbytes += n * width
            start += n

    def _take_slot(self) -> np.ndarray:
        if not self._free:
            self._free = list(self._slab(self.SLAB))
        return self._free.pop()

    def copy_in(self, blocks: list[int], first_index: int,
                place: Callable[[int, int], None]) -> None:
        """Write ``blocks`` (consecutive indices from ``first_index``; only the last may be
        partial) back into cells of the scratch sequence and call ``place(p0, p1)`` for each
        position range written, to ``seq_cp`` them where they belong before the next range
        replaces them. llama.cpp writes a state into one run of consecutive free cells: a
        run it has no room for is halved until it fits (one cell always does: the
        scheduler accounts for them)."""
        bs = self.block_size
        parts, n = self._run(blocks)
        pending = [(0, n)]
        try:
            while pending:
                lo, hi = pending.pop()
                positions = np.arange(first_index * bs + lo, first_index * bs + hi,
                                      dtype=np.int32)
                data = write_state(self._header, self._kinds, positions,
                                   [p[lo:hi] for p in parts], self._streams)
                if set_state(self.lib, self.ctx, self.scratch, data):
                    place(int(positions[0]), int(positions[-1]) + 1)
                elif hi - lo > 1:
                    mid = (lo + hi) // 2
                    pending += [(mid, hi), (lo, mid)]
                else:
                    raise RuntimeError("llama.cpp has no free cell for a cached block")
        finally:
            self.lib.llama_memory_seq_rm(self.memory, self.scratch, -1, -1)

    def _run(self, blocks: list[int]) -> tuple[list[np.ndarray], int]:
        """Each part's rows of ``blocks`` (only the last may be partial), and their cells."""
        bs = self.block_size
        assert all(self._count[b] == bs for b in blocks[:-1]), "a partial block inside a run"
        cells = np.concatenate([self._slot[b][:self._count[b]] for b in blocks])
        return [cells[:, c] for c in self._cols], len(cells)

    def write_into(self, blocks: list[int], seq: int) -> None:
        """``blocks`` (indices 0, 1, ...) become the whole state of sequence ``seq``, with
        one ``llama_state_seq_set_data``: with a KV stream per sequence a new sequence's
        stream is empty and holds a whole sequence, so the run always fits."""
        parts, n = self._run(blocks)
        data = write_state(self._header, self._kinds, np.arange(n, dtype=np.int32), parts,
                           self._streams)
        if not set_state(self.lib, self.ctx, seq, data):
            raise RuntimeError(f"llama.cpp could not write {n} cached cells into its "
                               f"sequence {seq}")

    def drop(self, block: int) -> None:
        slot = self._slot.pop(block, None)
        if slot is not None:
            self.nbytes -= self._count.pop(block) * self.cell_bytes
            self._free.append(slot)
