"""The llama.cpp runner on GGUFs of other architectures than Llama, written in the test
from tiny random HF models (tests/engine/runners/gguf_builder.py):

- Qwen2 (q/k/v biases) and Granite (multipliers; a GGUF transformers' loader cannot
  read at all): the engine's greedy output equals llama.cpp's own greedy generation
  token for token, alone and in a batch; each GGUF is a faithful conversion (llama.cpp's
  logits of the prompts match the HF model's, same greedy token);
- an architecture llama.cpp does not know is refused at start, naming it;
- the engine's HF tokenizer agrees with llama.cpp's vocabulary, built from the file's
  tokenizer fields when transformers' GGUF loader cannot read the file (Granite) or reads
  its pre-tokenizer otherwise (a qwen2 file with SmolLM's); neither agreeing is refused
  at start, naming the architecture.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loading import weights_cache
from engine.runners.llamacpp import INVARIANT_TYPE_V, INVARIANT_UBATCH
from engine.runners.select import llama_cpp_available
from engine.sampling_params import SamplingParams
from tests.engine.runners.gguf_builder import default_tokenizer_fields, write_gguf
from tests.engine.test_engine import run_to_completion

pytestmark = pytest.mark.skipif(not llama_cpp_available(),
                                reason="llama-cpp-python is not installed")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,",
           "Q: What is the boiling point of water?\nA:"]
MAX_NEW = 16
THREADS = 1
TINY: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=512, tie_word_embeddings=False,
                            initializer_range=0.2)


@pytest.fixture(scope="module", autouse=True)
def isolated(tmp_path_factory):
    """The weights cache (the runner's tokenizer comes from it) in a temporary directory,
    and torch's thread count restored (the runner limits torch to one thread)."""
    n = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(weights_cache.CACHE_DIR_ENV, str(tmp_path_factory.mktemp("weights_cache")))
        yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tokenizer_fields() -> dict[str, Any]:
    return default_tokenizer_fields()


def tiny_hf_model(cls_name: str, tokenizer, **extra):
    """A tiny random model of ``cls_name`` with the default tokenizer's vocabulary; every
    bias random too (they start at zero), so a converter dropping one is caught."""
    import transformers
    from transformers import AutoModelForCausalLM

    config = getattr(transformers, cls_name)(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
        **{**TINY, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model


GRANITE = dict(embedding_multiplier=6.0, residual_multiplier=0.5, attention_multiplier=0.1,
               logits_scaling=2.0)
GRANITE_GGUF = {"embedding_scale": 6.0, "residual_scale": 0.5, "attention.scale": 0.1,
                "logit_scale": 2.0}


def build(arch: str, directory: Path, tokenizer, tokenizer_fields) -> tuple[Any, Path]:
    """(HF model, GGUF path) of a tiny ``arch`` model: "qwen2" (q/k/v biases; "qwen2"
    pre-tokenisation, as Qwen2 GGUFs have) or "granite" (multipliers; a GGUF transformers
    cannot load, but llama.cpp runs)."""
    if arch == "qwen2":
        model = tiny_hf_model("Qwen2Config", tokenizer)
        return model, write_gguf(model, directory / "tiny-qwen2.gguf",
                                 tokenizer_fields=tokenizer_fields, pre="qwen2")
    model = tiny_hf_model("GraniteConfig", tokenizer, **GRANITE)
    return model, write_gguf(model, directory / "tiny-granite.gguf",
                             tokenizer_fields=tokenizer_fields, extra=GRANITE_GGUF)


@pytest.fixture(scope="module", params=["qwen2", "granite"])
def built(request, tmp_path_factory, tokenizer, tokenizer_fields) -> tuple[Any, Path]:
    return build(request.param, tmp_path_factory.mktemp(request.param), tokenizer,
                 tokenizer_fields)


@pytest.fixture(scope="module")
def engine(built) -> LLMEngine:
    return LLMEngine(config(built[1]))


@pytest.fixture(scope="module")
def ids(engine) -> list[list[int]]:
    return [engine.tokenizer(p)["input_ids"] for p in PROMPTS]


def llama(path: Path, **kw):
    import llama_cpp

    # flash attention and ubatch as the runner's context runs them
    return llama_cpp.Llama(str(path), n_ctx=512, n_threads=THREADS, flash_attn=True,
                           n_ubatch=INVARIANT_UBATCH, type_v=INVARIANT_TYPE_V, verbose=False,
                           **kw)


@pytest.fixture(scope="module")
def reference(built, ids) -> list[list[int]]:
    """llama.cpp's own greedy generation (``Llama.generate`` at temperature 0)."""
    llm = llama(built[1])
    out = [list(itertools.islice(llm.generate(p, temp=0.0, reset=True), MAX_NEW))
           for p in ids]
    llm.close()
    return out


def config(path: Path) -> EngineConfig:
    return EngineConfig(model=str(path), runner="llamacpp", max_model_len=512,
                        kv_cache_memory=8 << 20, max_num_seqs=8, threads=THREADS,
                        batch_invariant=True, requantize="none")  # as the reference


def greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)


def test_the_gguf_is_a_faithful_conversion_of_the_hf_model(built, ids):
    """llama.cpp's logits of every prompt position are the HF model's (its KV cache is f16:
    small differences), so the written GGUF (biases, multipliers included) is the model."""
    import numpy as np

    model, path = built
    llm = llama(path, logits_all=True)
    try:
        for p in ids:
            llm.reset()
            llm.eval(p)
            theirs = np.asarray(llm.scores[:len(p)])
            with torch.no_grad():
                ours = model(torch.tensor([p])).logits[0].numpy()
            np.testing.assert_allclose(theirs, ours, atol=0.05)
            assert theirs[-1].argmax() == ours[-1].argmax()
    finally:
        llm.close()


def test_the_gguf_loads_with_a_tokenizer_that_is_llama_cpps(built, engine, tokenizer, ids):
    runner = engine.runner
    assert engine.info.runner == "llamacpp"
    assert runner._meta("general.architecture") == built[0].config.model_type  # type: ignore[attr-defined]
    assert engine.info.vocab_size == len(tokenizer)
    for text, mine in zip(PROMPTS, ids, strict=True):
        assert runner.tokenize(text) == mine  # type: ignore[attr-defined]


def test_the_weights_cache_warns_only_when_a_readable_gguf_could_not_be_cached(
        built, engine, caplog):
    """Granite's GGUF is one transformers' loader cannot read: the llama.cpp runner needs
    no converted torch weights, so the cache says so at INFO, naming the architecture,
    instead of warning that loading will be slower; a readable one (qwen2) is cached."""
    model, path = built
    with caplog.at_level(logging.INFO, logger="engine.loading.weights_cache"):
        entry = weights_cache.cached_model_dir(path)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    if model.config.model_type == "granite":
        assert entry is None
        assert "cannot read GGUF architecture granite" in caplog.text
        assert "the llama.cpp runner needs none" in caplog.text
    else:
        assert entry is not None


def test_greedy_alone_matches_llama_cpp_generate(engine, ids, reference):
    for i, p in enumerate(ids):
        res = run_to_completion(engine, {0: [(f"a{i}", p, greedy())]})
        assert res[f"a{i}"][0].token_ids == reference[i], f"prompt {i}"
    assert engine.scheduler.allocator.num_used == 0


def test_greedy_batch_matches_llama_cpp_generate(engine, ids, reference):
    res = run_to_completion(engine, {0: [(f"b{i}", p, greedy()) for i, p in enumerate(ids)]})
    for i in range(len(ids)):
        assert res[f"b{i}"][0].token_ids == reference[i], f"prompt {i}"
    assert engine.scheduler.allocator.num_used == 0


def test_biases_are_random_so_the_conversion_test_sees_them(tokenizer):
    model = tiny_hf_model("Qwen2Config", tokenizer)
    assert model.model.layers[0].self_attn.q_proj.bias.abs().min() > 0


def test_an_architecture_llama_cpp_does_not_know_is_refused_naming_it(
        tmp_path, tokenizer, tokenizer_fields):
    model = tiny_hf_model("Qwen2Config", tokenizer)
    path = write_gguf(model, tmp_path / "odd.gguf", arch="nonesuch",
                      tokenizer_fields=tokenizer_fields)
    with pytest.raises(ValueError, match="unknown model architecture: 'nonesuch'") as err:
        LLMEngine(config(path))
    assert "general.architecture 'nonesuch'" in str(err.value)


def test_a_pre_tokenizer_transformers_loader_ignores_is_read_from_the_file(
        tmp_path, tokenizer, tokenizer_fields):
    """transformers' GGUF loader gives a qwen2 file Qwen2's pre-tokenizer and ignores
    tokenizer.ggml.pre: with SmolLM's ("smollm") it tokenises otherwise than llama.cpp,
    so the runner builds the tokenizer from the file's fields, which agrees."""
    model = tiny_hf_model("Qwen2Config", tokenizer)
    path = write_gguf(model, tmp_path / "smollm-pre.gguf", tokenizer_fields=tokenizer_fields)
    engine = LLMEngine(config(path))
    runner = engine.runner
    for text in PROMPTS + ["x = [1, 22, 333, 4444]\n\tprint(x)"]:
        assert engine.tokenizer(text, add_special_tokens=False)["input_ids"] \
            == runner.tokenize(text)  # type: ignore[attr-defined]


def test_no_tokenizer_agreeing_with_llama_cpp_is_refused_naming_the_architecture(
        monkeypatch, tmp_path, tokenizer, tokenizer_fields):
    """Both ways to an HF tokenizer failing (here forced: a tokenizer type transformers
    cannot build) is an error at start naming the file's architecture and both reasons."""
    import transformers

    import engine.runners.llamacpp as llamacpp

    model = tiny_hf_model("GraniteConfig", tokenizer, **GRANITE)
    path = write_gguf(model, tmp_path / "g.gguf", tokenizer_fields=tokenizer_fields,
                      extra=GRANITE_GGUF)

    def refuse(*args, **kwargs):
        raise ValueError("Cannot build a tokenizer from a GGUF file stating tokenizer 'x'")

    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "from_pretrained", refuse)
    with pytest.raises(ValueError, match="no HF tokenizer agrees .*architecture 'granite'"
                                         ".*GGUF loader: .*granite is not supported.*"
                                         "tokenizer fields: Cannot build") as err:
        llamacpp.LlamaCppRunner(config(path))
    assert "tokenizer.ggml.model 'gpt2'" in str(err.value)
