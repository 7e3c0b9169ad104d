"""The real default model, loaded once per test session (a GGUF load takes ~20 s)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


@pytest.fixture(scope="session")
def real_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="default", max_model_len=1024, runner="torch"))


@pytest.fixture(scope="session")
def structured_outputs(real_engine):
    from structured.manager import StructuredOutputs

    info = real_engine.info
    outputs = StructuredOutputs(real_engine.tokenizer, info.vocab_size, info.eos_token_ids)
    yield outputs
    outputs.close()
