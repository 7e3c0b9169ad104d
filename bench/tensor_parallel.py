"""Tensor parallelism: the model sharded over two processes (TP=2, gloo) against one
process (TP=1), decode tokens/s through the whole engine step at a few batch sizes, the two
engines alternating in one run so a busy machine slows both alike. No target: on a 2-core
CPU both ranks share the cores the single process had, so TP=2 measures the cost of the
per-step broadcast and the all-reduces more than any gain; multi-GPU speed is unmeasured.

``python -m bench.tensor_parallel [--model PATH] [--batches 1,8] [--new 16] [--reps 3]``
(``make bench`` runs it on the default model.)
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.measure import prompts
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def _decode_tok_s(engine: LLMEngine, batch: int, new: int) -> float:
    """Tokens/s of ``batch`` prompts generating ``new`` tokens each (after a prefill that
    is not timed: the steps are timed from the first decode on)."""
    params = SamplingParams(max_new_tokens=new, min_new_tokens=new)
    for i, text in enumerate(prompts(batch)):
        engine.add_request(f"tp-{i}", engine.tokenizer(text)["input_ids"], params)
    engine.step()  # the prefills (every prompt fits one step's budget)
    start, tokens = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        tokens += engine.last_step_tokens
    return tokens / (time.perf_counter() - start)


def shardable(model: str) -> str:
    """``model``, or when two ranks cannot split its heads (the default model has 9 query
    and 3 KV heads), a random model of its shape with 8 query and 2 KV heads (head size
    72, same hidden and MLP sizes): the speed of a step hardly depends on the values."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from engine.loading.model_loader import load_config, load_tokenizer, resolve_model

    config = load_config(resolve_model(model))
    if config.num_attention_heads % 2 == 0 and config.num_key_value_heads % 2 == 0:
        return model
    config.head_dim = config.hidden_size // 8
    config.num_attention_heads, config.num_key_value_heads = 8, 2
    out = tempfile.mkdtemp(prefix="genserve-tp-bench-")
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    load_tokenizer(resolve_model(model)).save_pretrained(out)
    return out


def measure(model: str, batches: tuple[int, ...] = (1, 8), new: int = 16,
            reps: int = 3, enforce_eager: bool = True) -> dict:
    """Both engines eager by default (compiling both would add minutes of start-up)."""
    model = shardable(model)
    engines = {tp: LLMEngine(EngineConfig(model=model, tensor_parallel_size=tp,
                                          runner="torch", enforce_eager=enforce_eager,
                                          kv_cache_memory=256 << 20))
               for tp in (1, 2)}
    try:
        for engine in engines.values():
            _decode_tok_s(engine, 1, 2)  # warm-up
        runs: dict[tuple[int, int], list[float]] = {}
        for _ in range(reps):
            for batch in batches:
                for tp, engine in engines.items():  # interleaved: TP=1, TP=2, TP=1, ...
                    runs.setdefault((tp, batch), []).append(_decode_tok_s(engine, batch, new))
    finally:
        engines[2].runner.close()
    rows = []
    for batch in batches:
        one = statistics.median(runs[1, batch])
        two = statistics.median(runs[2, batch])
        rows.append({"batch": batch, "tp1_tok_s": round(one, 1), "tp2_tok_s": round(two, 1),
                     "ratio": round(two / one, 2)})
    return {"model": model, "new_tokens": new, "reps": reps, "eager": enforce_eager,
            "rows": rows}


def report(res: dict) -> None:
    print(f"\ntensor parallelism on this CPU ({res['model']}, "
          f"{'eager' if res['eager'] else 'compiled'}, median of {res['reps']} interleaved "
          f"runs; no target: two ranks share two cores):")
    print("  batch | TP=1 tok/s | TP=2 tok/s | TP=2 / TP=1")
    for r in res["rows"]:
        print(f"  {r['batch']:5d} | {r['tp1_tok_s']:10.1f} | {r['tp2_tok_s']:10.1f} | "
              f"{r['ratio']:.2f}x")
    print("  multi-GPU speed: unmeasured (no multi-GPU machine lent yet)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.tensor_parallel")
    ap.add_argument("--model", default="default")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    report(measure(args.model, tuple(int(b) for b in args.batches.split(",")), args.new,
                   args.reps))


if __name__ == "__main__":
    main()
