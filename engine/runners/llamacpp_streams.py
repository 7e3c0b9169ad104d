"""One KV stream per sequence on llama.cpp (``--kv-streams``, and ``--batch-invariant``,
which implies it), sized from the budget.

Why, for throughput (``--kv-streams``): in one unified cache llama.cpp attends each row over
every cell in use up to the highest (its CPU flash attention tests the mask of each, 9 heads
x 30 layers on the default model), so with many sequences a row walks mostly its batch
mates' cells and a step's attention grows with the square of the sequences: 32 sequences
decoding 200 tokens, steps grew from ~125 to ~440 ms, where with a stream each (a row walks
its own stream) they grew to ~200 ms (2026-11-28, default model, 2 threads).

Why, for invariance (``--batch-invariant``): llama.cpp's CPU flash attention walks a
sequence's KV cells in cache order. In one unified cache a sequence's new tokens may land
in cells freed *before* its older ones (a batch mate finished, was preempted, had
proposals rejected), which reorders its sum and moves its logits. With ``kv_unified =
False`` llama.cpp keeps one stream (its own cells) per sequence id: only the sequence
itself frees cells in it, always at its tail (``seq_rm`` moves the stream's head back to
the first freed cell), so its cells stay in position order whatever its batch mates do.

The price: llama.cpp gives every stream ``n_ctx_seq = pad256(n_ctx / n_seq_max)`` cells
up front (src/llama-context.cpp), so each must hold a whole ``max_model_len`` sequence,
and the number of streams, the engine's concurrency, is what the KV budget holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig

STREAM_PAD = 256  # llama.cpp pads n_ctx_seq to a multiple of 256 cells


@dataclass(frozen=True)
class KvStreams:
    count: int  # streams, one per running sequence: the engine's concurrency
    cells: int  # cells of each (n_ctx_seq)

    @property
    def n_ctx(self) -> int:
        return self.count * self.cells


# Auto (neither --kv-streams nor --no-kv-streams): streams for this many sequences (the
# 32-client row: 1.14x the unified cache's throughput at 64 tokens, ~1.5x at 200) when
# they fit in AUTO_MEMORY_SHARE of the memory available; fewer streams lose to the unified
# cache (11 streams of 4,096 cells, what 1 GiB holds on the default model: 0.86x).
AUTO_STREAMS = 32
AUTO_MEMORY_SHARE = 0.25
AUTO_MEMORY_UNKNOWN = 4 << 30  # the most auto takes where available memory is unknown


@dataclass(frozen=True)
class KvLayout:
    """What the llama.cpp runner's KV cache is: ``streams`` (None: one unified cache) in
    ``budget`` bytes, and why, for the start-up log."""

    streams: KvStreams | None
    budget: int
    why: str


def streams_flag(config: EngineConfig) -> str | None:
    """The flag that asks for a stream per sequence (None: one unified cache or auto)."""
    if config.batch_invariant:
        return "--batch-invariant"
    return "--kv-streams" if config.kv_streams else None


def choose_layout(config: EngineConfig, max_model_len: int, bytes_per_cell: int,
                  available: int | None, sliding_window: bool = False) -> KvLayout:
    """A stream per sequence where asked for (sized to ``--kv-cache-memory``, by default
    to ``min(--max-num-seqs, AUTO_STREAMS)`` streams); one unified cache where
    ``--no-kv-streams``; and by default (auto), streams where ``AUTO_STREAMS`` of them fit
    in ``--kv-cache-memory`` when it is given, else in a quarter of the memory available
    (a small model: the default one's 32 streams of 4,096 cells take 2.8 GiB), else one
    unified cache in ``--kv-cache-memory`` or 1 GiB (a big model's streams would take
    too much: 32 x 4,096 cells of an 8B Llama are 16 GiB). Auto keeps a sliding-window
    model in one unified cache too: with streams its prefix cache would go through host
    memory as sequence states, which its second (window) cache makes unreadable, and prefix
    caching is on by default."""
    given = config.kv_cache_memory
    cells = padded(max_model_len)
    want = min(config.max_num_seqs, AUTO_STREAMS)
    need = want * cells * bytes_per_cell
    flag = streams_flag(config)
    if flag:
        budget = given if given is not None else need
        return KvLayout(kv_streams(budget, max_model_len, bytes_per_cell, config.max_num_seqs,
                                   flag), budget, flag)
    unified = given if given is not None else DEFAULT_KV_CACHE_MEMORY
    if config.kv_streams is False:
        return KvLayout(None, unified, "--no-kv-streams")
    if sliding_window:
        return KvLayout(None, unified, "auto: a sliding-window model, whose prefix cache "
                        "needs the one cache")
    room = given if given is not None else (
        AUTO_MEMORY_UNKNOWN if available is None else int(available * AUTO_MEMORY_SHARE))
    what = (f"{want} streams of {cells} cells take {need / 2**30:.1f} GiB, "
            + ("within " if need <= room else "more than ")
            + ("--kv-cache-memory" if given is not None else
               "a quarter of the memory available" if available is not None else
               "the 4 GiB auto takes where available memory is unknown")
            + f" ({room / 2**30:.1f} GiB)")
    if need <= room:
        budget = given if given is not None else need
        return KvLayout(kv_streams(budget, max_model_len, bytes_per_cell,
                                   config.max_num_seqs), budget, f"auto: {what}")
    return KvLayout(None, unified, f"auto: {what}")


def padded(max_model_len: int) -> int:
    """A stream's cells: llama.cpp pads n_ctx_seq to a multiple of 256."""
    return -(-max_model_len // STREAM_PAD) * STREAM_PAD


def kv_streams(kv_cache_memory: int, max_model_len: int, bytes_per_cell: int,
               max_num_seqs: int, flag: str = "--kv-streams") -> KvStreams:
    """As many streams of a whole sequence as ``kv_cache_memory`` holds, at most
    ``max_num_seqs``; ``ValueError`` naming the flags when not even one fits."""
    cells = padded(max_model_len)
    per_stream = cells * bytes_per_cell
    count = min(max_num_seqs, kv_cache_memory // per_stream)
    if count < 1:
        raise ValueError(
            f"{flag} keeps one KV stream of a whole sequence per running "
            f"sequence: a stream of {cells} cells (max_model_len {max_model_len}, padded "
            f"to {STREAM_PAD}) takes {per_stream} bytes, but --kv-cache-memory is "
            f"{kv_cache_memory}; raise --kv-cache-memory to at least {per_stream} or "
            f"lower --max-model-len")
    return KvStreams(count, cells)
