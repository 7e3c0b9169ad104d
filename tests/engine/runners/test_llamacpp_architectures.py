"""The llama.cpp runner on GGUFs of other architectures than Llama, written in the test
from tiny random HF models (tests/engine/runners/gguf_builder.py):

- Qwen2 (q/k/v biases): the engine's greedy output equals llama.cpp's own greedy
  generation token for token, alone and in a batch; the GGUF is a faithful conversion
  (llama.cpp's logits of the prompt match the HF model's, same first greedy token);
- an architecture llama.cpp does not know is refused at start, naming it;
- one llama.cpp runs but transformers cannot read the tokenizer of (Granite) is refused
  at start, naming it, rather than failing later; so is a tokenizer transformers reads
  otherwise than llama.cpp (a qwen2 file with SmolLM's pre-tokenizer).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loading import weights_cache
from engine.runners.llamacpp import MAX_UBATCH
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


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, tokenizer, tokenizer_fields) -> tuple[Any, Path]:
    model = tiny_hf_model("Qwen2Config", tokenizer)
    path = tmp_path_factory.mktemp("qwen2") / "tiny-qwen2.gguf"
    # "qwen2" pre-tokenisation, as Qwen2 GGUFs have: transformers builds the tokenizer of a
    # qwen2 GGUF with Qwen2's pre-tokenizer whatever the file says (see the last test)
    return model, write_gguf(model, path, tokenizer_fields=tokenizer_fields, pre="qwen2")


@pytest.fixture(scope="module")
def ids(engine) -> list[list[int]]:
    return [engine.tokenizer(p)["input_ids"] for p in PROMPTS]


def llama(path: Path, **kw):
    import llama_cpp

    # flash attention and ubatch as the runner's context runs them
    return llama_cpp.Llama(str(path), n_ctx=512, n_threads=THREADS, flash_attn=True,
                           n_ubatch=MAX_UBATCH, verbose=False, **kw)


@pytest.fixture(scope="module")
def reference(qwen2, ids) -> list[list[int]]:
    """llama.cpp's own greedy generation (``Llama.generate`` at temperature 0)."""
    llm = llama(qwen2[1])
    out = [list(itertools.islice(llm.generate(p, temp=0.0, reset=True), MAX_NEW))
           for p in ids]
    llm.close()
    return out


@pytest.fixture(scope="module")
def engine(qwen2) -> LLMEngine:
    return LLMEngine(config(qwen2[1]))


def config(path: Path) -> EngineConfig:
    return EngineConfig(model=str(path), runner="llamacpp", max_model_len=512,
                        kv_cache_memory=8 << 20, max_num_seqs=8, threads=THREADS)


def greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)


def test_qwen2_gguf_is_a_faithful_conversion_of_the_hf_model(qwen2, ids):
    """llama.cpp's logits of every prompt position are the HF model's (its KV cache is f16:
    small differences), so the written GGUF (biases included) is the model."""
    import numpy as np

    model, path = qwen2
    assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
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


def test_qwen2_gguf_loads_and_names_its_architecture(engine, tokenizer, ids):
    runner = engine.runner
    assert engine.info.runner == "llamacpp"
    assert runner._meta("general.architecture") == "qwen2"  # type: ignore[attr-defined]
    assert engine.info.vocab_size == len(tokenizer)
    for text, mine in zip(PROMPTS, ids, strict=True):
        assert runner.tokenize(text) == mine  # type: ignore[attr-defined]


def test_qwen2_greedy_alone_matches_llama_cpp_generate(engine, ids, reference):
    for i, p in enumerate(ids):
        res = run_to_completion(engine, {0: [(f"a{i}", p, greedy())]})
        assert res[f"a{i}"][0].token_ids == reference[i], f"prompt {i}"
    assert engine.scheduler.allocator.num_used == 0


def test_qwen2_greedy_batch_matches_llama_cpp_generate(engine, ids, reference):
    res = run_to_completion(engine, {0: [(f"b{i}", p, greedy()) for i, p in enumerate(ids)]})
    for i in range(len(ids)):
        assert res[f"b{i}"][0].token_ids == reference[i], f"prompt {i}"
    assert engine.scheduler.allocator.num_used == 0


def test_an_architecture_llama_cpp_does_not_know_is_refused_naming_it(
        qwen2, tmp_path, tokenizer_fields):
    path = write_gguf(qwen2[0], tmp_path / "odd.gguf", arch="nonesuch",
                      tokenizer_fields=tokenizer_fields)
    with pytest.raises(ValueError, match="unknown model architecture: 'nonesuch'") as err:
        LLMEngine(config(path))
    assert "general.architecture 'nonesuch'" in str(err.value)


def test_an_architecture_transformers_cannot_tokenise_is_refused_naming_it(
        tmp_path, tokenizer, tokenizer_fields):
    """Granite runs on llama.cpp, but transformers' GGUF loader reads no Granite file, and
    the engine tokenises with transformers: refused at start, the architecture named."""
    model = tiny_hf_model("GraniteConfig", tokenizer, embedding_multiplier=6.0,
                          residual_multiplier=0.5, attention_multiplier=0.1,
                          logits_scaling=2.0)
    path = write_gguf(model, tmp_path / "tiny-granite.gguf", tokenizer_fields=tokenizer_fields,
                      extra={"embedding_scale": 6.0, "residual_scale": 0.5,
                             "attention.scale": 0.1, "logit_scale": 2.0})
    with pytest.raises(ValueError, match="llama.cpp runs its architecture 'granite', but "
                                         "the engine tokenises with transformers"):
        LLMEngine(config(path))


def test_a_tokenizer_transformers_reads_otherwise_than_llama_cpp_is_refused(
        qwen2, tmp_path, tokenizer_fields):
    """transformers builds a qwen2 GGUF's tokenizer with Qwen2's pre-tokenizer and ignores
    tokenizer.ggml.pre: with SmolLM's ("smollm") the two tokenise a sample text
    differently, and the runner refuses at start, naming both, rather than feed prompts
    as other tokens."""
    path = write_gguf(qwen2[0], tmp_path / "smollm-pre.gguf", tokenizer_fields=tokenizer_fields)
    with pytest.raises(ValueError, match="vocabulary disagree .*architecture 'qwen2', "
                                         "tokenizer.ggml.pre 'smollm'"):
        LLMEngine(config(path))
