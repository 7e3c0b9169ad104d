"""A GGUF's config read for the torch runner is the config of the model it was converted
from, also where transformers' GGUF loader alone would drop part of it
(engine/loading/gguf_config.py).

Each case: a tiny random HF model with one such feature, written as a GGUF with the
metadata llama.cpp's converter writes for it; the model built from the completed config
(holding the original weights) gives the original's logits over a prompt longer than any
window, and the one built from transformers' config alone does not (so the test can fail).
The whole conversion of a LongRoPE GGUF, weights included, runs in
tests/engine/runners/test_rope_scaling.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.loading.gguf_config import GGUFMetadata, UnfaithfulGGUF, restore
from tests.engine.runners.architectures import WINDOW, build_architecture
from tests.engine.runners.gguf_builder import write_gguf

HEAD = 16
# The tiny GGUFs carry no vocabulary (only the config is read back here; parsing the
# default model's 49k tokens would take seconds a file).
NO_TOKENIZER = {"tokenizer.ggml.model": ("gpt2", 8, None)}
KV = {"attention.key_length": HEAD, "attention.value_length": HEAD}

# case -> (architecture, config changes, float / int / string metadata as converted)
CASES: dict[str, tuple[str, dict[str, Any], dict, dict, dict]] = {
    "phi3 sliding window": ("phi3", {}, {},
                            {"attention.sliding_window": WINDOW,
                             "rope.dimension_count": HEAD}, {}),
    "phi3 partial RoPE": ("phi3", {"rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}, {},
        {"rope.dimension_count": HEAD // 2, "attention.sliding_window": WINDOW}, {}),
    "starcoder2 RoPE base": ("starcoder2", {"rope_parameters": {
        "rope_type": "default", "rope_theta": 999999.4420358813}}, {},
        {"attention.sliding_window": WINDOW}, {}),
    "gemma2 soft-capping": ("gemma2", {}, {"attn_logit_softcapping": 20.0,
                                           "final_logit_softcapping": 15.0},
                            {"attention.sliding_window": WINDOW, **KV}, {}),
    "gemma3 linear RoPE on global layers": (
        "gemma3", {"num_hidden_layers": 6,  # llama.cpp's fixed pattern: 5 local, 1 global
                   "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
                   "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
        {"rope.scaling.factor": 8.0}, {"attention.sliding_window": WINDOW, **KV},
        {"rope.scaling.type": "linear"}),
    "llama YaRN": ("llama", {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
        "rope_theta": 10000.0}},
        {"rope.scaling.factor": 4.0}, {"rope.scaling.original_context_length": 128},
        {"rope.scaling.type": "yarn"}),
    "llama linear RoPE": ("llama", {"rope_parameters": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
        {"rope.scaling.factor": 2.0}, {}, {"rope.scaling.type": "linear"}),
}


def tiny(arch: str, changes: dict[str, Any], directory: Path, tokenizer_dir: Path) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    build_architecture(arch, directory, tokenizer_dir)
    config = AutoConfig.from_pretrained(directory)
    for key, value in changes.items():
        setattr(config, key, value)
    if arch.startswith("gemma"):
        config.tie_word_embeddings = True  # as Gemma checkpoints are; llama.cpp has no head
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return model


@torch.no_grad()
def logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


def with_weights(config: Any, model: Any) -> Any:
    """A model of ``config`` holding ``model``'s weights (the weights' conversion is
    transformers' own and tested elsewhere; the config is what is under test)."""
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    other.load_state_dict(model.state_dict())
    return other


def assert_restored_is_original(path: Path, model: Any, tokenizer) -> None:
    """The config read back from ``path`` gives ``model``'s logits over a prompt longer
    than any window; transformers' own reading of it does not."""
    from transformers import AutoConfig

    ids = tokenizer("Note: " + "the quick brown fox jumps over the lazy dog " * 40)[
        "input_ids"][:200]
    want = logits(model, ids)
    alone = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    restore(config, GGUFMetadata(path))
    assert (logits(with_weights(config, model), ids) - want).abs().max() < 1e-4
    assert (logits(with_weights(alone, model), ids) - want).abs().max() > 1e-2


@pytest.mark.parametrize("case", list(CASES))
def test_the_converted_config_is_the_original_models(case, tmp_path, tokenizer_dir,
                                                     tokenizer):

    arch, changes, floats, ints, strings = CASES[case]
    model = tiny(arch, changes, tmp_path, tokenizer_dir)
    path = write_gguf(model, tmp_path / f"tiny-{arch}.gguf", arch=arch, name="tiny-x",
                      extra=floats, extra_ints=ints, extra_strings=strings,
                      tokenizer_fields=NO_TOKENIZER)
    assert_restored_is_original(path, model, tokenizer)


def test_llama3_rope_baked_into_rope_freqs_is_the_original_models(tmp_path, tokenizer_dir,
                                                                     tokenizer):
    """Llama 3.1/3.2's RoPE scaling reaches a GGUF only as the ``rope_freqs.weight``
    tensor (each frequency's divisor, as llama.cpp's converter computes it), which
    transformers' loader skips."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = tiny("llama", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0}}, tmp_path,
        tokenizer_dir)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")
    plain = model.model.rotary_emb  # unscaled frequencies, from the same base
    base = 1.0 / (10000.0 ** (torch.arange(0, HEAD, 2, dtype=torch.float) / HEAD))
    assert not torch.allclose(plain.inv_freq, base)  # the model is scaled
    path = write_gguf(model, tmp_path / "l3.gguf", name="tiny-x",
                      extra_tensors={"rope_freqs.weight": (base / scaled).numpy()},
                      tokenizer_fields=NO_TOKENIZER)
    assert_restored_is_original(path, model, tokenizer)


@pytest.mark.parametrize("metadata,named", [
    ({"extra": {"rope.scaling.factor": 2.0},
      "extra_strings": {"rope.scaling.type": "su-ntk"}}, "rope.scaling.type 'su-ntk'"),
    ({"extra_ints": {"attention.sliding_window": 4096}}, "attention.sliding_window 4096")],
    ids=["unknown RoPE scaling", "window on a model without one"])
def test_what_cannot_be_read_back_is_refused_naming_it(tmp_path, tokenizer_dir, metadata,
                                                       named):
    from transformers import AutoConfig

    model = tiny("llama", {}, tmp_path, tokenizer_dir)
    path = write_gguf(model, tmp_path / "odd.gguf", name="tiny-x",
                      tokenizer_fields=NO_TOKENIZER, **metadata)
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    with pytest.raises(UnfaithfulGGUF, match=named):
        restore(config, GGUFMetadata(path))


def test_gemma_27b_scales_queries_by_hidden_over_heads_as_llama_cpp_does(tmp_path,
                                                                           tokenizer_dir):
    """The GGUF does not carry query_pre_attn_scalar; llama.cpp takes it from the layer
    count (46 layers: Gemma 2 27B), and so does the conversion."""
    from transformers import AutoConfig

    model = tiny("gemma2", {}, tmp_path, tokenizer_dir)
    path = write_gguf(model, tmp_path / "g.gguf", name="tiny-x", extra_ints=KV,
                      tokenizer_fields=NO_TOKENIZER)
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    restore(config, GGUFMetadata(path))
    assert config.query_pre_attn_scalar == HEAD
    config.num_hidden_layers = 46
    restore(config, GGUFMetadata(path))
    assert config.query_pre_attn_scalar == config.hidden_size // config.num_attention_heads
