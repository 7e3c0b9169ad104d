"""``python -m bench.cuda``: the CUDA path (bf16, CUDA graphs) against HF ``generate`` on
the same GPU and weights, measured side by side in one run.

Made for a lent GPU machine, which has no copy of the default model: ``--random-shape DIR``
builds a model with the architecture in ``DIR/config.json`` (e.g. the default model's
weights-cache entry) and random weights, with ``DIR``'s tokenizer. Speed does not depend on
the weights' values; every run is forced to its full length (``min_new_tokens``), so EOS
cannot end one early (greedy parity is proved by tests/engine/runners/test_cuda_graphs.py, not
here). The gRPC rows run a real ``genserve serve`` process on the same GPU (structured
output off: the GPU machine has no grammar packages). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.measure import (
    Row,
    engine_offline,
    engine_sequential,
    hf_sequential,
    hf_static,
    interleaved,
)
from bench.server import free_port, grpc_clients, start_server_process
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.runners.select import torch_runner
from engine.runners.torch import stock_transformers


def random_model(shape_dir: Path, out: Path) -> Path:
    """A model of ``shape_dir``'s architecture with random weights, and its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(shape_dir)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(shape_dir).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", help="an HF model directory")
    ap.add_argument("--random-shape", type=Path,
                    help="a directory with config.json + tokenizer: random weights of it")
    ap.add_argument("--dtype", default="auto", help="auto = bf16 on CUDA")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("bench/results/cuda.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.cuda needs a CUDA device")
    model = args.model or str(random_model(args.random_shape, Path(tempfile.mkdtemp())))
    new = args.new_tokens
    cfg = EngineConfig(model=model, runner="torch", dtype=args.dtype, max_num_seqs=64)
    graphs = LLMEngine(cfg)
    t0 = time.perf_counter()
    warm = graphs.runner.warmup()
    capture_s = time.perf_counter() - t0
    eager = LLMEngine(EngineConfig(model=model, runner="torch", dtype=args.dtype,
                                   max_num_seqs=64, enforce_eager=True), share_weights=graphs)
    hf_model = torch_runner(graphs.runner).model

    def hf(fn, n: int):
        def run() -> Row:
            with stock_transformers(hf_model):
                return fn(graphs, n, new)
        return run

    for e in (graphs, eager):  # warm-up: allocator, kernels' autotuning
        engine_offline(e, 4, 8)
    with stock_transformers(hf_model):
        hf_static(graphs, 4, 8)
    port = free_port()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    server = start_server_process(model, port, args.out.with_suffix(".server.log"), "torch",
                                  ("--dtype", args.dtype, "--no-structured-output",
                                   "--metrics-port", "0"))
    address = f"127.0.0.1:{port}"
    try:
        grpc_clients(address, 4, 1, 8)  # warm-up
        batch1 = interleaved(3, {
            "hf": hf(hf_sequential, 4),
            "eager": lambda: engine_sequential(eager, 4, new),
            "graphs": lambda: engine_sequential(graphs, 4, new),
            "gRPC": lambda: grpc_clients(address, 1, 4, new)})
        batch32 = interleaved(3, {
            "hf": hf(hf_static, 32),
            "eager": lambda: engine_offline(eager, 32, new),
            "graphs": lambda: engine_offline(graphs, 32, new),
            "gRPC": lambda: grpc_clients(address, 32, 1, new)})
        batch64 = interleaved(2, {
            "hf": hf(hf_static, 64),
            "graphs": lambda: engine_offline(graphs, 64, new),
            "gRPC": lambda: grpc_clients(address, 64, 1, new)})
    finally:
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(60)

    table = []
    for label, runs, base in (("batch 1 sequential", batch1, batch1["hf"]),
                              ("32 requests", batch32, batch32["hf"]),
                              ("64 requests", batch64, batch64["hf"])):
        for name, row in runs.items():
            row.name = f"{name}, {label}"
            if name == "graphs":
                row.name = f"engine offline (CUDA graphs), {label}"
            elif name == "eager":
                row.name = f"engine offline (eager), {label}"
            row.ratios = {"HF": row.tok_s / base.tok_s}
            table.append(row)
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}; dtype {graphs.runner.quantization}; {new} new tokens; "
          f"CUDA graphs {', '.join(warm.ready)} rows captured in {capture_s:.1f} s")
    print(f"{'run':40} {'tok/s':>10} {'x HF':>7} {'TTFT p50':>9}")
    for r in table:
        ttft = f"{r.ttft_p50 * 1000:.1f} ms" if r.ttft_p50 else ""
        print(f"{r.name:40} {r.tok_s:10.1f} {r.ratios['HF']:7.2f} {ttft:>9}")
    print(f"server: SERVING {server.serving_s:.1f} s after start (graphs captured first)")
    args.out.write_text(json.dumps({
        "device": dev, "dtype": graphs.runner.quantization, "new_tokens": new,
        "capture_s": capture_s, "graphs": warm.ready, "serving_s": server.serving_s,
        "rows": [asdict(r) for r in table]}, indent=2))


if __name__ == "__main__":
    main()
