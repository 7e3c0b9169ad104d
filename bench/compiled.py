"""Decode-step variants: plain eager (``F.linear``) against what genserve runs on CPU,
oneDNN-packed linear weights, compiled (the default) and eager (``--enforce-eager``).
ms per decode step through the whole engine step (scheduling, forward, sampling), the
variants alternating in one process so a busy machine slows them alike, plus the start-up
compile time.

``python -m bench.compiled [--model PATH] [--batches 1,8,32]``
"""

from __future__ import annotations

import argparse
import statistics

from bench.processors import decode_steps
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.runners.select import torch_runner
from engine.runners.torch import can_pack, pack_linears, unpack_linears
from engine.sampling_params import SamplingParams

PROMPT = "The history of the Roman Empire is"


def measure(engine: LLMEngine, batches: tuple[int, ...] = (1, 8, 32), new: int = 16,
            reps: int = 4) -> dict:
    """Builds the compiled step if the runner has none yet (that time is reported), and
    compares plain eager steps (``F.linear``) with what genserve runs: packed linears,
    eager and compiled. Leaves the runner packed, with its graphs."""
    runner = torch_runner(engine.runner)
    warmup = None
    if runner.decode_graphs is None:
        report = runner.warmup()
        warmup = {"seconds": report.seconds,
                  "graphs": [(g.rows, round(g.seconds, 1), g.status) for g in report.graphs]}
    graphs = runner.decode_graphs
    packs = can_pack(runner.device, runner.dtype)
    modes = ["eager", "compiled"] + (["packed eager"] if packs else [])
    ids = engine.tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(max_new_tokens=new, min_new_tokens=new)
    rows = []
    for batch in batches:
        ms: dict[str, list[float]] = {m: [] for m in modes}
        for rep in range(reps + 1):
            for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
                if mode == "eager" and packs:
                    unpack_linears(runner.model)
                elif packs:
                    pack_linears(runner.model)
                runner.decode_graphs = graphs if mode == "compiled" else None
                steps, _ = decode_steps(engine, [ids] * batch, [params] * batch)
                if rep:  # the first round warms them all
                    ms[mode].append(statistics.median(steps) * 1000)
        rows.append({"batch": batch} | {f"{m}_ms": statistics.median(ms[m]) for m in modes})
    if packs:
        pack_linears(runner.model)
    runner.decode_graphs = graphs
    return {"warmup": warmup, "ready": graphs is not None, "packed": packs, "rows": rows}


def report(res: dict) -> None:
    warm = res["warmup"]
    if warm is not None:
        built = ", ".join(f"{rows} rows {s}s ({status})" for rows, s, status in warm["graphs"])
        print(f"\ncompiled decode step: built in {warm['seconds']:.1f}s: {built}")
    if not res["ready"]:
        print("compiled decode step: nothing compiled (enforce_eager or a failed build)")
        return
    what = "packed + compiled" if res.get("packed") else "compiled"
    for r in res["rows"]:
        line = (f"  decode step, batch {r['batch']:3d}: plain eager {r['eager_ms']:6.1f} ms, "
                f"{what} {r['compiled_ms']:6.1f} ms ({r['eager_ms'] / r['compiled_ms']:.2f}x)")
        if "packed eager_ms" in r:
            line += (f", packed eager {r['packed eager_ms']:6.1f} ms "
                     f"({r['eager_ms'] / r['packed eager_ms']:.2f}x)")
        print(line)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(","))
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=max(64, *batches),
                                    runner="torch"))
    report(measure(engine, batches, reps=args.reps))


if __name__ == "__main__":
    main()
