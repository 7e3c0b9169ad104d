"""A sliding-window model on the llama.cpp runner, with prefix caching: a tiny Gemma 2
(8-token windows on alternate layers) written as a GGUF the way llama.cpp's converter
writes it. llama.cpp keeps a sliding-window layer's cells in a second cache and drops a
sequence's cells that fell out of its window; a cached block's cells are also held by the
runner's keeper sequence ids, which never advance, so a prompt that hits the cache inside
and past the window still finds them and is served as transformers' ``generate`` serves it
(checked with llama.cpp's full-size SWA cache, its default, and with a window-sized one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.runners.select import llama_cpp_available
from engine.sampling_params import SamplingParams
from tests.engine.runners.gguf_builder import write_gguf

pytestmark = pytest.mark.skipif(not llama_cpp_available(),
                                reason="llama-cpp-python is not installed")
WINDOW = 8
NEW = 16


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory, tokenizer) -> tuple[Any, Path]:
    import transformers
    from transformers import AutoModelForCausalLM

    config = transformers.Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        query_pre_attn_scalar=16, sliding_window=WINDOW, max_position_embeddings=1024,
        initializer_range=0.2, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    path = write_gguf(model, tmp_path_factory.mktemp("gemma2") / "tiny-gemma2.gguf",
                      extra={"attn_logit_softcapping": config.attn_logit_softcapping,
                             "final_logit_softcapping": config.final_logit_softcapping},
                      extra_ints={"attention.sliding_window": WINDOW,
                                  "attention.key_length": 16, "attention.value_length": 16})
    return model, path


@pytest.mark.parametrize("streams", [False, True], ids=["unified", "kv-streams"])
def test_cache_hits_inside_and_past_the_window_serve_transformers_greedy_output(
        gemma2, tokenizer, streams):
    """Also with a KV stream per sequence (--kv-streams; auto keeps such a model in one
    cache), where cached blocks would go through host memory as sequence states that then
    hold the second cache too: the runner's probe finds that layout and turns prefix
    caching off, and the output stays transformers'."""
    model, path = gemma2
    base = tokenizer("Note: " + "the quick brown fox jumps over the lazy dog and then it "
                     "sleeps " * 20)["input_ids"]
    prompts = {"a": base[:60],
               "b": base[:48] + tokenizer(" a different ending about cats")["input_ids"],
               "c": base[:100], "a again": base[:60], "d": base[:33]}
    engine = LLMEngine(EngineConfig(model=str(path), runner="llamacpp", threads=1,
                                    kv_cache_memory=None if not streams else 8 << 20,
                                    torch_prefill_tokens=0, prefix_cache_host_memory=8 << 20,
                                    kv_streams=True if streams else None, max_model_len=256))
    assert (engine.runner.streams is not None) == streams  # type: ignore[attr-defined]
    assert engine.info.prefix_caching != streams
    cached = {}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW))
        out: list[int] = []
        while engine.has_work:
            for o in engine.step():
                for d in o.deltas:
                    out += d.token_ids
                if o.finished:
                    cached[rid] = o.usage.cached_prompt_tokens
        want = model.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False)[0, len(ids):].tolist()
        assert out == want, rid
    if streams:
        assert not any(cached.values())
    else:
        assert cached["a"] == 0 and all(cached[r] >= 32 for r in ("b", "c", "a again", "d"))
