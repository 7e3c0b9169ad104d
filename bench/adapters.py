"""LoRA adapters on the torch runner: 32 concurrent clients spread over 4 adapters and the
base model against the same load on the base model alone, and each adapter's first-use
load time.

Both loads run on one ``AsyncEngine`` (adapters enabled, so the difference is what mixed
adapter rows cost in a step), alternating A B B A so the drift of a shared CPU hits both;
the ratio is the median of the per-round ratios. The adapters are random PEFT-format
LoRAs (rank ``--rank``, every linear layer of the decoder) written to a temporary
directory, so no adapter download is needed.

``python -m bench.adapters [--model PATH] [--clients 32] [--new-tokens 64] [--quick]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.measure import prompts
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.runners.select import torch_runner
from engine.sampling_params import SamplingParams

TARGET = 0.8  # mixed adapters >= 0.8x the base-only load


def write_adapters(model: Any, root: Path, names: list[str], rank: int) -> None:
    """Random LoRA adapters of ``model`` in PEFT's file layout (no peft needed)."""
    from safetensors.torch import save_file

    head = model.get_output_embeddings()
    linears = {name: mod for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and mod is not head}
    targets = sorted({name.rsplit(".", 1)[-1] for name in linears})
    gen = torch.Generator().manual_seed(0)
    for name in names:
        d = root / name
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": targets, "bias": "none"}))
        tensors = {}
        for module, mod in linears.items():
            key = f"base_model.model.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(
                rank, mod.in_features, generator=gen) * mod.in_features ** -0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(
                mod.out_features, rank, generator=gen) * 0.01
        save_file(tensors, str(d / "adapter_model.safetensors"))


async def _clients(engine: AsyncEngine, ids: list[list[int]], adapter_ids: list[str],
                   new: int) -> float:
    """tokens/s of one request per client, all at once."""
    params = SamplingParams(max_new_tokens=new, min_new_tokens=new)
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.complete(None, p, params, adapter_id=a)
                                  for p, a in zip(ids, adapter_ids, strict=True)))
    elapsed = time.perf_counter() - start
    return sum(o.usage.completion_tokens for o in outs) / elapsed


async def _measure(engine: AsyncEngine, names: list[str], clients: int, new: int,
                   rounds: int) -> dict:
    engine.start()
    try:
        ids = [engine.tokenizer(p)["input_ids"] for p in prompts(clients)]
        first_use = {}
        for name in names:  # first use: one request each, timed end to end
            t0 = time.perf_counter()
            await engine.complete(None, ids[0], SamplingParams(max_new_tokens=1),
                                  adapter_id=name)
            first_use[name] = {"request_s": time.perf_counter() - t0}
        for status in engine.adapter_status():
            first_use[status.adapter_id]["load_s"] = status.load_seconds
        spread = [([""] + names)[c % (len(names) + 1)] for c in range(clients)]
        await _clients(engine, ids[:4], spread[:4], 4)  # warm-up
        mixed: list[float] = []
        base: list[float] = []
        for r in range(rounds):
            order = [("mixed", spread), ("base", [""] * clients)]
            for label, adapters in order if r % 2 == 0 else order[::-1]:
                (mixed if label == "mixed" else base).append(
                    await _clients(engine, ids, adapters, new))
    finally:
        await engine.shutdown()
    return {"clients": clients, "adapters": len(names), "new_tokens": new,
            "mixed_tok_s": statistics.median(mixed), "base_tok_s": statistics.median(base),
            "ratio": statistics.median(m / b for m, b in zip(mixed, base, strict=True)),
            "first_use": first_use}


def measure(model: str, new: int = 64, quick: bool = False, clients: int = 32,
            rank: int = 8, adapters: int = 4) -> dict:
    names = [f"lora{i}" for i in range(adapters)]
    with tempfile.TemporaryDirectory(prefix="genserve-adapters-") as tmp:
        config = EngineConfig(model=model, runner="torch", max_num_seqs=64,
                              adapter_cache=tmp, max_loras=adapters, max_lora_rank=rank)
        engine = LLMEngine(config)
        write_adapters(torch_runner(engine.runner).model, Path(tmp), names, rank)
        res = asyncio.run(_measure(AsyncEngine(engine), names, clients, new,
                                   2 if quick else 4))
    res["rank"] = rank
    return res


def report(res: dict) -> None:
    print(f"\nLoRA adapters (torch runner, rank {res['rank']}, every decoder linear): "
          f"{res['clients']} clients over {res['adapters']} adapters + base "
          f"{res['mixed_tok_s']:.1f} tok/s vs base only {res['base_tok_s']:.1f} tok/s "
          f"-> {res['ratio']:.2f}x (target >= {TARGET}x)")
    for name, f in res["first_use"].items():
        print(f"  first use of {name}: loaded in {f.get('load_s', 0) * 1000:.0f} ms, "
              f"first request {f['request_s'] * 1000:.0f} ms")


def targets(res: dict) -> dict[str, bool]:
    return {f"{res['clients']} clients over {res['adapters']} adapters + base >= {TARGET}x "
            f"base only ({res['ratio']:.2f}x)": res["ratio"] >= TARGET}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="two rounds instead of four")
    args = ap.parse_args(argv)
    res = measure(args.model, args.new_tokens, args.quick, args.clients, args.rank)
    report(res)
    for name, ok in targets(res).items():
        print(f"  [{'met' if ok else 'MISSED'}] {name}")


if __name__ == "__main__":
    main()
