"""``make bench``: genserve against HF ``generate``, measured side by side in one run.

Absolute speeds on a shared CPU drift by up to 2x between runs (and by 20% within one), so
every figure is also given as a ratio to an HF baseline in the same process, on the same
weights (the engine's model switched to stock SDPA attention for the baselines). The rows
the targets compare (HF batch 1, the offline engine at batch 1, one gRPC client; HF static
32 and 32 gRPC clients) are measured interleaved, A B C A B C, and the median run of each
kept, so a drift hits both sides of a ratio alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from bench import (
    adapters,
    compiled,
    default_server,
    prefix,
    processors,
    spec,
    structured,
    structured_coverage,
    tensor_parallel,
)
from bench.measure import (
    RESULTS,
    Row,
    engine_offline,
    engine_sequential,
    hf_sequential,
    hf_static,
    interleaved,
    print_table,
    prompts,
)
from bench.server import cli_generate_seconds, free_port, grpc_clients, start_server_process
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.runners.select import llama_cpp_available, torch_runner
from engine.runners.torch import stock_transformers


def plot(rows: list[Row], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot is a nicety; the JSON and the table are the record
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.barh([r.name for r in rows][::-1], [r.tok_s for r in rows][::-1])
    ax.set_xlabel("tokens/s (higher is better)")
    ax.set_title("genserve vs HF generate, same run")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    ap.add_argument("--skip-llamacpp", action="store_true",
                    help="leave out the llama.cpp runner's rows (bench/llamacpp.py)")
    ap.add_argument("--skip-prefix", action="store_true",
                    help="leave out the prefix-caching rows (bench/prefix.py)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    new = args.new_tokens
    seq_n = 2 if args.quick else 4

    # The torch runner: these rows measure it against HF (bench/llamacpp.py: llama.cpp's).
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=64, runner="torch"))
    runner = torch_runner(engine.runner)

    def hf(fn: Callable[[LLMEngine, int, int], Row], n: int) -> Callable[[], Row]:
        def run() -> Row:
            with stock_transformers(runner.model):
                return fn(engine, n, new)
        return run

    # What `genserve serve` runs: packed linears (CPU) and the compiled decode step.
    warm = runner.warmup()
    engine_offline(engine, 4, 8)  # warm-up
    off = engine_offline(engine, 32, new)
    graphs, runner.decode_graphs = runner.decode_graphs, None
    # Eager from here: the speculative engines share these weights but not the graphs.
    overlap = processors.measure(
        engine, [engine.tokenizer(p)["input_ids"] for p in prompts(16)])
    structured_res = structured.measure(engine)
    spec_res = spec.measure(engine, quick=args.quick)
    runner.decode_graphs = graphs
    compiled_res = compiled.measure(engine)
    compiled_res["warmup"] = {"seconds": warm.seconds, "graphs": [
        (g.rows, round(g.seconds, 1), g.status) for g in warm.graphs]}
    gc.collect()
    port = free_port()
    RESULTS.mkdir(parents=True, exist_ok=True)
    server = start_server_process(args.model, port, RESULTS / "server.log")
    address = f"127.0.0.1:{port}"
    cli_s = statistics.median(cli_generate_seconds(address) for _ in range(3))
    # The ratios the targets read, taken side by side (the idle engine uses no CPU while
    # the server runs, and the server none while the engine does).
    batch1 = interleaved(2 if args.quick else 3, {
        "hf": hf(hf_sequential, seq_n),
        "offline": lambda: engine_sequential(engine, seq_n, new),
        "grpc": lambda: grpc_clients(address, 1, seq_n, new)})
    batch32 = interleaved(1 if args.quick else 2, {
        "hf": hf(hf_static, 32), "grpc": lambda: grpc_clients(address, 32, 1, new)})
    hf1, off1, g1 = batch1["hf"], batch1["offline"], batch1["grpc"]
    hf32, g32 = batch32["hf"], batch32["grpc"]
    g8 = grpc_clients(address, 8, 2 if not args.quick else 1, new)
    rows = [hf1, hf32, off1, off, g1, g8, g32]
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(60)
    startup = {"serving_s": server.serving_s, "compiled_s": server.compiled_s,
               "cli_generate_s": cli_s}
    # LoRA: 32 clients over 4 adapters + base vs base only, and first-use load times
    adapters_res = adapters.measure(args.model, new, args.quick)
    # JSONSchemaBench coverage, quick variant (30 schemas, every backend and AUTO, ~1-2 min;
    # its own worker processes, run with the server stopped); `make bench-structured` runs
    # the whole sample
    coverage = structured_coverage.run(["--quick", "--out",
                                        str(RESULTS / "structured_coverage_quick.json")])
    # The default server (default flags, a fresh start: its first minute too) on the rows a
    # user meets first, against HF and llama.cpp itself (issue 28).
    gc.collect()
    default_res = default_server.measure(args.model, new, args.quick)
    llamacpp_res = None
    if llama_cpp_available() and not args.skip_llamacpp:
        from bench import llamacpp

        del engine, runner
        gc.collect()
        llamacpp_res = llamacpp.measure(args.model, new, args.quick)
    prefix_res = None
    if not args.skip_prefix:  # caching on vs off, each runner, two servers at a time
        gc.collect()
        prefix_res = prefix.measure(args.model, args.quick, (
            "llamacpp", "torch") if llama_cpp_available() and not args.skip_llamacpp else (
            "torch",))
    gc.collect()
    tp_res = tensor_parallel.measure(args.model, (1,) if args.quick else (1, 8),
                                     reps=2 if args.quick else 3)

    for r in rows[3:]:
        r.ratios = {"HF static 32": r.tok_s / hf32.tok_s, "HF batch 1": r.tok_s / hf1.tok_s}
    off1.ratios = {"HF batch 1": off1.tok_s / hf1.tok_s}
    g1.ratios = {"HF batch 1": g1.tok_s / hf1.tok_s, "offline batch 1": g1.tok_s / off1.tok_s}
    if g1.ttft_p50 and hf1.ttft_p50:
        g1.ratios["HF TTFT (lower is better)"] = g1.ttft_p50 / hf1.ttft_p50

    print_table(rows)
    print(f"\nstart-up: SERVING {startup['serving_s']:.1f} s after the process started, "
          f"decode step compiled in the background by {startup['compiled_s'] or 0:.1f} s; "
          f"`genserve generate` (8 tokens) {cli_s:.2f} s wall")
    print(f"\nbatched processor prepare (batch {overlap['batch']}, "
          f"{overlap['prepare_ms']:.1f} ms of work a step): step "
          f"{overlap['step_ms_no_processor']:.1f} ms without, "
          f"{overlap['step_ms_prepare_serial']:.1f} ms prepared inline, "
          f"{overlap['step_ms_prepare_overlapped']:.1f} ms overlapped with the forward "
          f"-> {overlap['fraction_hidden']:.0%} of the prepare hidden")
    structured.report(structured_res)
    spec.report(spec_res)
    compiled.report(compiled_res)
    adapters.report(adapters_res)
    default_server.report(default_res)
    if llamacpp_res is not None:
        llamacpp.report(llamacpp_res)
    if prefix_res is not None:
        prefix.report(prefix_res)
    tensor_parallel.report(tp_res)
    targets = {
        "gRPC batch-1 decode >= 1.5x HF batch 1": g1.tok_s / hf1.tok_s >= 1.5,
        "32 gRPC clients >= 1.5x HF static batch 32": g32.tok_s / hf32.tok_s >= 1.5,
        "32 gRPC clients >= 10x HF sequential": g32.tok_s / hf1.tok_s >= 10.0,
        "one gRPC client within 5% of the offline engine at batch 1":
            g1.tok_s >= 0.95 * off1.tok_s,
        "gRPC TTFT p50 at batch 1 <= HF's": (g1.ttft_p50 or 0) <= (hf1.ttft_p50 or 0),
        "second start SERVING in < 10 s": float(startup["serving_s"] or 0) < 10.0,
        **structured.targets(structured_res),
        **{f"{name} (coverage, quick sample of {coverage['schemas_n']})": ok
           for name, ok in coverage["targets"].items()},
        **spec.targets(spec_res),
        **adapters.targets(adapters_res),
        **default_server.targets(default_res),
        **(llamacpp.targets(llamacpp_res) if llamacpp_res is not None else {}),
        **(prefix.targets(prefix_res) if prefix_res is not None else {}),
    }
    print()
    for name, ok in targets.items():
        print(f"  [{'met' if ok else 'MISSED'}] {name}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = {"when": stamp, "new_tokens": new, "rows": [asdict(r) for r in rows],
           "processor_overlap": overlap, "structured": structured_res,
           "speculative": spec_res, "compiled_decode": compiled_res, "startup": startup,
           "adapters": adapters_res,
           "tensor_parallel": tp_res,
           "structured_coverage_quick": {k: coverage[k] for k in ("summaries", "targets",
                                                                  "schemas_n", "limit_s")},
           "targets": targets, "torch_threads": torch.get_num_threads(),
           "llamacpp": llamacpp_res, "default_server": default_res,
           "prefix_caching": prefix_res}
    (RESULTS / "serving.json").write_text(json.dumps(out, indent=2))
    plot(rows, RESULTS / "serving.png")
    print(f"\nwrote {RESULTS / 'serving.json'} and serving.png")


if __name__ == "__main__":
    main()
