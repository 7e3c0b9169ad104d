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
