"""Prefix caching with a KV stream per sequence (``--kv-streams``): a cached block's KV
lives in the stream of the sequence that computed it while that sequence runs, and in host
memory after; a sequence that finds cached blocks gets them written into its own stream.

Why not keepers (``llamacpp_prefix.py``): llama.cpp shares cells between sequence ids only
within one stream. Across streams ``llama_memory_seq_cp`` copies a whole stream (and
asserts on a position range), and a keeper id would take a whole stream's memory. So
cached KV moves by value:

- When a sequence is released (finished, aborted, preempted), the blocks it cached and no
  one has copied yet go to host memory with one ``llama_state_seq_get_data`` of its stream
  (``HostBlocks.copy_out_of``), before the stream is cleared.
- A new sequence that starts from cached blocks gets them, and a kept partial block after
  them (a chat's previous answer), as its stream's whole state with one
  ``llama_state_seq_set_data`` (~15 ms for 900 tokens on the default model): its stream is
  empty and holds a whole sequence, so the write always fits. A block found while the
  sequence that computed it still runs (``n > 1`` samples, concurrent requests with one
  system prompt) is first copied out of that sequence's stream (``stage``), before the step
  moves any stream (``LlamaCppRunner._pack_streams``: a moved stream is copied only at the
  next decode, so reading it in between would read an empty one).

Idle cached blocks are in host memory only, so they cost llama.cpp's steps nothing and as
many stay cached as the host budget holds (``--prefix-cache-host-memory``).
"""

from __future__ import annotations

from collections.abc import Callable

from engine.runners.llamacpp_host_blocks import HostBlocks


class StreamKeeper:
    """``engine.kv_cache.BlockKeeper`` for the llama.cpp runner with a stream per sequence."""

    def __init__(self, host: HostBlocks, slot_of: Callable[[int], int | None],
                 host_blocks: int, pending: Callable[[int], bool] = lambda seq_id: False
                 ) -> None:
        """``slot_of``: the llama.cpp sequence id (stream) of an engine sequence;
        ``pending``: whether a sequence's KV is still being computed outside llama.cpp."""
        self.host = host
        self.max_idle_blocks = host_blocks
        self.slot_of = slot_of
        self.kv_pending = pending
        # blocks cached from a running sequence's stream and not copied out yet:
        # engine seq id -> {block: (index, cells)}, and each such block's sequence
        self._live: dict[int, dict[int, tuple[int, int]]] = {}
        self._owner: dict[int, int] = {}
        self._grants: dict[int, int] = {}  # engine seq id -> granted tail (in host memory)

    @property
    def idle_blocks_cost_steps(self) -> bool:
        return False  # idle blocks are in host memory, not in any stream

    @property
    def host_bytes(self) -> int:
        return self.host.nbytes

    @property
    def num_kept(self) -> int:
        """Blocks whose KV is kept (in a running sequence's stream or in host memory)."""
        return len(self._owner.keys() | set(self.host))

    def keep(self, seq_id: int, block_table: list[int], index: int) -> bool:
        return self._note(seq_id, block_table[index], index, self.host.block_size)

    def keep_tail(self, seq_id: int, block_table: list[int], index: int, n: int) -> bool:
        """The first ``n`` positions of the partial block at ``index`` (its computed
        tokens; later cells may hold rejected speculative proposals)."""
        return self._note(seq_id, block_table[index], index, n)

    def _note(self, seq_id: int, block: int, index: int, n: int) -> bool:
        if self.slot_of(seq_id) is None:
            return False
        self._live.setdefault(seq_id, {})[block] = (index, n)
        self._owner[block] = seq_id
        return True

    def grant_tail(self, seq_id: int, block: int) -> None:
        self._grants[seq_id] = block

    def forget_grant(self, seq_id: int) -> None:
        block = self._grants.pop(seq_id, None)
        if block is not None:
            self.evict(block)

    def evict(self, block: int) -> None:
        self.host.drop(block)
        seq_id = self._owner.pop(block, None)
        if seq_id is not None:
            del self._live[seq_id][block]

    def demote(self, blocks: list[int]) -> None:
        """Nothing to do: an idle block's sequences are released, which copied it out."""

    def release(self, seq_id: int, slot: int) -> None:
        """Sequence ``seq_id`` (in stream ``slot``) is about to be cleared: the blocks it
        cached that are not in host memory yet go there."""
        live = self._live.pop(seq_id, None)
        if not live:
            return
        for block in live:
            del self._owner[block]
        ranges = [(b, slot, index, n) for b, (index, n) in live.items() if b not in self.host]
        if ranges:
            self.host.copy_out_of(slot, ranges)

    def stage(self, blocks: list[int]) -> None:
        """``blocks`` still only in running sequences' streams go to host memory (one read
        of each such stream), so that ``share`` can write them."""
        by_seq: dict[int, list[int]] = {}
        for b in blocks:
            if b not in self.host:
                by_seq.setdefault(self._owner[b], []).append(b)
        for seq_id, found in by_seq.items():
            slot = self.slot_of(seq_id)
            assert slot is not None, "a running sequence's block without a stream"
            live = self._live[seq_id]
            self.host.copy_out_of(slot, [(b, slot, *live[b]) for b in found])
            for b in found:
                del live[b], self._owner[b]

    def share(self, blocks: list[int], dst: int, seq_id: int | None = None) -> None:
        """Stream ``dst``, new and empty, gets ``blocks`` (cached, at indices ``0 ..
        len(blocks) - 1``) and then the tail granted to ``seq_id``, as one state."""
        self.stage(blocks)
        grant = self._grants.pop(seq_id, None) if seq_id is not None else None
        run = blocks if grant is None else [*blocks, grant]
        if run:
            self.host.write_into(run, dst)
        if grant is not None:  # now the sequence's own block, which it writes on
            self.host.drop(grant)
