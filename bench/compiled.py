"""The compiled decode step against the eager one: ms per decode step through the whole
engine step (scheduling, forward, sampling), eager and compiled runs alternating in one
process so a busy machine slows both alike, plus the start-up compile time.

``python -m bench.compiled [--model PATH] [--batches 1,8,32]``
"""

from __future__ import annotations

import argparse
import statistics

from bench.processors import decode_steps
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PROMPT = "The history of the Roman Empire is"


def measure(engine: LLMEngine, batches: tuple[int, ...] = (1, 8, 32), new: int = 16,
            reps: int = 4) -> dict:
    """Builds the compiled step if it is not built yet (that time is reported), measures,
    and leaves the runner as it found it."""
    runner = engine.runner
    before = runner.decode_graphs
    warmup = None
    if before is None:
        report = runner.warmup()
        warmup = {"seconds": report.seconds,
                  "graphs": [(g.rows, round(g.seconds, 1), g.status) for g in report.graphs]}
    graphs = runner.decode_graphs
    ids = engine.tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(max_new_tokens=new, min_new_tokens=new)
    rows = []
    for batch in batches:
        ms: dict[str, list[float]] = {"eager": [], "compiled": []}
        for rep in range(reps + 1):
            order = ["eager", "compiled"] if rep % 2 else ["compiled", "eager"]
            for mode in order:
                runner.decode_graphs = graphs if mode == "compiled" else None
                steps, _ = decode_steps(engine, [ids] * batch, [params] * batch)
                if rep:  # the first round warms both
                    ms[mode].append(statistics.median(steps) * 1000)
        eager, compiled = statistics.median(ms["eager"]), statistics.median(ms["compiled"])
        rows.append({"batch": batch, "eager_ms": eager, "compiled_ms": compiled,
                     "speedup": eager / compiled})
    runner.decode_graphs = before
    return {"warmup": warmup, "ready": graphs is not None, "rows": rows}


def report(res: dict) -> None:
    warm = res["warmup"]
    if warm is not None:
        built = ", ".join(f"{rows} rows {s}s ({status})" for rows, s, status in warm["graphs"])
        print(f"\ncompiled decode step: built in {warm['seconds']:.1f}s: {built}")
    if not res["ready"]:
        print("compiled decode step: nothing compiled (enforce_eager or a failed build)")
        return
    for r in res["rows"]:
        print(f"  decode step, batch {r['batch']:3d}: eager {r['eager_ms']:6.1f} ms, "
              f"compiled {r['compiled_ms']:6.1f} ms -> {r['speedup']:.2f}x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(","))
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=max(64, *batches)))
    report(measure(engine, batches, reps=args.reps))


if __name__ == "__main__":
    main()
