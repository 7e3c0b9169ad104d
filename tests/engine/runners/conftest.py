"""Fixtures shared by the runner tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def torch_threads_restored():
    """The llama.cpp runner limits torch to one thread (it only samples): give later test
    modules theirs back."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
