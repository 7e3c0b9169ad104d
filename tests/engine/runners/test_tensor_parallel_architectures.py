"""Tensor parallelism on architectures whose layers differ from llama's: q/k norms per
head (qwen3), attention + final soft-capping with alternating sliding windows (gemma2).
Greedy TP=2 equals TP=1 token for token, eagerly (the compiled path is llama's test)."""

from __future__ import annotations

import pytest

from engine.llm_engine import LLMEngine
from tests.engine.runners.architectures import build_architecture
from tests.engine.runners.test_tensor_parallel import _config, _greedy, prompt_ids

__all__ = ["prompt_ids"]  # the fixture, shared


@pytest.mark.parametrize("name", ["qwen3", "gemma2"])
def test_greedy_with_tp2_equals_tp1_on_other_architectures(name, tmp_path, tokenizer_dir,
                                                           prompt_ids):
    model_dir = build_architecture(name, tmp_path / name, tokenizer_dir)
    reference = _greedy(LLMEngine(_config(model_dir, 1, enforce_eager=True)), prompt_ids)
    engine = LLMEngine(_config(model_dir, 2, enforce_eager=True))
    try:
        assert _greedy(engine, prompt_ids) == reference
    finally:
        engine.runner.close()
