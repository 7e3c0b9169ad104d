"""The real default model, loaded once per test session: on the torch runner (greedy
output is compared with transformers' own) and on the default runner (``auto``: llama.cpp on
the CPU), which decodes the structured-output suites ~2x faster here."""

from __future__ import annotations

import gc

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


@pytest.fixture(scope="session")
def real_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="default", max_model_len=1024, runner="torch"))


@pytest.fixture(scope="module")
def default_engine():
    """What ``make serve`` runs, less the torch prefill copy (the suites' prompts are
    shorter than where it takes over on a CPU, and loading it would only cost time).
    Per module and closed after it: a worker keeps session fixtures to its end, and two
    workers' engines beside a server test's processes once ran this machine out of memory."""
    engine = LLMEngine(EngineConfig(model="default", max_model_len=1024, torch_prefill_tokens=0))
    yield engine
    del engine
    gc.collect()  # the llama.cpp context is freed with its runner


@pytest.fixture(scope="session")
def structured_outputs(real_engine):
    from structured.manager import StructuredOutputs

    info = real_engine.info
    outputs = StructuredOutputs(real_engine.tokenizer, info.vocab_size, info.eos_token_ids)
    yield outputs
    outputs.close()
