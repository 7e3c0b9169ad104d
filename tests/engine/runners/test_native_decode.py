"""The native decode step (native_decode.py): on tiny random Llama, Mistral (sliding
window) and Qwen2 (q/k/v biases, a sliding-window layer) models its logits are the eager
step's bit for bit, for every row count, contexts far apart and past the window, and
speculation's k + 1 rows of one sequence; other models and set-ups keep the compiled step.
"""

from __future__ import annotations

import pytest
import torch

from engine.runners.base import DecodeRow
from engine.runners.torch import attention, native_gemm, stock_transformers
from engine.runners.torch.model_runner import ModelRunner
from engine.runners.torch.native_decode import NATIVE_DECODE_ENV, NativeDecodeStep, native_step
from tests.engine.runners.architectures import build_architecture
from tests.engine.runners.test_compiled_step import MAX_ROWS, Seqs, config

pytestmark = pytest.mark.skipif(not native_gemm.cpu_supported(),
                                reason="the native kernels need x86 AVX2/FMA")


def runners(model_dir) -> tuple[ModelRunner, ModelRunner]:
    """A runner whose decode steps run natively and an eager one sharing its weights."""
    cfg = config(model_dir, pack_weights=True)
    native = ModelRunner(cfg)
    report = native.warmup()
    assert [(g.rows, g.status) for g in report.graphs] == [(f"1-{MAX_ROWS}", "native")]
    return native, ModelRunner(cfg, share_weights=native)


def count_native(monkeypatch, runner: ModelRunner) -> list[int]:
    graphs = runner.decode_graphs
    assert graphs is not None and graphs._native is not None
    calls: list[int] = []
    real = graphs._native.run

    def spy(inputs):
        calls.append(inputs.num_rows)
        return real(inputs)

    monkeypatch.setattr(graphs._native, "run", spy)
    return calls


def assert_equal(outs: list[torch.Tensor]) -> None:
    native, eager = outs
    assert native.shape == eager.shape
    assert torch.equal(native, eager)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_native_step_equals_the_eager_step_bit_for_bit(arch, tmp_path, tokenizer_dir,
                                                       monkeypatch):
    pair = runners(build_architecture(arch, tmp_path / arch, tokenizer_dir))
    calls = count_native(monkeypatch, pair[0])
    seqs = Seqs(pair, seed=5)
    for n in (3, 300, 17, 64, 1, 150, 40, 230):  # past the 8-token windows, 1-75 blocks
        seqs.add(n)
    for rows in range(1, MAX_ROWS + 1):
        for _ in range(2):  # the second step reads what the first wrote
            assert_equal(seqs.step(list(range(rows))))
    assert len(calls) == 2 * MAX_ROWS  # every step ran natively
    # speculation: k + 1 rows of one sequence at consecutive positions, and another row
    s = seqs.add(21)
    start = len(seqs.tokens[s]) - 1
    rows = [DecodeRow(t, start + j, seqs.tables[s])
            for j, t in enumerate([seqs.tokens[s][-1], 5, 6, 7])] + seqs.rows([0])
    assert_equal([r.execute(rows, []) for r in pair])


def test_other_models_and_setups_keep_the_compiled_step(tmp_path, tokenizer_dir,
                                                        monkeypatch):
    gemma = build_architecture("gemma2", tmp_path / "gemma2", tokenizer_dir)
    runner = ModelRunner(config(gemma, pack_weights=True))
    with pytest.raises(Exception, match="model type 'gemma2'"):
        NativeDecodeStep.build(runner.model, runner.kv_cache)
    llama = build_architecture("llama", tmp_path / "llama", tokenizer_dir)
    unpacked = ModelRunner(config(llama, pack_weights=False))
    with pytest.raises(Exception, match="not packed"):
        NativeDecodeStep.build(unpacked.model, unpacked.kv_cache)
    packed = ModelRunner(config(llama, pack_weights=True))
    assert native_step(packed.model, packed.kv_cache) is not None
    with monkeypatch.context() as m:  # GENSERVE_DECODE_ATTENTION=sdpa: SDPA's step, not ours
        m.setattr(attention, "_NATIVE_DECODE", False)
        assert native_step(packed.model, packed.kv_cache) is None
    monkeypatch.setenv(NATIVE_DECODE_ENV, "0")
    assert native_step(packed.model, packed.kv_cache) is None


def test_a_repacked_model_gets_a_fresh_native_step(tmp_path, tokenizer_dir):
    """Unpacked and packed again (a benchmark's HF baseline, ``stock_transformers``), the
    model's panels are new tensors: the step takes them instead of keeping the old ones."""
    pair = runners(build_architecture("llama", tmp_path / "llama", tokenizer_dir))
    graphs = pair[0].decode_graphs
    assert graphs is not None
    seqs = Seqs(pair, seed=6)
    seqs.add(20)
    seqs.add(5)
    assert_equal(seqs.step([0, 1]))
    before = graphs._native
    with stock_transformers(pair[0].model):
        pass
    assert_equal(seqs.step([0, 1]))
    assert graphs._native is not None and graphs._native is not before
    assert not graphs._native.stale


def test_cache_hits_give_the_same_greedy_output_through_the_native_step(tiny_model_dir,
                                                                         tokenizer_dir):
    """Prefix caching with the native step serving the decodes: a shared system prompt
    found in the cache changes no token, and the native step ran."""
    from transformers import AutoTokenizer

    from tests.engine.test_prefix_caching import SYSTEM, engine, run_one_by_one

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = [tok(SYSTEM + q)["input_ids"] for q in ("Name a prime.", "Where is Oslo?")]
    outs, cached = {}, {}
    for caching in (False, True):
        eng = engine(tiny_model_dir, caching=caching, pack_weights=True, device="cpu")
        report = eng.runner.warmup()
        assert [g.status for g in report.graphs] == ["native"]
        outs[caching], cached[caching] = run_one_by_one(eng, prompts)
    assert outs[True] == outs[False]
    assert cached[False] == [0, 0] and cached[True][0] == 0 and cached[True][1] > 0
