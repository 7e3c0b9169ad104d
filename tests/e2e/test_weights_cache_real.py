"""The real default model through the weights cache: the converted copy is the GGUF model.

One GGUF load (~30 s here, the cost the cache removes), saved into a fresh cache directory
by the real converter's save step, then loaded back the way the engine loads it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.loading import weights_cache
from engine.loading.model_loader import default_model_path, load_model, load_tokenizer, resolve_model

PROMPTS = ["The capital of France is", "Once upon a time", "def reverse(s):\n"]
CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="module")
def from_gguf():
    """(tokenizer, model) exactly as a GGUF load gives them (float32)."""
    return weights_cache.load_gguf(Path(default_model_path()))


@pytest.fixture(scope="module")
def from_cache(from_gguf, tmp_path_factory):
    """(tokenizer, model, entry) via load_tokenizer/load_model over a new cache entry."""
    mp = pytest.MonkeyPatch()
    mp.setenv(weights_cache.CACHE_DIR_ENV, str(tmp_path_factory.mktemp("weights_cache")))
    mp.setattr(weights_cache, "convert_gguf",
               lambda gguf, out: weights_cache.save_converted(*from_gguf, out))
    try:
        source = resolve_model("default")
        tokenizer = load_tokenizer(source)
        model = load_model(source, torch.float32, torch.device("cpu"), "sdpa")
        entry = weights_cache.cached_model_dir(Path(default_model_path()))
    finally:
        mp.undo()
    return tokenizer, model, entry


def test_cached_weights_equal_the_gguf_weights(from_gguf, from_cache):
    gguf_state, cached_state = from_gguf[1].state_dict(), from_cache[1].state_dict()
    assert from_cache[2] is not None and (from_cache[2] / "model.safetensors").is_file()
    assert gguf_state.keys() == cached_state.keys()
    for name, tensor in gguf_state.items():
        assert cached_state[name].dtype == tensor.dtype, name
        assert torch.equal(cached_state[name], tensor), name
    gguf_config, cached_config = from_gguf[1].config.to_dict(), from_cache[1].config.to_dict()
    gguf_config.pop("quantization_config", None)  # save_converted drops it
    assert "quantization_config" not in cached_config
    assert {k: v for k, v in cached_config.items() if not k.startswith("_")} == {
        k: v for k, v in gguf_config.items() if not k.startswith("_")}


def test_cached_tokenizer_equals_the_gguf_tokenizer(from_gguf, from_cache):
    gguf_tok, cached_tok = from_gguf[0], from_cache[0]
    for text in [*PROMPTS, "naïve café 東京 🙂", "<|im_start|>user\nhi<|im_end|>"]:
        assert cached_tok(text)["input_ids"] == gguf_tok(text)["input_ids"], text
    assert (cached_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
            == gguf_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))
    assert (cached_tok.eos_token_id, cached_tok.bos_token_id) == (gguf_tok.eos_token_id,
                                                                 gguf_tok.bos_token_id)


def test_cached_model_generates_the_same_greedy_tokens(from_gguf, from_cache):
    tokenizer = from_gguf[0]
    gguf_model, cached_model = from_gguf[1], from_cache[1]
    gguf_model.set_attn_implementation("sdpa")
    assert cached_model.generation_config.eos_token_id == gguf_model.generation_config.eos_token_id
    with torch.inference_mode():
        for prompt in PROMPTS[:2]:  # a busy 2-core CPU: few and short
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            want = gguf_model.generate(ids, max_new_tokens=8, do_sample=False)
            got = cached_model.generate(ids, max_new_tokens=8, do_sample=False)
            assert got.tolist() == want.tolist(), prompt
