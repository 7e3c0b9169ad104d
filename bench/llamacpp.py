"""The llama.cpp runner against llama.cpp itself and HF ``generate``, in one run.

Same GGUF, same threads. Rows compared as a ratio are measured interleaved (A B C C B A),
each ratio the median over rounds of the two runs of one round (``paired_ratio``), so the
shared machine's drift hits both sides:

- batch 1: one gRPC client of ``genserve serve --runner llamacpp``, one request at a time,
  vs ``llama_cpp.Llama.generate`` (greedy) and HF ``generate`` fp32 on the same prompts;
- 32 concurrent: 32 gRPC clients, streaming (a message per token) and unary (the whole
  output in one message), vs llama.cpp's own batched decode of 32 sequences (one
  ``llama_decode`` per step over every sequence, greedy, in the same unified KV cache);
- n-gram speculation on copy-heavy prompts vs plain decoding, both on this runner.

``python -m bench.llamacpp [--quick]``; ``make bench`` runs it too when llama-cpp-python
is installed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np

from bench.measure import (
    RESULTS,
    Row,
    hf_sequential,
    interleaved_runs,
    median_run,
    paired_ratio,
    print_table,
    prompts,
)
from bench.server import free_port, grpc_clients, grpc_unary_clients, start_server_process
from bench.spec import COPY_HEAVY, METHODS, _Tally
from bench.structured import chat_ids
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loading.model_loader import resolve_model
from engine.runners.llamacpp import BatchArrays, default_threads, llama_lib
from engine.runners.requantize import served_gguf
from engine.runners.torch import stock_transformers
from engine.sampling_params import SamplingParams
from specdecode.worker import speculator_for


def gguf_path(model: str, requantize: str = "auto") -> str:
    """The GGUF the server's llama.cpp runner runs for ``model`` by default (``--requantize
    auto``: a cached Q8_0 copy of a Q4_1 file), so llama.cpp itself runs the same
    weights."""
    source = resolve_model(model)
    assert source.gguf_file, f"{model} is not a .gguf"
    path = Path(source.directory, source.gguf_file).resolve()
    return str(served_gguf(llama_lib(), path, requantize, default_threads()))


def llama_generate(llm, ids_list: list[list[int]], new: int) -> Row:
    """``Llama.generate`` one prompt at a time, prefill included (no prefix reuse)."""
    t0 = time.perf_counter()
    for ids in ids_list:
        llm.reset()
        got = list(itertools.islice(llm.generate(ids, temp=0.0, reset=True), new))
        assert len(got) == new
    return Row("llama.cpp Llama.generate, batch 1 sequential",
               len(ids_list) * new / (time.perf_counter() - t0))


class BatchedLlama:
    """llama.cpp's own batched greedy decode: every prompt prefilled in one
    ``llama_decode``, then one ``llama_decode`` per step over all sequences."""

    def __init__(self, path: str, threads: int, n_seqs: int, n_ctx: int) -> None:
        self.lib = lib = llama_lib()
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(path.encode(), mp)
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, 2048, 512
        cp.n_seq_max, cp.kv_unified = n_seqs, True
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(self.model, cp)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.arrays = BatchArrays.allocate(2048)

    def _decode(self, tokens: list[int], pos: list[int], seqs: list[int],
                out: list[int]) -> np.ndarray:
        a, n = self.arrays, len(tokens)
        a.token[:n], a.pos[:n], a.seq_id[:n] = tokens, pos, seqs
        a.logits[:n] = 0
        a.logits[out] = 1
        assert self.lib.llama_decode(self.ctx, a.batch(self.lib, 0, n)) == 0
        ptr = self.lib.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(len(out), self.n_vocab)).argmax(-1)

    def run(self, ids_list: list[list[int]], new: int) -> Row:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        tokens: list[int] = []
        pos: list[int] = []
        seqs: list[int] = []
        out: list[int] = []
        for s, ids in enumerate(ids_list):
            tokens += ids
            pos += range(len(ids))
            seqs += [s] * len(ids)
            out.append(len(tokens) - 1)
        nxt = self._decode(tokens, pos, seqs, out)
        lengths = [len(ids) for ids in ids_list]
        every = list(range(len(ids_list)))
        for step in range(new - 1):
            nxt = self._decode(nxt.tolist(), [n + step for n in lengths], every, every)
        return Row(f"llama.cpp batched decode, {len(ids_list)} sequences",
                   len(ids_list) * new / (time.perf_counter() - t0))

    def close(self) -> None:
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def ngram_vs_plain(model: str, threads: int, new: int, reps: int) -> dict:
    plain = LLMEngine(EngineConfig(model=model, runner="llamacpp", threads=threads,
                                   kv_cache_memory=128 << 20))
    ngram = LLMEngine(EngineConfig(model=model, runner="llamacpp", threads=threads,
                                   kv_cache_memory=128 << 20),
                      speculator=speculator_for(METHODS["ngram k=8"]))
    ids_list = [chat_ids(plain, p) for p in COPY_HEAVY]
    tallies = {"plain": _Tally(), "ngram k=8": _Tally()}
    engines = {"plain": plain, "ngram k=8": ngram}
    for e in engines.values():
        e.add_request("warm", ids_list[0], SamplingParams(max_new_tokens=8))
        while e.has_work:
            e.step()
    for _ in range(reps):
        for ids in ids_list:
            for name, e in engines.items():
                tallies[name].add(e, ids, new)
    rows = {name: t.row() for name, t in tallies.items()}
    rows["ngram k=8"]["speedup"] = rows["ngram k=8"]["tok_s"] / rows["plain"]["tok_s"]
    return rows


def measure(model: str = "default", new: int = 64, quick: bool = False,
            threads: int | None = None) -> dict:
    import llama_cpp

    threads = threads or default_threads()
    path = gguf_path(model)
    n_seq = 2 if quick else 4
    torch_engine = LLMEngine(EngineConfig(model=model, runner="torch",
                                          kv_cache_memory=64 << 20))
    tok = torch_engine.tokenizer
    ids1 = [tok(p)["input_ids"] for p in prompts(n_seq)]
    ids32 = [tok(p)["input_ids"] for p in prompts(32)]
    llm = llama_cpp.Llama(path, n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                          flash_attn=True, verbose=False)  # as the runner runs it
    batched = BatchedLlama(path, threads, 32, 32 * (max(map(len, ids32)) + new) + 256)
    port = free_port()
    RESULTS.mkdir(parents=True, exist_ok=True)
    server = start_server_process(model, port, RESULTS / "server-llamacpp.log", "llamacpp",
                                  ("--threads", str(threads), "--metrics-port", "0"))
    address = f"127.0.0.1:{port}"
    try:
        grpc_clients(address, 1, 1, 8)  # warm-up
        llama_generate(llm, ids1[:1], 8)

        def hf() -> Row:
            with stock_transformers(torch_engine.runner.model):  # type: ignore[attr-defined]
                return hf_sequential(torch_engine, n_seq, new)

        runs1 = interleaved_runs(2 if quick else 3, {
            "llama": lambda: llama_generate(llm, ids1, new),
            "grpc": lambda: grpc_clients(address, 1, n_seq, new),
            "hf": hf})
        runs32 = interleaved_runs(1 if quick else 5, {
            "llama": lambda: batched.run(ids32, new),
            "grpc": lambda: grpc_clients(address, 32, 1, new),
            "unary": lambda: grpc_unary_clients(address, 32, new)})
    finally:
        server.stop()
        llm.close()
        batched.close()
    b1 = {name: median_run(rs) for name, rs in runs1.items()}
    b32 = {name: median_run(rs) for name, rs in runs32.items()}
    b1["grpc"].name = "gRPC llamacpp runner, batch 1 sequential"
    b32["grpc"].name = "gRPC llamacpp runner, 32 streaming clients"
    b32["unary"].name = "gRPC llamacpp runner, 32 unary clients"
    b1["grpc"].ratios = {"llama.cpp batch 1": paired_ratio(runs1["grpc"], runs1["llama"]),
                         "HF batch 1": paired_ratio(runs1["grpc"], runs1["hf"])}
    for name in ("grpc", "unary"):
        b32[name].ratios = {"llama.cpp batched 32": paired_ratio(runs32[name],
                                                                 runs32["llama"])}
    spec = ngram_vs_plain(model, threads, 96, 1 if quick else 2)
    return {"threads": threads, "new_tokens": new,
            "rows": {"batch1": {k: r.__dict__ for k, r in b1.items()},
                     "batch32": {k: r.__dict__ for k, r in b32.items()}},
            "ngram_copy_heavy": spec}


def report(res: dict) -> None:
    rows = [Row(**r) for part in ("batch1", "batch32") for r in res["rows"][part].values()]
    print(f"\nllama.cpp runner ({res['threads']} threads, {res['new_tokens']} new tokens)")
    print_table(rows)
    s = res["ngram_copy_heavy"]
    print(f"  n-gram k=8 on copy-heavy prompts (offline, batch 1): plain "
          f"{s['plain']['tok_s']:.1f} tok/s, n-gram {s['ngram k=8']['tok_s']:.1f} tok/s "
          f"({s['ngram k=8']['speedup']:.2f}x, accept {s['ngram k=8']['acceptance']:.0%})")


def targets(res: dict) -> dict[str, bool]:
    b1, b32 = res["rows"]["batch1"], res["rows"]["batch32"]
    vs_llama = b1["grpc"]["ratios"]["llama.cpp batch 1"]
    vs_hf = b1["grpc"]["ratios"]["HF batch 1"]
    vs_batched = b32["grpc"]["ratios"]["llama.cpp batched 32"]
    speedup = res["ngram_copy_heavy"]["ngram k=8"]["speedup"]
    return {
        f"llamacpp gRPC batch 1 >= 0.9x llama.cpp Llama.generate ({vs_llama:.2f}x)":
            vs_llama >= 0.9,
        f"llamacpp gRPC batch 1 >= 4x HF generate fp32 ({vs_hf:.2f}x)": vs_hf >= 4.0,
        f"llamacpp 32 streaming gRPC clients >= 1.0x llama.cpp batched 32 "
        f"({vs_batched:.2f}x)":
            vs_batched >= 1.0,
        f"llamacpp n-gram >= 1.5x plain on copy-heavy ({speedup:.2f}x)": speedup >= 1.5,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    res = measure(args.model, args.new_tokens, args.quick, args.threads)
    report(res)
    marks = targets(res)
    for name, ok in marks.items():
        print(f"  [{'met' if ok else 'MISSED'}] {name}")
    res["targets"] = marks
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "llamacpp.json").write_text(json.dumps(res, indent=2))
    print(f"\nwrote {RESULTS / 'llamacpp.json'}")


if __name__ == "__main__":
    main()
