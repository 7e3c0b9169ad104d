"""The torch runner's paged KV cache tensors: fixed-size blocks of token slots per layer.

Memory is bounded by ``kv_cache_memory``; the scheduler hands out the block ids
(engine/kv_cache.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


class KVCache:
    """Per-layer key and value tensors ``[num_blocks, block_size, kv_heads, head_dim]``."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.spec = spec
        if device.type == "cpu":
            both = _lazily_zeroed((2, spec.num_layers, *shape), spec.dtype)
            self.key, self.value = list(both[0]), list(both[1])
        else:
            self.key = [torch.zeros(shape, dtype=spec.dtype, device=device)
                        for _ in range(spec.num_layers)]
            self.value = [torch.zeros(shape, dtype=spec.dtype, device=device)
                          for _ in range(spec.num_layers)]


def _lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor from calloc'd memory: the OS hands out zero pages as they are
    first touched, instead of ``torch.zeros`` writing the whole cache at start-up (up to
    1 s for the default 1 GiB on a busy 2-core machine). 64-byte aligned for SIMD loads."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.from_numpy(np.zeros(nbytes + 64, dtype=np.uint8))
    offset = -raw.data_ptr() % 64
    return raw[offset:offset + nbytes].view(dtype).view(shape)
