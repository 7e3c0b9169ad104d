"""How the llama.cpp runner lays out its KV cache (``choose_layout``): by default a stream
per sequence where 32 of them fit in a quarter of the memory available (a small model),
else one unified cache of 1 GiB (a big model); ``--kv-cache-memory`` given decides the
same way within it; ``--kv-streams`` / ``--no-kv-streams`` decide outright."""

from __future__ import annotations

from engine.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from engine.runners.llamacpp_streams import KvStreams, choose_layout

SMALL = 30 * 3 * 128 * 2  # bytes a cell: the default model (30 layers, 3 KV heads, K+V f16)
BIG = 32 * 8 * 256 * 2  # an 8B Llama: 32 layers, 8 KV heads of 128, K+V f16
GIB = 1 << 30


def layout(available: int | None = 20 * GIB, cell: int = SMALL, max_model_len: int = 4096,
           sliding_window: bool = False, **kw):
    return choose_layout(EngineConfig(model="default", **kw), max_model_len, cell, available,
                         sliding_window)


def test_auto_gives_a_small_model_32_streams_sized_to_what_they_take():
    got = layout()
    assert got.streams == KvStreams(32, 4096) and got.budget == 32 * 4096 * SMALL
    assert "auto: 32 streams of 4096 cells take 2.8 GiB, within a quarter" in got.why
    assert layout(max_num_seqs=8).streams == KvStreams(8, 4096)  # no more than it runs
    assert layout(max_model_len=1000).streams == KvStreams(32, 1024)  # padded to 256


def test_auto_keeps_one_unified_cache_where_the_streams_would_take_too_much():
    for got in (layout(cell=BIG), layout(available=8 * GIB), layout(available=None,
                                                                    max_model_len=8192 * 2)):
        assert got.streams is None and got.budget == DEFAULT_KV_CACHE_MEMORY
        assert "more than" in got.why
    assert layout(available=None).streams == KvStreams(32, 4096)  # 2.8 of at most 4 GiB


def test_auto_keeps_a_sliding_window_model_in_one_cache_for_its_prefix_cache():
    got = layout(sliding_window=True)
    assert got.streams is None and "sliding-window" in got.why
    assert layout(sliding_window=True, kv_streams=True).streams == KvStreams(32, 4096)


def test_a_given_budget_holds_the_streams_or_one_unified_cache():
    got = layout(kv_cache_memory=4 * GIB)
    assert got.streams == KvStreams(45, 4096) and got.budget == 4 * GIB  # all it holds
    got = layout(kv_cache_memory=2 * GIB)  # 22 streams: fewer lose to one cache
    assert got.streams is None and got.budget == 2 * GIB and "--kv-cache-memory" in got.why


def test_the_flags_decide_outright():
    got = layout(kv_streams=False)
    assert got.streams is None and got.budget == DEFAULT_KV_CACHE_MEMORY
    assert got.why == "--no-kv-streams"
    got = layout(kv_streams=True, cell=BIG, available=GIB)  # asked for: sized for 32
    assert got.streams == KvStreams(32, 4096) and got.why == "--kv-streams"
    got = layout(batch_invariant=True, kv_cache_memory=GIB)
    assert got.streams == KvStreams(11, 4096) and got.why == "--batch-invariant"
