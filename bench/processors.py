"""How much of a batched processor's prepare the model forward hides (issue 4).

A synthetic batched factory stands in for a grammar: per row, its prepare builds a
vocab-sized mask with single-threaded numpy work that releases the GIL (as xgrammar's C++
matcher does), costing about what a grammar bitmask costs (~0.4 ms a row); apply bans the
masked tokens in one call. torch ops would be a bad stand-in: their own OpenMP threads
would fight the forward's for the same cores.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from engine.llm_engine import LLMEngine
from engine.processors import ProcessorRunner
from engine.sampling_params import SamplingParams


class _Row:
    def __call__(self, prompt_ids, output_ids, logits):
        return logits


class SyntheticMaskFactory:
    def __init__(self, vocab: int, work: int = 2) -> None:
        self.vocab, self.work = vocab, work

    def create(self) -> _Row:
        return _Row()

    def release(self, proc) -> None:
        pass

    def prepare_batch(self, products, prompt_ids, output_ids):
        masks = np.zeros((len(products), self.vocab), dtype=bool)
        for i, out in enumerate(output_ids):
            x = np.random.default_rng(len(out)).random((self.work, self.vocab))
            masks[i] = x.mean(0) > 0.999
        return torch.from_numpy(masks)

    def apply_batch(self, masks, logits):
        return logits.masked_fill(masks.to(logits.device), -torch.inf)


def decode_steps(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
                 ) -> tuple[list[float], list[int]]:
    """Run ``prompts`` together to completion: the seconds of each step after the prefill
    and each request's number of generated tokens."""
    reqs = [engine.add_request(f"p{i}-{time.perf_counter_ns()}", ids, p)
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True))]
    engine.step()  # prefill
    steps = []
    while engine.has_work:
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return steps, [r.usage.completion_tokens for r in reqs]


def ms_per_decode_step(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
                       ) -> float:
    """Run ``prompts`` together to completion; mean ms of the steps after the prefill."""
    steps, _ = decode_steps(engine, prompts, [params] * len(prompts))
    return sum(steps) / max(1, len(steps)) * 1000


def _steps_ms(engine: LLMEngine, prompts: list[list[int]], processors: list, new: int) -> float:
    return ms_per_decode_step(engine, prompts, SamplingParams(
        max_new_tokens=new, min_new_tokens=new, logits_processors=processors))


def measure(engine: LLMEngine, prompts: list[list[int]], new: int = 24) -> dict[str, float]:
    factory = SyntheticMaskFactory(engine.info.vocab_size)
    t0 = time.perf_counter()
    factory.prepare_batch([None] * len(prompts), prompts, [[1]] * len(prompts))
    prepare_ms = (time.perf_counter() - t0) * 1000
    base = _steps_ms(engine, prompts, [], new)
    runner = engine.processor_runner
    try:
        engine.processor_runner = ProcessorRunner(overlap=False)
        serial = _steps_ms(engine, prompts, [factory], new)
        engine.processor_runner = ProcessorRunner(overlap=True)
        overlapped = _steps_ms(engine, prompts, [factory], new)
    finally:
        engine.processor_runner = runner
    added_serial = serial - base
    hidden = (serial - overlapped) / added_serial if added_serial > 0 else 0.0
    return {"batch": len(prompts), "prepare_ms": prepare_ms, "step_ms_no_processor": base,
            "step_ms_prepare_serial": serial, "step_ms_prepare_overlapped": overlapped,
            "fraction_hidden": hidden}
