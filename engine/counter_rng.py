"""Counter-based uniforms: one float64 in [0, 1) per (stream, output position, purpose).

A sequence's randomness is a pure function of its stream key and the output position of
the token being drawn, never of how many numbers were drawn before. So the same seed gives
the same tokens whoever shares the batch, whichever row it sits in, after a preemption,
and whether or not speculation ran for a step (a speculative step draws the numbers of the
positions it verifies, exactly as plain steps would one by one).

The generator is splitmix64 (Steele et al. 2014) run in counter mode: the n-th output of a
stream keyed ``k`` is ``mix(k + n * golden)``; a stream key is itself ``mix`` of the seed
and the child index, so ``n > 1`` children draw distinct streams. Integer arithmetic on the
CPU (numpy ``uint64`` wraps), so the numbers are the same on every device and platform.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Purposes: independent streams drawn at the same position.
SAMPLE = 0  # the token's own draw (inverse CDF of the target's distribution)
ACCEPT = 1  # the accept test of a sampled draft proposal (rejection sampling)
DRAFT = 2  # a sampled draft proposal (draft model, unseeded row)
_PURPOSES = 3

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on a ``uint64`` array."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def stream_key(seed: int, index: int = 0) -> int:
    """The stream of child ``index`` of a request seeded ``seed``."""
    with np.errstate(over="ignore"):
        base = _mix(np.array([seed & _MASK64], dtype=np.uint64))
        return int(_mix(base + np.uint64(index) * _GOLDEN)[0])


def random_key() -> int:
    """A stream for an unseeded sequence, from torch's global RNG (so ``torch.manual_seed``
    and the server's ``--seed`` still make a run repeatable)."""
    high, low = torch.randint(0, 1 << 32, (2,)).tolist()
    return (high << 32) | low


def uniforms(keys: Sequence[int], positions: Sequence[int], purpose: int = SAMPLE
             ) -> torch.Tensor:
    """``[len(keys)]`` float64 uniforms in [0, 1) (53 random bits each), on the CPU."""
    if not 0 <= purpose < _PURPOSES:
        raise ValueError(f"purpose must be in 0..{_PURPOSES - 1}, got {purpose}")
    k = np.asarray(keys, dtype=np.uint64)
    counter = np.asarray(positions, dtype=np.uint64) * np.uint64(_PURPOSES) \
        + np.uint64(purpose + 1)
    with np.errstate(over="ignore"):
        bits = _mix(k + counter * _GOLDEN) >> np.uint64(11)
    return torch.from_numpy(bits.astype(np.float64) * 2.0 ** -53)
