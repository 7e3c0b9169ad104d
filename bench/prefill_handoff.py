"""The route behind ``--torch-prefill-tokens`` (engine/runners/llamacpp_handoff.py),
measured outside the server: prefill a long prompt with the torch model, hand its KV to
llama.cpp (``llama_state_seq_set_data``), and decode there.

Why: on this CPU llama.cpp's prefill of a 3,000-token prompt is no faster than HF
``generate`` fp32 (its flash-attention CPU kernel dominates at that length), while torch
in bf16 (oneDNN's AVX512-BF16 GEMMs, attention as blocked GEMMs) prefills it at ~0.6x HF.
llama.cpp decodes a single sequence ~6x faster than torch, so the pair keeps both.

It prints, for one prompt per length: llama.cpp's own prefill, the torch prefill (fp32,
and bf16 on a CPU with AVX512-BF16), HF ``generate``'s first token, the hand-off's cost,
and how many greedy tokens llama.cpp decodes from the handed-over KV equal to those it
decodes from its own prefill.

The state is written by the runner's own ``TorchPrefill`` (the layout is described
there), with llama.cpp's header taken from a one-token state it wrote.

``python -m bench.prefill_handoff [--lengths 1024 3000] [--check-tokens 48]`` (default
model only: a Llama; ~2 min).
"""

from __future__ import annotations

import argparse
import struct
import time

import numpy as np
import torch

from bench.default_server import hf_ttft, long_prompt
from bench.llamacpp import gguf_path
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.runners.blocked_attention import NAME as BLOCKED
from engine.runners.blocked_attention import NATIVE_NAME as NATIVE
from engine.runners.blocked_attention import SPLIT_NAME as SPLIT
from engine.runners.llamacpp import BatchArrays, default_threads, llama_lib
from engine.runners.llamacpp_handoff import TorchPrefill, set_seq_state
from engine.runners.llamacpp_host_blocks import HEADER, get_state


class LlamaSeq:
    """One llama.cpp context holding one sequence (id 0), greedy decoding."""

    def __init__(self, path: str, n_ctx: int, threads: int) -> None:
        self.lib = lib = llama_lib()
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(path.encode(), mp)
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.kv_unified = n_ctx, 512, 512, 1, True
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = 1  # as the runner
        self.ctx = lib.llama_init_from_model(self.model, cp)
        self.memory = lib.llama_get_memory(self.ctx)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.arrays = BatchArrays.allocate(512)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)

    def decode(self, tokens: list[int], pos0: int) -> np.ndarray:
        """Last row's logits after ``tokens`` at positions ``pos0..``."""
        a, n = self.arrays, len(tokens)
        a.token[:n], a.pos[:n], a.seq_id[:n] = tokens, range(pos0, pos0 + n), 0
        a.logits[:n] = 0
        a.logits[n - 1] = 1
        assert self.lib.llama_decode(self.ctx, a.batch(self.lib, 0, n)) == 0
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, -1),
                                     shape=(self.n_vocab,)).copy()

    def prefill(self, ids: list[int]) -> np.ndarray:
        self.clear()
        for s in range(0, len(ids), 512):
            logits = self.decode(ids[s:s + 512], s)
        return logits

    def greedy(self, first: np.ndarray, pos0: int, n: int) -> list[int]:
        out = [int(first.argmax())]
        while len(out) < n:
            out.append(int(self.decode([out[-1]], pos0 + len(out) - 1).argmax()))
        return out

    def header(self) -> bytes:
        """The bytes llama.cpp writes before the stream count (magic and version): a
        one-token state's first 8 bytes, followed by stream count 1 and cell count 1."""
        self.prefill([1])
        data = get_state(self.lib, self.ctx, 0)
        assert struct.unpack_from("<II", data, HEADER) == (1, 1), bytes(data[:16]).hex()
        return bytes(data[:HEADER])


def torch_prefill(prefill: TorchPrefill, ids: list[int],
                  chunk: int) -> tuple[np.ndarray, np.ndarray, float]:
    """The prompt through the runner's torch side in ``chunk``-token chunks (as the engine
    runs a long prompt alone): its state for llama.cpp, the last row's logits, the seconds
    the prefill took."""
    t0 = time.perf_counter()
    logits = None
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        logits = prefill.run(0, part, start, 1 if start + chunk >= len(ids) else 0)
    seconds = time.perf_counter() - t0
    assert logits is not None
    return prefill.state(0), logits[0].numpy(), seconds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 3000])
    ap.add_argument("--check-tokens", type=int, default=48)
    ap.add_argument("--chunk", type=int, default=512,
                    help="tokens a step (the engine's chunk for a long prompt alone)")
    args = ap.parse_args(argv)
    threads = default_threads()
    torch.set_num_threads(threads)
    engines = {dt: LLMEngine(EngineConfig(model="default", runner="torch", dtype=dt,
                                          kv_cache_memory=64 << 20))
               for dt in ("float32", "bfloat16")}
    fp32 = engines["float32"]
    config = fp32.runner.model.config  # type: ignore[attr-defined]
    assert config.model_type == "llama", "the rotary permutation here is Llama's"
    llm = LlamaSeq(gguf_path("default"), max(args.lengths) + args.check_tokens + 16, threads)
    header = llm.header()
    # (label, dtype, attention): the runner's is bf16 with blocked_attention's where the CPU
    # has AVX512-BF16, else float32 with the native kernel (split SDPA where it is not built)
    kinds = [("float32 sdpa", "float32", "sdpa"),
             ("float32 split", "float32", SPLIT),
             ("float32 native (the runner's without AVX512-BF16)", "float32", NATIVE),
             ("float32 blocked", "float32", BLOCKED),
             ("bfloat16 sdpa", "bfloat16", "sdpa"),
             ("bfloat16 blocked (the runner's)", "bfloat16", BLOCKED)]
    import llama_cpp

    from engine.runners.requantize import cpu_has_bf16_gemm

    if not cpu_has_bf16_gemm(llama_cpp):  # bf16 runs 4-15x HF's time there: not the runner's
        print("this CPU has no AVX512-BF16: the bfloat16 rows are left out")
        kinds = [k for k in kinds if k[1] != "bfloat16"]
    prefills = {}
    for dt, engine in engines.items():
        prefills[dt] = TorchPrefill(engine.runner.model, threads,  # type: ignore[attr-defined]
                                    rope_pairs=True)
        prefills[dt].header = header
    for n in args.lengths:
        ids = long_prompt(fp32.tokenizer, n, n)
        t0 = time.perf_counter()
        own_first = llm.prefill(ids)
        own_s = time.perf_counter() - t0
        own = llm.greedy(own_first, n, args.check_tokens)
        hf_s = hf_ttft(fp32, ids)
        print(f"{n} tokens: llama.cpp prefill {own_s:.2f} s, HF generate first token "
              f"{hf_s:.2f} s")
        for label, dt, attention in kinds:
            prefill = prefills[dt]
            prefill.model.set_attn_implementation(attention)  # HF forward, its own cache
            state, last, torch_s = torch_prefill(prefill, ids, args.chunk)
            t0 = time.perf_counter()
            llm.clear()
            set_seq_state(llm.lib, llm.ctx, 0, state)
            hand_s = time.perf_counter() - t0
            got = llm.greedy(last, n, args.check_tokens)
            same = next((i for i, (a, b) in enumerate(zip(own, got, strict=True)) if a != b),
                        len(own))
            print(f"  torch {label} prefill {torch_s:.2f} s ({torch_s / hf_s:.2f}x HF), "
                  f"hand-off {hand_s * 1000:.0f} ms; llama.cpp's greedy from it: first "
                  f"{same}/{len(own)} tokens equal to its own")


if __name__ == "__main__":
    main()
