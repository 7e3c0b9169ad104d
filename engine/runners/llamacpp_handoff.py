"""Long prompts on the llama.cpp runner prefilled by the torch model (bf16, or float32 on
a CPU without AVX512-BF16), their KV handed to llama.cpp, which decodes them
(``--torch-prefill-tokens``).

Why: on a CPU with AVX512-BF16, torch in bf16 (oneDNN's BF16 GEMMs, the attention as
blocked GEMMs: ``blocked_attention``) prefills a long prompt in ~0.55-0.65x the time of HF
``generate`` fp32, while llama.cpp's own prefill is no faster than HF there (its
flash-attention CPU kernel dominates at thousands of tokens); llama.cpp decodes a single
sequence ~6x faster than torch. Measured on the default model (``python -m
bench.prefill_handoff``, 512-token chunks as the engine runs a long prompt alone;
2026-11-27): 1,024 tokens 1.03 s (SDPA's attention 1.22 s) vs HF 1.93 s, 3,000 tokens
3.91 s (SDPA 5.51 s) vs HF 6.23 s; llama.cpp's greedy decoding from the KV handed over
was 48 of 48 tokens equal to its own prefill's at both lengths. On a CPU without
AVX512-BF16 (a 2-core AVX2 AMD EPYC, 2026-11-28) bf16 torch is 4-15x slower than HF, but
float32 torch (oneDNN-packed linears, SDPA) prefilled 1,024 tokens in 2.87 s and 3,000 in
10.98 s where llama.cpp's own prefill (Q8_0) took 3.5-5.2 s and 17.0 s (HF 2.5-3.8 s and
10.7 s); there a float32 copy takes prompts of ``FLOAT32_MIN_TOKENS`` or more (its linears
now the native kernel's, its attention and elementwise ops native too:
``load_torch_prefill``; since 2026-12-07 from 128 tokens, where it prefills in ~0.75x
llama.cpp's time).

How: the prompt still arrives in the scheduler's chunks (so short requests keep being
admitted beside it); each chunk runs through the torch model with the sequence's HF cache;
the last chunk's logits are sampled from torch's output, and the whole KV is written into
the sequence's llama.cpp cells with ``llama_state_seq_set_data`` in llama.cpp's own
sequence-state layout (src/llama-kv-cache.cpp ``state_write``): the header llama.cpp writes
(taken from a state it wrote, not hard-coded), one stream, each cell's position and
sequence id, per layer the K rows, per layer the V rows (not transposed: flash attention),
f16. For a model with llama.cpp's "normal" rotary layout (Llama's GGUF conversion permutes
q/k rows from HF's halves to pairs) K is written in pairs.

A prompt that hits the prefix cache with a long uncached tail goes the same way, the other
direction first: its cached prefix's KV is read out of llama.cpp's cells
(``llama_state_seq_get_data``) into the HF cache, torch computes the tail over it, and only
the tail's cells are written back. llama.cpp's flash-attention CPU kernel reads the whole
cached context once per prompt row, so a tail's cost grows with rows x context (50 rows
over 835 cached tokens: 177 ms, against 68 ms over none); torch attends with GEMMs (99 ms).
``worth_torch`` says where it pays.

What guards it: at load a probe prefills a prompt both ways and compares the next step's
logits (same top token, KL < 0.05) and the state's size, and continues llama.cpp's own KV
in torch and compares that step too; anything else (a model transformers cannot load
from the file, a probe that disagrees, too little memory) leaves the runner prefilling
everything itself, with the reason logged. A float32 copy takes only prompts (and uncached
tails) of ``FLOAT32_MIN_TOKENS`` or more. Until a sequence's KV is handed over, its blocks
are not cached for prefix caching (``kv_pending``).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.runners.llamacpp_host_blocks import (
    SeqState,
    StateFormatError,
    available_memory,
    empty_state,
    get_state,
    parse_state,
    set_state,
)
from engine.runners.prefill_rows import keep_last_rows

log = logging.getLogger(__name__)

F16 = 1  # GGML_TYPE_F16
PROBE_TOKENS = 64
PROBE_MAX_KL = 0.05
# A cached prompt's uncached tail of n tokens after c cached ones goes through torch when
# n * (c + n) reaches this (or n reaches --torch-prefill-tokens). Measured on the default
# model (2026-11-27, 2 threads): llama.cpp ~1.4 ms a row plus ~2.6 us a row per context
# token (its attention), torch ~40 ms plus ~1.2 ms a row, reading the prefix ~10 ms per
# 1,000 tokens: they cross near 25 rows over 835 tokens, 55 over 340, 16 over 1,500.
TAIL_ROW_CONTEXT = 20_000
MIN_TAIL = 8
# A float32 copy (a CPU without AVX512-BF16) takes prompts and uncached tails of at least
# this many tokens (or --torch-prefill-tokens if higher; the shorter-tail-over-long-context
# rule above was measured for bf16 only). Measured on a 2-core AVX2 EPYC, first token in
# one engine, the copy on and off alternating, 4 rounds (2026-12-07, its elementwise ops
# native and its last layer cut to the sampled rows): torch float32 then llama.cpp against
# llama.cpp's own Q8_0 prefill, 64 tokens 1.09x, 96 1.00x, 128 0.76-0.77x, 256 0.75x, 384
# 0.64x, 512 0.71x, 768 0.65x. (2026-11-28, before those: 128 1.02-1.06x, 256 0.82-0.98x,
# 1,024 0.80-0.86x, so it was 1,024 then.)
FLOAT32_MIN_TOKENS = 128
# converting a .gguf to float32: its peak over the imports, measured for the default model
# (800 MiB for 134.5M parameters: 6.2 bytes a parameter), with a margin
CONVERT_BYTES_PER_PARAM = 8


def worth_torch(tail: int, seq_len: int, min_tokens: int, by_context: bool = True) -> bool:
    """Whether ``tail`` uncached tokens ending a ``seq_len``-token prompt whose start is
    cached prefill faster in torch than in llama.cpp (``by_context``: also a shorter tail
    over a long context, as measured for bf16)."""
    return tail >= min_tokens or (by_context and tail >= MIN_TAIL
                                  and tail * seq_len >= TAIL_ROW_CONTEXT)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch at ``n`` threads for a prefill (the runner keeps it at 1 for sampling)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class TorchPrefill:
    """The torch side: a copy of the model (bf16, or float32 on a CPU without
    AVX512-BF16) and one HF cache per sequence in flight."""

    def __init__(self, model: Any, threads: int, rope_pairs: bool,
                 min_tokens: int = 0) -> None:
        self.model = model
        self.threads = threads
        self.rope_pairs = rope_pairs
        # prompts (and uncached tails) of fewer tokens stay llama.cpp's; 0: the flag's
        self.min_tokens = min_tokens
        self.kv_heads = model.config.num_key_value_heads
        self.header = b""  # llama.cpp's state header, set by the probe
        self.streams = 1  # KV streams in llama.cpp's states (one per sequence: --kv-streams)
        self._caches: dict[int, Any] = {}
        self._tokens: dict[int, list[int]] = {}  # each sequence's torch tokens (fallback)
        self._start: dict[int, int] = {}  # each sequence's first torch position
        # the last layer past its attention for the sampled rows only (prefill_rows.py)
        self._kept = keep_last_rows(model)

    def begin_after(self, seq_id: int, past: SeqState) -> None:
        """Start ``seq_id`` in torch after its cached prefix, whose KV llama.cpp holds:
        ``past`` (its sequence state) read into an HF cache (pairs back to HF's halves,
        f16 to the model's dtype). Raises ``StateFormatError`` when the cells are not
        exactly positions 0..n-1 in the layout the hand-over writes."""
        from transformers import DynamicCache

        n = len(past.positions)
        layers = len(past.parts) // 2
        order = np.argsort(past.positions, kind="stable")
        if not n or not (past.positions[order] == np.arange(n)).all():
            raise StateFormatError("the cached prefix's cells are not positions 0..n-1")
        if layers != self.model.config.num_hidden_layers or any(
                kind != F16 for kind, _ in past.kinds):
            raise StateFormatError(f"{layers} layers of types {sorted(set(past.kinds))}")
        cache = DynamicCache()
        dtype = next(self.model.parameters()).dtype
        with torch.inference_mode():
            for i in range(layers):
                k, v = (torch.from_numpy(past.parts[j][order]).view(torch.float16)
                        for j in (i, layers + i))
                d = k.shape[1] // self.kv_heads
                k = k.view(n, self.kv_heads, d)
                if self.rope_pairs:  # llama.cpp's pairs -> HF's halves, per head
                    k = k.view(n, self.kv_heads, d // 2, 2).transpose(-1, -2).reshape(
                        n, self.kv_heads, d)
                v = v.view(n, self.kv_heads, d)
                cache.update(k.transpose(0, 1).unsqueeze(0).to(dtype),
                             v.transpose(0, 1).unsqueeze(0).to(dtype), i)
        self._caches[seq_id] = cache
        self._tokens[seq_id] = []
        self._start[seq_id] = n

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._caches

    def run(self, seq_id: int, token_ids: list[int], start_pos: int,
            num_logits: int) -> torch.Tensor | None:
        """One chunk of ``seq_id``'s prompt; the last ``num_logits`` rows' logits (fp32)
        when ``num_logits``, else None."""
        from transformers import DynamicCache

        if start_pos == 0:
            self._caches[seq_id] = DynamicCache()
            self._tokens[seq_id] = []
            self._start[seq_id] = 0
        cache = self._caches[seq_id]
        self._tokens[seq_id] += token_ids
        assert cache.get_seq_length() == start_pos, (cache.get_seq_length(), start_pos)
        with torch.inference_mode(), torch_threads(self.threads):
            ids = torch.tensor([token_ids])
            if self._kept is not None:
                self._kept.rows = num_logits
            try:
                hidden = self.model.model(input_ids=ids, cache=cache,
                                          use_cache=True).last_hidden_state
            finally:
                if self._kept is not None:
                    self._kept.rows = None
            if not num_logits:
                return None
            logits = self.model.lm_head(hidden[0, -num_logits:])
        return logits.float()

    def tokens(self, seq_id: int) -> list[int]:
        """The tokens ``seq_id`` ran in torch (from ``first_position(seq_id)`` on)."""
        return self._tokens[seq_id]

    def first_position(self, seq_id: int) -> int:
        """``seq_id``'s first position computed in torch (0, or its cached prefix's end)."""
        return self._start[seq_id]

    def state(self, seq_id: int) -> np.ndarray:
        """The KV ``seq_id`` computed in torch (from ``first_position(seq_id)`` on) in
        llama.cpp's sequence-state layout (sequence 0), its HF cache dropped. Each layer's
        K and V go into the state in one copy each (transposed, bf16 to f16, and for a
        "normal" rotary layout halves to pairs): the state of a 3,000-token prompt took
        0.13-0.57 s built from intermediate copies."""
        layers = self._caches.pop(seq_id).layers
        first = self._start[seq_id]
        n = layers[0].keys.shape[2] - first
        row = self.kv_heads * layers[0].keys.shape[3] * 2  # f16
        kinds = [(F16, row)] * (2 * len(layers))
        buf, parts = empty_state(self.header, kinds,
                                 np.arange(first, first + n, dtype=np.int32), self.streams)
        with torch.inference_mode(), torch_threads(self.threads):  # copies on every core
            for i, layer in enumerate(layers):
                k = layer.keys[0, :, first:].transpose(0, 1)  # [n, kv heads, head dim]
                d = k.shape[-1]
                dst = torch.from_numpy(parts[i]).view(torch.float16).view(n, self.kv_heads, d)
                if self.rope_pairs:  # HF's halves -> llama.cpp's pairs, per head
                    k = k.reshape(n, self.kv_heads, 2, d // 2).transpose(-1, -2)
                    dst = dst.view(n, self.kv_heads, d // 2, 2)
                dst.copy_(k)
                v = torch.from_numpy(parts[len(layers) + i]).view(torch.float16)
                v.view(n, self.kv_heads, d).copy_(layer.values[0, :, first:].transpose(0, 1))
        return buf

    def drop(self, seq_id: int) -> None:
        self._caches.pop(seq_id, None)
        self._tokens.pop(seq_id, None)
        self._start.pop(seq_id, None)


def set_seq_state(llama_cpp: Any, ctx: Any, slot: int, data: np.ndarray) -> None:
    if not set_state(llama_cpp, ctx, slot, data):
        raise RuntimeError(f"llama.cpp did not take a handed-over KV of {len(data)} bytes")



def load_torch_prefill(source: Any, threads: int, rope_pairs: bool,
                       max_model_len: int, dtype: torch.dtype = torch.bfloat16
                       ) -> TorchPrefill:
    """The model from the weights cache in ``dtype``, its RoPE fixed as the runner's
    llama.cpp runs it (raises what loading raises). bf16: attention as
    ``blocked_attention``'s GEMMs. float32: the native flash-attention kernel
    (``native_causal_attention``; where it is not built, SDPA's flash kernel split at the
    chunk's past) and packed linears (as the torch runner's: packed_linear.py); SDPA was
    measured faster than blocked attention in float32 (1,024 tokens 2.87 s against 3.05
    s, 3,000 tokens 10.98 s against 12.21 s, 2-core AVX2 EPYC), split faster than SDPA's
    masked call, and the native kernel faster than both. Its q/k/v and gate/up are fused
    and its RMSNorms, SiLU x up and rotary embeddings run as one native pass each
    (native_elementwise.py; a 1,024-token prompt's prefill ~0.2 s shorter in profiles)."""
    from engine.loading.model_loader import load_model
    from engine.loading.rope_scaling import fix_rotary
    from engine.runners.blocked_attention import NAME, NATIVE_NAME
    from engine.runners.torch.fused_linear import fuse_siblings
    from engine.runners.torch.native_elementwise import fuse_elementwise
    from engine.runners.torch.packed_linear import can_pack, pack_linears

    cpu = torch.device("cpu")
    model = load_model(source, dtype, cpu, NAME if dtype == torch.bfloat16 else NATIVE_NAME)
    fix_rotary(model, max_model_len)
    if not hasattr(model, "model") or not hasattr(model, "lm_head"):
        raise ValueError(f"{type(model).__name__} has no .model / .lm_head")
    if can_pack(cpu, dtype):
        fuse_siblings(model)  # one product for q/k/v and one for gate/up: same bits
        pack_linears(model)
        fuse_elementwise(model)
    return TorchPrefill(model, threads, rope_pairs,
                        FLOAT32_MIN_TOKENS if dtype == torch.float32 else 0)


def probe(prefill: TorchPrefill, runner: Any, token_ids: list[int]) -> str | None:
    """Prefill ``token_ids`` with llama.cpp and with torch (handed over), decode one more
    token from each, and continue llama.cpp's own prefill in torch for that token too
    (the cached-prefix direction); compare each with llama.cpp's own: None when they
    agree, else what differs. Also takes llama.cpp's state header. Uses llama.cpp sequence
    0 of a fresh context."""
    lc, ctx, memory = runner.llama_cpp, runner.ctx, runner.memory
    n = len(token_ids)
    nxt = token_ids[0]
    try:
        own = runner._decode(list(token_ids) + [nxt], list(range(n + 1)), [0] * (n + 1),
                             [n]).clone()
        lc.llama_memory_seq_rm(memory, 0, n, -1)
        data = get_state(lc, ctx, 0)
        try:
            state = parse_state(data)
        except StateFormatError as e:
            return f"llama.cpp's sequence state is not laid out as expected ({e})"
        if len(state.positions) != n:
            return (f"llama.cpp's sequence state holds {len(state.positions)} cells where "
                    f"{n} were computed")
        prefill.header, prefill.streams = state.header, state.streams
        prefill.begin_after(-2, state)
        after = prefill.run(-2, [nxt], n, 1)
        assert after is not None
        prefill.run(-1, token_ids, 0, 1)
        ours = prefill.state(-1)
        if len(ours) != len(data):
            return f"a state of {len(ours)} bytes where llama.cpp writes {len(data)}"
        lc.llama_memory_seq_rm(memory, 0, -1, -1)
        set_seq_state(lc, ctx, 0, ours)
        got = runner._decode([nxt], [n], [0], [0]).clone()
    finally:
        prefill.drop(-1)
        prefill.drop(-2)
        lc.llama_memory_seq_rm(memory, 0, -1, -1)
        runner._cached[0] = 0
    for what, logits in (("a handed-over prefill", got[0]),
                         ("torch continuing llama.cpp's KV", after[0])):
        p, q = own[0].log_softmax(-1), logits.log_softmax(-1)
        kl = float((p.exp() * (p - q)).sum())
        if int(own[0].argmax()) != int(logits.argmax()) or kl > PROBE_MAX_KL:
            return (f"the next token's logits after {what} differ from llama.cpp's own "
                    f"(KL {kl:.3f}, top {int(logits.argmax())} vs {int(own[0].argmax())})")
    return None


def _label(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else str(dtype).removeprefix("torch.")


def memory_problem(n_params: int, source: Any, available: int | None,
                   dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why the torch copy of an ``n_params`` model does not fit here, None when it does:
    its weights kept resident (at most half the ``available`` memory: the rest is for
    llama.cpp's KV, requests and the host tier), and, when the .gguf has no weights-cache
    entry yet, its float32 conversion first (~6 bytes a parameter at its peak for the
    default model, counted as 8) and its files on disk (4 bytes a parameter). A Llama 3 8B
    would take 16 GiB resident and ~64 GiB while converting: without this, a start on a
    24 GiB machine was killed while converting, with no message."""
    from engine.loading.weights_cache import cache_root, cached_model_dir

    gib = 2**30
    resident = dtype.itemsize * n_params
    if available is not None and resident > available // 2:
        return (f"its {_label(dtype)} copy would keep {resident / gib:.1f} GiB, more than half the "
                f"{available / gib:.1f} GiB of memory available")
    gguf = Path(source.directory) / source.gguf_file if source.gguf_file else None
    if gguf is None or cached_model_dir(gguf, build=False) is not None:
        return None
    converting = CONVERT_BYTES_PER_PARAM * n_params
    if available is not None and converting > available:
        return (f"converting the .gguf for torch (once, into the weights cache) would take "
                f"~{converting / gib:.1f} GiB of the {available / gib:.1f} GiB of memory "
                f"available")
    root = cache_root()
    while not root.exists() and root != root.parent:
        root = root.parent
    disk = 4 * n_params
    free = shutil.disk_usage(root).free
    if disk > free:
        return (f"its converted weights would take {disk / gib:.1f} GiB in {cache_root()}, "
                f"which has {free / gib:.1f} GiB free")
    return None


def start(runner: Any, source: Any, min_tokens: int) -> TorchPrefill | None:
    """The runner's torch prefill, or None (logged why) when it cannot be used."""
    from engine.runners.requantize import cpu_has_bf16_gemm

    if min_tokens <= 0:
        return None
    lc = runner.llama_cpp
    why = None
    # bf16 where llama.cpp's CPU has AVX512-BF16 (oneDNN's BF16 GEMMs); float32 elsewhere,
    # for long prompts only (FLOAT32_MIN_TOKENS)
    dtype = torch.bfloat16 if cpu_has_bf16_gemm(lc) else torch.float32
    if runner.config.batch_invariant:
        why = "not under --batch-invariant (llama.cpp's own prefill is the invariant one)"
    elif not torch.backends.mkldnn.is_available():
        why = "torch has no oneDNN here"
    else:
        why = memory_problem(lc.llama_model_n_params(runner.model), source,
                             available_memory(), dtype)
    if why is None:
        t0 = time.perf_counter()
        rope_pairs = lc.llama_model_rope_type(runner.model) == lc.LLAMA_ROPE_TYPE_NORM
        try:
            prefill = load_torch_prefill(source, runner.threads, rope_pairs,
                                         runner.max_model_len, dtype)
            text = runner.tokenize("The river carries sand and stones down to the sea. " * 8)
            why = probe(prefill, runner, text[:PROBE_TOKENS])
        except (ValueError, OSError, RuntimeError, KeyError, AttributeError) as e:
            why = f"the torch model could not be used ({type(e).__name__}: {e})"
        if why is None:
            log.info("llama.cpp runner: prompts of %d+ tokens prefill in torch %s and hand "
                     "their KV to llama.cpp, as do a prefix-cache hit's long uncached tails "
                     "(--torch-prefill-tokens; loaded and checked in %.1fs)",
                     max(min_tokens, prefill.min_tokens), _label(dtype),
                     time.perf_counter() - t0)
            return prefill
    log.info("llama.cpp runner: --torch-prefill-tokens off: %s", why)
    return None
