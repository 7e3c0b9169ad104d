"""LongRoPE (Phi-3 128k and its kin) is served with one choice of factors per server, on
both runners (engine/loading/rope_scaling.py).

A tiny random Phi-3 with LongRoPE whose original context is 64 positions (1,024 in all):
transformers picks the factors per forward from the largest position in it, so in a packed
batch a sequence's KV would depend on its batch mates and its chunking. The runners choose
once from max_model_len, as vLLM does: the short factors when it is at most the original
context (every output then transformers' own), the long ones for every sequence otherwise.
The llama.cpp runner runs the same model as a GGUF (its factors as tensors, as llama.cpp's
converter writes them), where llama.cpp would choose from its context size instead.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loading.gguf_config import GGUFMetadata
from engine.loading.rope_scaling import fix_rotary, longrope_parameters
from engine.runners.select import llama_cpp_available
from engine.sampling_params import SamplingParams
from tests.engine.runners.gguf_builder import write_gguf

ORIGINAL = 64  # the tiny model's original context
POSITIONS = 1024
HEAD = 16
SHORT = [1.0 + 0.25 * i for i in range(HEAD // 2)]
LONG = [4.0 + 4.0 * i for i in range(HEAD // 2)]


def tiny_phi3(tokenizer) -> Any:
    from transformers import AutoModelForCausalLM, Phi3Config

    config = Phi3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=POSITIONS, original_max_position_embeddings=ORIGINAL,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": SHORT, "long_factor": LONG,
                         "original_max_position_embeddings": ORIGINAL},
        sliding_window=None, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory, tokenizer) -> Path:
    d = tmp_path_factory.mktemp("phi3_longrope")
    tiny_phi3(tokenizer).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def reference(model_dir: Path, which: str | None) -> Any:
    """The model as transformers runs it: ``which`` None = its own per-forward choice;
    "short" / "long" = those factors for every forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if which is not None:
        fix_rotary(model, ORIGINAL if which == "short" else POSITIONS)
    return model


@torch.no_grad()
def hf_prompt_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[i + 1] | ids[:i + 1]) from one forward of the whole prompt."""
    rows = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    return [float(rows[i, ids[i + 1]]) for i in range(len(ids) - 1)]


def prompt(tokenizer, n: int, tag: int) -> list[int]:
    ids = tokenizer(f"Note {tag}: " + "the quick brown fox jumps over the lazy dog " * 40)[
        "input_ids"]
    return ids[:n]


def served_prompt_logprobs(engine: LLMEngine, prompts: dict[str, list[int]]
                           ) -> dict[str, list[float]]:
    """Every prompt added at once (one packed step where the budget allows); each one's
    prompt logprobs."""
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_new_tokens=1, prompt_logprobs=0))
    got: dict[str, list[float]] = {}
    while engine.has_work:
        for out in engine.step():
            if out.prompt_logprobs is not None:
                got[out.request_id] = [lp.logprob for lp in out.prompt_logprobs]
    return got


def served_greedy(engine: LLMEngine, ids: list[int], n: int) -> list[int]:
    engine.add_request("g", ids, SamplingParams(max_new_tokens=n, min_new_tokens=n))
    out: list[int] = []
    while engine.has_work:
        for o in engine.step():
            for d in o.deltas:
                out += d.token_ids
    return out


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    return model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False)[0, len(ids):].tolist()


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_the_tiny_models_short_and_long_factors_differ_visibly(phi3_dir, tokenizer):
    """The check below can fail: the two sets of factors move the prompt logprobs by far
    more than the tolerances used."""
    ids = prompt(tokenizer, 40, 0)
    short = hf_prompt_logprobs(reference(phi3_dir, "short"), ids)
    long = hf_prompt_logprobs(reference(phi3_dir, "long"), ids)
    assert gap(short, long) > 0.05
    assert gap(short, hf_prompt_logprobs(reference(phi3_dir, None), ids)) == 0.0


def torch_engine(model_dir: Path, max_model_len: int, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), runner="torch", dtype="float32",
                                  max_model_len=max_model_len, kv_cache_memory=8 << 20,
                                  **kw))


def test_torch_runner_within_the_original_context_is_transformers_own(phi3_dir, tokenizer):
    """max_model_len <= the original context: the short factors, as transformers uses for
    every sequence that fits, prompt logprobs and greedy output alike."""
    engine = torch_engine(phi3_dir, ORIGINAL, max_num_batched_tokens=32)
    ids = prompt(tokenizer, 40, 1)
    got = served_prompt_logprobs(engine, {"a": ids})["a"]
    ref = reference(phi3_dir, None)
    assert gap(got, hf_prompt_logprobs(ref, ids)) < 1e-4
    assert served_greedy(engine, ids, 16) == hf_greedy(ref, ids, 16)


def test_torch_runner_past_the_original_context_uses_the_long_factors_whatever_the_batch(
        phi3_dir, tokenizer):
    """max_model_len > the original context: a 30-token prompt gets the long factors alone
    and beside a 150-token prompt in one step (before, transformers' per-forward choice
    gave it the short ones alone and the long ones beside the other); the 150-token
    prompt, prefilled in chunks of 64 (the first ones within the original context), equals
    transformers' own forward of it (long, since it is longer)."""
    short_ids, long_ids = prompt(tokenizer, 30, 2), prompt(tokenizer, 150, 3)
    alone = served_prompt_logprobs(torch_engine(phi3_dir, POSITIONS), {"s": short_ids})["s"]
    both = served_prompt_logprobs(torch_engine(phi3_dir, POSITIONS,
                                               max_num_batched_tokens=64),
                                  {"s": short_ids, "l": long_ids})
    long_ref = reference(phi3_dir, "long")
    assert gap(alone, both["s"]) < 1e-5
    assert gap(alone, hf_prompt_logprobs(long_ref, short_ids)) < 1e-4
    assert gap(both["l"], hf_prompt_logprobs(reference(phi3_dir, None), long_ids)) < 1e-4


# ---- the same model as a GGUF ------------------------------------------------------------

needs_llama_cpp = pytest.mark.skipif(not llama_cpp_available(),
                                     reason="llama-cpp-python is not installed")


@pytest.fixture(scope="module")
def phi3_gguf(tmp_path_factory, phi3_dir) -> Path:
    """The tiny Phi-3 as llama.cpp's converter writes it: factors as tensors, the original
    context and the attention factor as metadata. (A name without "phi3": llama.cpp keys
    Phi-3 vocabulary rules on it, which the default tokenizer's vocabulary lacks.)"""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(phi3_dir, dtype=torch.float32)
    return write_gguf(
        model, tmp_path_factory.mktemp("phi3_gguf") / "tiny-p3.gguf", arch="phi3",
        name="tiny-p3",
        extra={"rope.scaling.attn_factor": math.sqrt(
            1 + math.log(POSITIONS / ORIGINAL) / math.log(ORIGINAL))},
        extra_ints={"rope.scaling.original_context_length": ORIGINAL,
                    "rope.dimension_count": HEAD},
        extra_tensors={"rope_factors_long.weight": np.array(LONG),
                       "rope_factors_short.weight": np.array(SHORT)})


def test_a_gguf_with_longrope_factors_converts_to_transformers_longrope(phi3_gguf):
    """transformers' GGUF loader drops the factor tensors; they are read back (into the
    converted config: the torch prefill test below runs it)."""
    params = longrope_parameters(GGUFMetadata(phi3_gguf))
    assert params is not None
    assert params["rope_type"] == "longrope"
    assert params["original_max_position_embeddings"] == ORIGINAL
    assert params["long_factor"] == pytest.approx(LONG)
    assert params["short_factor"] == pytest.approx(SHORT)


@needs_llama_cpp
@pytest.mark.parametrize("max_model_len,which", [(ORIGINAL, "short"), (POSITIONS, "long")])
def test_llama_cpp_runner_takes_the_servers_longrope_choice(phi3_dir, phi3_gguf, tokenizer,
                                                            max_model_len, which):
    """llama.cpp picks the long factors when its context per sequence (here the whole
    cache, hundreds of cells) exceeds the original context; the runner makes it pick the
    short ones under a max_model_len within it, the long ones past it."""
    engine = LLMEngine(EngineConfig(model=str(phi3_gguf), runner="llamacpp",
                                    max_model_len=max_model_len, kv_cache_memory=8 << 20,
                                    threads=1, torch_prefill_tokens=0))
    ids = prompt(tokenizer, 40, 4)
    got = served_prompt_logprobs(engine, {"a": ids})["a"]
    assert gap(got, hf_prompt_logprobs(reference(phi3_dir, which), ids)) < 2e-2  # f16 KV


@needs_llama_cpp
def test_llama_cpp_runners_torch_prefill_hands_over_the_same_factors(phi3_gguf, phi3_dir,
                                                                     tokenizer):
    """A prompt long enough for the torch prefill: the converted model runs LongRoPE with
    the runner's choice (else the hand-over's check refuses it, or its KV differs)."""
    engine = LLMEngine(EngineConfig(model=str(phi3_gguf), runner="llamacpp",
                                    max_model_len=POSITIONS, kv_cache_memory=8 << 20,
                                    threads=1, torch_prefill_tokens=128))
    import llama_cpp

    from engine.runners.requantize import cpu_has_bf16_gemm

    if not (cpu_has_bf16_gemm(llama_cpp) and torch.backends.mkldnn.is_available()):
        pytest.skip("no torch prefill on this CPU (needs AVX512-BF16 and oneDNN)")
    assert engine.runner.handoff is not None  # type: ignore[attr-defined]
    ids = prompt(tokenizer, 200, 5)
    assert served_greedy(engine, ids, 8) == hf_greedy(reference(phi3_dir, "long"), ids, 8)
