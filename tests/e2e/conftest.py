"""The real default model, loaded once per test session: on the torch runner (greedy
output is compared with transformers' own) and on the default runner (``auto``: llama.cpp on
the CPU), which decodes the structured-output suites ~2x faster here."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


@pytest.fixture(scope="session")
def real_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="default", max_model_len=1024, runner="torch"))


@pytest.fixture(scope="session")
def default_engine() -> LLMEngine:
    """What ``make serve`` runs, less the torch prefill copy (the suites' prompts are
    shorter than where it takes over on a CPU, and loading it would only cost time)."""
    return LLMEngine(EngineConfig(model="default", max_model_len=1024, torch_prefill_tokens=0))


@pytest.fixture(scope="session")
def structured_outputs(real_engine):
    from structured.manager import StructuredOutputs

    info = real_engine.info
    outputs = StructuredOutputs(real_engine.tokenizer, info.vocab_size, info.eos_token_ids)
    yield outputs
    outputs.close()
