"""Per-row LoRA on CUDA: the eager step and the captured CUDA graphs (adapter mask in a
static buffer filled before each replay) give transformers' merged-LoRA greedy tokens for
a batch mixing the base model and two adapters. Needs a CUDA device: CI has none; run on
a lent GPU machine (README)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.engine.runners.test_lora import merged_references, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def references(tiny_model_dir, lora_cache) -> dict[str, list[int]]:
    return merged_references(tiny_model_dir, lora_cache)


def cuda_engine(model_dir, cache, eager: bool, dtype: str = "float32") -> LLMEngine:
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), device="cuda", dtype=dtype, adapter_cache=str(cache),
        enforce_eager=eager, decode_buckets=[1, 2, 4], block_size=4, max_num_seqs=4,
        kv_cache_memory=2 << 20, max_model_len=128))
    report = engine.runner.warmup()
    if not eager:
        assert report.ready and all(g.status == "captured" for g in report.graphs), report
    return engine


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
def test_mixed_adapters_on_cuda_equal_transformers_merged(tiny_model_dir, lora_cache,
                                                          references, eager):
    engine = cuda_engine(tiny_model_dir, lora_cache, eager)
    replays: list[int] = []
    graphs = engine.runner.decode_graphs
    if graphs is not None:
        real = graphs.run
        graphs.run = lambda decodes: (replays.append(len(decodes)) or real(decodes))
    got = run(engine, ["a1", "", "a2"])
    assert got == [references["a1"], references[""], references["a2"]]
    assert eager or replays  # the decodes ran in captured graphs


def test_bf16_graphs_agree_with_bf16_eager(tiny_model_dir, lora_cache):
    adapters = ["a2", "a1", "", "a1"]
    eager = run(cuda_engine(tiny_model_dir, lora_cache, True, "bfloat16"), adapters)
    graphs = run(cuda_engine(tiny_model_dir, lora_cache, False, "bfloat16"), adapters)
    assert graphs == eager
