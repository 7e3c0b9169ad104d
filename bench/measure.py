"""The measures that need no server: HF ``generate`` baselines and the offline engine,
on whatever device the engine's model runs (``make bench`` on CPU, ``bench.cuda`` on a GPU).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.llm_engine import LLMEngine
from engine.runners.select import torch_runner
from engine.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results"

PROMPTS = [
    "The history of the Roman Empire is",
    "Write a short story about a robot who learns to paint.",
    "Explain how a transistor works in simple terms.",
    "List ten fruits and their colours:",
    "def quicksort(arr):",
    "The weather today in London is",
    "Describe the water cycle for a ten year old.",
    "In a small village by the sea, there lived",
]


@dataclass
class Row:
    name: str
    tok_s: float
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    tpot_p50: float | None = None
    ratios: dict[str, float] = field(default_factory=dict)


# ---- report --------------------------------------------------------------------------

def fmt(x: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def print_table(rows: list[Row]) -> None:
    print(f"\n{'run':48} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9}  ratios")
    for r in rows:
        ratios = ", ".join(f"{v:.2f}x {k}" for k, v in r.ratios.items())
        print(f"{r.name:48} {r.tok_s:8.1f} {fmt(r.ttft_p50):>9} {fmt(r.ttft_p99):>9} "
              f"{fmt(r.tpot_p50):>9}  {ratios}")


def interleaved_runs(rounds: int, measures: dict[str, Callable[[], Row]]
                     ) -> dict[str, list[Row]]:
    """Each measure run ``rounds`` times in turn, the order reversed every other round
    (A B C C B A A B C ...): this CPU's speed drifts over minutes, so rows compared as a
    ratio are taken side by side rather than minutes apart, and none always runs right
    after the same other one (a fixed order read 0.91x where alternating read 0.99x for
    the same engines in bench.spec). Returns every run, in round order."""
    runs: dict[str, list[Row]] = {name: [] for name in measures}
    for r in range(rounds):
        for name in (list(measures) if r % 2 == 0 else list(reversed(measures))):
            runs[name].append(measures[name]())
    return runs


def median_run(rows: list[Row]) -> Row:
    return sorted(rows, key=lambda r: r.tok_s)[len(rows) // 2]


def interleaved(rounds: int, measures: dict[str, Callable[[], Row]]) -> dict[str, Row]:
    """``interleaved_runs``, keeping the run of median speed of each measure."""
    return {name: median_run(rs) for name, rs in interleaved_runs(rounds, measures).items()}


def paired_ratio(runs: list[Row], baseline: list[Row]) -> float:
    """Median over rounds of ``run / baseline`` taken in the same round: drift within a
    bench (here up to 15% between rounds a minute apart) cancels round by round, where a
    ratio of two medians can pair a fast round's run with a slow round's baseline."""
    return statistics.median(a.tok_s / b.tok_s for a, b in zip(runs, baseline, strict=True))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def prompts(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] + f" ({i})" * (i >= len(PROMPTS)) for i in range(n)]


# ---- HF baselines (stock transformers: the caller wraps them in stock_transformers) ----

def hf_sequential(engine: LLMEngine, n_req: int, new: int) -> Row:
    model, tok = torch_runner(engine.runner).model, engine.tokenizer
    total, ttfts = 0.0, []
    with torch.inference_mode():
        for p in prompts(n_req):
            ids = torch.tensor([tok(p)["input_ids"]], device=model.device)
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False)
            ttfts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            total += time.perf_counter() - t0
    tpot = (total - sum(ttfts)) / (n_req * (new - 1))
    return Row("HF generate, batch 1 sequential", n_req * new / total,
               statistics.median(ttfts), pct(ttfts, 0.99), tpot)


def hf_static(engine: LLMEngine, batch: int, new: int) -> Row:
    model, tok = torch_runner(engine.runner).model, engine.tokenizer
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts(batch), return_tensors="pt", padding=True).to(model.device)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    return Row(f"HF generate, static batch {batch}", batch * new / dt)


# ---- genserve ------------------------------------------------------------------------

def engine_offline(engine: LLMEngine, batch: int, new: int) -> Row:
    params = SamplingParams(max_new_tokens=new, min_new_tokens=new)
    for i, p in enumerate(prompts(batch)):
        engine.add_request(f"off{i}", engine.tokenizer(p)["input_ids"], params)
    t0 = time.perf_counter()
    while engine.has_work:
        engine.step()
    return Row(f"genserve engine offline, {batch} requests", batch * new /
               (time.perf_counter() - t0))


def engine_sequential(engine: LLMEngine, n_req: int, new: int) -> Row:
    """One request at a time, prefill included: the offline twin of one gRPC client."""
    params = SamplingParams(max_new_tokens=new, min_new_tokens=new)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts(n_req)):
        engine.add_request(f"seq{i}", engine.tokenizer(p)["input_ids"], params)
        while engine.has_work:
            engine.step()
    return Row("genserve engine offline, batch 1 sequential",
               n_req * new / (time.perf_counter() - t0))


