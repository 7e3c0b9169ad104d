"""The torch runner's native fp32 linear: F.linear's numbers up to summation order, and a
row's bits independent of the other rows, the row count and the thread count (the torch
runner's batch invariance rests on it)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from engine.runners.torch import native_gemm, packed_linear

pytestmark = pytest.mark.skipif(not native_gemm.cpu_supported(),
                                reason="the native kernel needs an x86 CPU with AVX2/FMA")


@pytest.fixture(scope="module", autouse=True)
def built():
    assert native_gemm.available()


@pytest.mark.parametrize("n,k,bias", [(64, 32, False), (40, 96, True), (7, 5, True),
                                      (576, 576, False)])
def test_the_product_is_as_exact_as_f_linears(n, k, bias):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(3, 5, k, generator=g)  # any leading shape
    got = native_gemm.linear(x, native_gemm.pack(w), n, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == want.shape
    # as close to the exact product as F.linear's own fp32 result is, within a factor
    mkl = (F.linear(x, w, b) - want).abs().max().item()
    assert (got - want).abs().max().item() <= 4 * mkl + 1e-6


@pytest.mark.usefixtures("torch_threads_restored")
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_bits_do_not_depend_on_the_other_rows_or_their_number(threads):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    n, k = 100, 200  # 7 panels, the last one partial
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = native_gemm.pack(w)
    rows = torch.randn(40, k, generator=g)
    alone = torch.stack([native_gemm.linear(rows[i:i + 1], packed, n, b)[0]
                         for i in range(len(rows))])
    for m in (2, 5, 6, 7, 13, 40):  # below, at and past the 6-row tile
        assert torch.equal(native_gemm.linear(rows[:m], packed, n, b), alone[:m]), m
    torch.set_num_threads(1 if threads == 2 else 2)
    assert torch.equal(native_gemm.linear(rows, packed, n, b), alone)


def test_unpack_gives_the_exact_weight_back():
    w = torch.randn(37, 19)
    assert torch.equal(native_gemm.unpack(native_gemm.pack(w), 37), w)


def test_packed_layers_run_the_native_kernel_and_unpack_exactly():
    layer = torch.nn.Linear(48, 33)
    x = torch.randn(4, 48)
    want, weight = layer(x), layer.weight.detach().clone()
    model = torch.nn.Sequential(layer)
    assert packed_linear.pack_linears(model) == 1
    key = packed_linear.packed_key(layer)
    assert key is not None and not packed_linear._LAYERS[key].weight.is_mkldnn
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    packed_linear.unpack_linears(model)
    assert torch.equal(layer.weight, weight)


def test_without_the_native_kernel_onednn_packs_the_layers(monkeypatch):
    monkeypatch.setattr(native_gemm, "available", lambda: False)
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(2, 16)
    want = layer(x)
    model = torch.nn.Sequential(layer)
    packed_linear.pack_linears(model)
    key = packed_linear.packed_key(layer)
    assert key is not None and packed_linear._LAYERS[key].weight.is_mkldnn
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    packed_linear.unpack_linears(model)


def test_a_failed_build_keeps_onednn_and_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(native_gemm.NATIVE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with caplog.at_level(logging.WARNING, logger=native_gemm.__name__):
        assert native_gemm.available.__wrapped__() is False
    assert "oneDNN runs the linears" in caplog.text and "false failed" in caplog.text
    assert not list(tmp_path.iterdir())  # no half-written library left behind


def _dequantised(n: int, k: int, qtype: str, seed: int) -> torch.Tensor:
    """A weight as a model loaded from a GGUF file holds it: gguf's own quantiser, then its
    dequantiser (what transformers' GGUF loading runs)."""
    from gguf import GGMLQuantizationType, quants

    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).numpy()
    t = GGMLQuantizationType[qtype]
    return torch.from_numpy(quants.dequantize(quants.quantize(w, t), t).copy()).reshape(n, k)


@pytest.mark.usefixtures("torch_threads_restored")
@pytest.mark.parametrize("qtype,bits,n,k", [("Q4_1", 4, 100, 96), ("Q4_0", 4, 16, 64),
                                            ("Q8_0", 8, 37, 160), ("Q4_1", 4, 576, 576)])
def test_a_dequantised_gguf_weight_is_kept_in_its_blocks_and_gives_the_fp32_panels_bits(
        qtype, bits, n, k):
    w = _dequantised(n, k, qtype, seed=n + k)
    got = native_gemm.pack_quantized(w)
    assert got is not None
    q, scales, got_bits = got
    assert got_bits == bits
    assert q.nbytes + scales.nbytes <= w.nbytes * (bits + 2) / 32 + 16 * 64 * k
    assert torch.equal(native_gemm.dequantize(q, scales, bits, n), w)
    g = torch.Generator().manual_seed(7)
    b = torch.randn(n, generator=g)
    x = torch.randn(40, k, generator=g)
    fp32 = native_gemm.pack(w)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for m in (1, 2, 3, 4, 5, 6, 7, 13, 40):  # the direct rows and the expanded panels
            assert torch.equal(native_gemm.linear_quantized(x[:m], q, scales, bits, n, b),
                               native_gemm.linear(x[:m], fp32, n, b)), (threads, m)
    assert torch.equal(native_gemm.linear_quantized(x[:3], q, scales, bits, n, None),
                       native_gemm.linear(x[:3], fp32, n, None))


def test_a_weight_that_is_not_exactly_quantised_stays_in_fp32_panels():
    assert native_gemm.pack_quantized(torch.randn(32, 64)) is None  # not quantised at all
    assert native_gemm.pack_quantized(_dequantised(16, 64, "Q4_1", 1)[:, :48]) is None  # K % 32
    w = _dequantised(16, 64, "Q4_1", 2)
    w[9, 40] = torch.nextafter(w[9, 40], torch.tensor(1.0))  # one weight one ulp off
    assert native_gemm.pack_quantized(w) is None


def test_packed_layers_keep_dequantised_weights_quantised_with_the_same_outputs(monkeypatch):
    layer = torch.nn.Linear(64, 40)
    with torch.no_grad():
        layer.weight.copy_(_dequantised(40, 64, "Q4_1", 3))
    weight, x = layer.weight.detach().clone(), torch.randn(5, 64)
    model = torch.nn.Sequential(layer)
    monkeypatch.setenv(packed_linear.QUANTIZED_ENV, "0")  # fp32 panels: the reference
    packed_linear.pack_linears(model)
    key = packed_linear.packed_key(layer)
    assert key is not None and packed_linear._LAYERS[key].scales is None
    want = layer(x)
    packed_linear.unpack_linears(model)
    monkeypatch.delenv(packed_linear.QUANTIZED_ENV)
    packed_linear.pack_linears(model)
    assert packed_linear._LAYERS[key].bits == 4
    assert torch.equal(layer(x), want)
    packed_linear.unpack_linears(model)
    assert torch.equal(layer.weight, weight)
