"""Speculative decoding at batch 1 on the real model, and its cost at 32 concurrent requests.

Every figure is a ratio to plain decoding measured in the same run on the same weights:
copy-heavy prompts (edit code, repeat a list with one change, extract fields from a
passage) where prompt lookup shines, and open-ended chat where it must not cost much.
HF's own prompt lookup (``prompt_lookup_num_tokens``) is measured for reference.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from bench.structured import chat_ids
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.runners.select import torch_runner
from engine.runners.torch import stock_transformers
from engine.sampling_params import SamplingParams
from specdecode.config import SpeculativeConfig
from specdecode.worker import speculator_for

PASSAGE = ("Order #4471 was placed by Maria Keller on 12 March 2024. She ordered three "
           "ceramic mugs (item MUG-22, 9.50 EUR each) and one teapot (item TPT-07, 32.00 "
           "EUR), to be shipped to Lindenstrasse 14, 10969 Berlin, Germany, by express "
           "delivery. Her phone number is +49 30 1234567 and her email is m.keller@example.de.")
COPY_HEAVY = [
    "Rewrite this Python function so that it is named `total_price` instead of `calc`, "
    "and change nothing else:\n\n```python\ndef calc(items, tax_rate):\n    subtotal = 0\n"
    "    for item in items:\n        subtotal += item.price * item.quantity\n"
    "    tax = subtotal * tax_rate\n    return subtotal + tax\n```",
    "Repeat this shopping list exactly, but replace 'milk' with 'oat milk':\n"
    "- eggs\n- bread\n- milk\n- butter\n- apples\n- cheese\n- coffee\n- rice",
    f"Extract the customer name, order number, items, address, phone and email from this "
    f"passage, one per line as 'field: value'.\n\n{PASSAGE}",
]
OPEN_ENDED = [
    "Tell me a short story about a lighthouse keeper.",
    "What are some good habits for staying healthy?",
    "Explain why the sky is blue.",
]
METHODS = {
    "ngram k=8": SpeculativeConfig(method="ngram", num_spec_tokens=8, ngram_min=1,
                                   ngram_max=3),
    "ngram k=8 multi": SpeculativeConfig(method="ngram", num_spec_tokens=8, ngram_min=1,
                                         ngram_max=3, scorer="multi_token"),
    "self:16 k=3": SpeculativeConfig(method="draft", draft_model="self:16", num_spec_tokens=3),
}


def _run_one(engine: LLMEngine, ids: list[int], new: int) -> tuple[int, float]:
    start = time.perf_counter()
    req = engine.add_request(f"b{time.monotonic_ns()}", ids, SamplingParams(max_new_tokens=new))
    while engine.has_work:
        engine.step()
    return req.usage.completion_tokens, time.perf_counter() - start


@dataclass
class _Tally:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0

    def add(self, engine: LLMEngine, ids: list[int], new: int) -> None:
        before = engine.stats()
        n, s = _run_one(engine, ids, new)
        after = engine.stats()
        self.tokens += n
        self.seconds += s
        self.steps += after.spec.steps - before.spec.steps
        self.proposed += after.spec.proposed - before.spec.proposed
        self.accepted += after.spec.accepted - before.spec.accepted
        self.emitted += after.spec.emitted - before.spec.emitted

    def row(self) -> dict:
        return {"tok_s": self.tokens / self.seconds,
                "acceptance": self.accepted / self.proposed if self.proposed else 0.0,
                "tokens_per_spec_step": self.emitted / self.steps if self.steps else 0.0}


def _hf_one(model, ids: list[int], new: int, lookup: int | None) -> tuple[int, float]:
    start = time.perf_counter()
    kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, **kw)
    return out.shape[1] - len(ids), time.perf_counter() - start


def hf(engine: LLMEngine, prompts: list[list[int]], new: int, reps: int) -> dict:
    """HF generate plain vs with prompt lookup, interleaved prompt by prompt."""
    totals = {"plain": [0, 0.0], "lookup10": [0, 0.0]}
    with stock_transformers(torch_runner(engine.runner).model) as model:
        for _ in range(reps):
            for ids in prompts:
                for name, lookup in (("plain", None), ("lookup10", 10)):
                    n, s = _hf_one(model, ids, new, lookup)
                    totals[name][0] += n
                    totals[name][1] += s
    return {f"copy_{k}": n / s for k, (n, s) in totals.items()}


def concurrent(engine: LLMEngine, prompts: list[list[int]], new: int) -> float:
    start = time.perf_counter()
    reqs = [engine.add_request(f"c{i}-{time.monotonic_ns()}", ids,
                               SamplingParams(max_new_tokens=new))
            for i, ids in enumerate(prompts)]
    while engine.has_work:
        engine.step()
    return sum(r.usage.completion_tokens for r in reqs) / (time.perf_counter() - start)


def measure(base: LLMEngine, new: int = 96, quick: bool = False) -> dict:
    """Runs are interleaved (each prompt on every engine in turn, ``reps`` rounds) so that
    the shared machine's drifts hit plain and speculative decoding alike."""
    copy_ids = [chat_ids(base, p) for p in COPY_HEAVY]
    open_ids = [chat_ids(base, p) for p in OPEN_ENDED]
    reps = 1 if quick else 2
    if quick:
        copy_ids, open_ids = copy_ids[:2], open_ids[:1]
    engines = {"plain": base}
    for name, spec in METHODS.items():
        engines[name] = LLMEngine(EngineConfig(model=base.config.model), share_weights=base,
                                  speculator=speculator_for(spec))
    for engine in engines.values():
        _run_one(engine, copy_ids[0], 8)  # warm-up
    tallies = {name: {"copy": _Tally(), "open": _Tally()} for name in engines}
    for _ in range(reps):
        for kind, prompts in (("copy", copy_ids), ("open", open_ids)):
            for ids in prompts:
                for name, engine in engines.items():
                    tallies[name][kind].add(engine, ids, new)
    res: dict = {"new_tokens": new, "batch1": {}}
    for name, by_kind in tallies.items():
        row = {kind: t.row() for kind, t in by_kind.items()}
        for kind in row:
            row[kind]["speedup"] = row[kind]["tok_s"] / tallies["plain"][kind].row()["tok_s"]
        res["batch1"][name] = row
    res["hf"] = hf(base, copy_ids, new, reps)
    many = ((copy_ids + open_ids) * 6)[:32]
    ngram = LLMEngine(EngineConfig(model=base.config.model, max_num_seqs=64), share_weights=base,
                      speculator=speculator_for(METHODS["ngram k=8"]))
    plain32 = spec32 = 0.0
    for rep in range(2 * reps):  # A B B A ...: a drift over minutes hits both alike
        if rep % 2 == 0:
            plain32 += concurrent(base, many, 48)
            spec32 += concurrent(ngram, many, 48)
        else:
            spec32 += concurrent(ngram, many, 48)
            plain32 += concurrent(base, many, 48)
    res["concurrent32"] = {"plain_tok_s": plain32 / (2 * reps),
                           "ngram_tok_s": spec32 / (2 * reps),
                           "ratio": spec32 / plain32, "spec_steps": ngram.stats().spec.steps}
    return res


def report(res: dict) -> None:
    print(f"\nspeculative decoding, batch 1, greedy, {res['new_tokens']} new tokens "
          "(targets: n-gram >= 2.0x plain and >= 1.2x HF prompt lookup on copy-heavy, >= 0.97x "
          "open-ended; <= 5% lost at 32)")
    plain = res["batch1"]["plain"]
    print(f"  {'plain':16} copy-heavy {plain['copy']['tok_s']:6.1f} tok/s   open-ended "
          f"{plain['open']['tok_s']:6.1f} tok/s")
    for name, row in res["batch1"].items():
        if name == "plain":
            continue
        c, o = row["copy"], row["open"]
        print(f"  {name:16} copy-heavy {c['tok_s']:6.1f} tok/s {c['speedup']:5.2f}x "
              f"(accept {c['acceptance']:.0%}, {c['tokens_per_spec_step']:.2f} tok/spec step)"
              f"   open-ended {o['tok_s']:6.1f} tok/s {o['speedup']:5.2f}x "
              f"(accept {o['acceptance']:.0%}, {o['tokens_per_spec_step']:.2f})")
    h = res["hf"]
    print(f"  HF generate on copy-heavy: plain {h['copy_plain']:.1f} tok/s, prompt lookup 10 "
          f"{h['copy_lookup10']:.1f} tok/s ({h['copy_lookup10'] / h['copy_plain']:.2f}x)")
    c = res["concurrent32"]
    print(f"  32 concurrent requests: plain {c['plain_tok_s']:.1f} tok/s, n-gram configured "
          f"{c['ngram_tok_s']:.1f} tok/s ({c['ratio']:.2f}x; {c['spec_steps']} steps "
          "speculated: auto-off above --spec-disable-batch-size)")


def targets(res: dict) -> dict[str, bool]:
    ngram = res["batch1"]["ngram k=8"]
    vs_hf = ngram["copy"]["tok_s"] / res["hf"]["copy_lookup10"]
    return {
        "n-gram >= 2.0x plain on copy-heavy prompts (batch 1)": ngram["copy"]["speedup"] >= 2.0,
        f"n-gram >= 1.2x HF prompt lookup on the same prompts ({vs_hf:.2f}x)": vs_hf >= 1.2,
        "n-gram <= 3% slower on open-ended prompts": ngram["open"]["speedup"] >= 0.97,
        "n-gram configured loses <= 5% at 32 concurrent": res["concurrent32"]["ratio"] >= 0.95,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    base = LLMEngine(EngineConfig(model=args.model, max_num_seqs=64, runner="torch"))
    res = measure(base, args.new_tokens, args.quick)
    report(res)
    for name, ok in targets(res).items():
        print(f"  [{'met' if ok else 'MISSED'}] {name}")


if __name__ == "__main__":
    main()
