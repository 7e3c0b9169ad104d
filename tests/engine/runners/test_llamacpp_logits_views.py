"""The llama.cpp runner's cached views of llama.cpp's logits buffer follow the buffer: the
rows llama.cpp wrote, a fresh view when it reallocates (a larger batch of outputs), never
a stale one. A ctypes callback stands in for ``llama_get_logits``: no llama.cpp needed."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.runners.llamacpp import LogitsViews

VOCAB = 7
GET_LOGITS = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)


class FakeOutputBuffer:
    """What ``llama_get_logits`` returns: the address of the context's current buffer."""

    def __init__(self) -> None:
        self.buffer = np.zeros(4 * VOCAB, np.float32)
        self.function = GET_LOGITS(lambda ctx: self.buffer.ctypes.data if ctx == 5 else 0)
        self.lib = SimpleNamespace(llama_get_logits=self.function)


def test_views_show_what_llama_cpp_wrote_and_follow_a_reallocated_buffer():
    fake = FakeOutputBuffer()
    views = LogitsViews(fake.lib, VOCAB)
    fake.buffer[:VOCAB] = np.arange(VOCAB)
    one = views.rows(5, 1)
    assert one.shape == (1, VOCAB) and one.dtype == torch.float32
    assert one[0].tolist() == list(range(VOCAB))
    fake.buffer[:VOCAB] = 3.0  # the next decode writes in place: the same view sees it
    assert views.rows(5, 1) is one and one[0].tolist() == [3.0] * VOCAB
    two = views.rows(5, 2)
    assert two.shape == (2, VOCAB) and two.data_ptr() == fake.buffer.ctypes.data
    old = fake.buffer
    fake.buffer = np.full(16 * VOCAB, 9.0, np.float32)  # llama.cpp reallocated its outputs
    again = views.rows(5, 1)
    assert again.data_ptr() == fake.buffer.ctypes.data != old.ctypes.data
    assert again[0].tolist() == [9.0] * VOCAB


def test_no_logits_buffer_is_an_error_not_a_view_of_address_zero():
    fake = FakeOutputBuffer()
    with pytest.raises(RuntimeError, match="no logits"):
        LogitsViews(fake.lib, VOCAB).rows(6, 1)
