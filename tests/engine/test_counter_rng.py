"""Counter-based uniforms: a pure function of (stream, output position, purpose)."""

from __future__ import annotations

import torch

from engine.counter_rng import ACCEPT, DRAFT, SAMPLE, random_key, stream_key, uniforms


def _mix(x: int) -> int:
    """splitmix64's finaliser in plain Python integers (the reference)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


MASK, GOLDEN = (1 << 64) - 1, 0x9E3779B97F4A7C15


def test_the_mixer_is_splitmix64():
    assert _mix(GOLDEN) == 0xE220A8397B1DCDAF  # splitmix64's first output from state 0


def test_a_seeds_stream_is_pinned_across_versions():
    """Users replay a seed to get the same completion: these numbers must never change
    (a change here changes every seeded output). Checked against a plain-integer
    reference too: key = mix(mix(seed) + child * golden), the n-th draw of purpose c at
    position t is mix(key + (3t + c + 1) * golden) >> 11, over 2^53."""
    key = stream_key(42)
    assert key == stream_key(42, 0) == _mix(_mix(42))
    assert stream_key(42, 3) == _mix((_mix(42) + 3 * GOLDEN) & MASK)
    got = uniforms([key] * 4, [0, 1, 2, 3]).tolist()
    assert got == [0.6146409341949204, 0.39986438934672874, 0.38568571506576876,
                   0.9111609469462314]
    assert got == [(_mix((key + (3 * t + 1) * GOLDEN) & MASK) >> 11) * 2.0 ** -53
                   for t in range(4)]
    assert uniforms([key], [2], ACCEPT).item() == \
        (_mix((key + (3 * 2 + 2) * GOLDEN) & MASK) >> 11) * 2.0 ** -53


def test_the_draw_depends_on_key_position_and_purpose_only():
    key = stream_key(7)
    one = uniforms([key], [5])
    batch = uniforms([stream_key(1), key, stream_key(2)], [0, 5, 9])
    assert batch[1] == one[0] and batch.dtype == torch.float64
    assert uniforms([key], [5], SAMPLE) == one
    assert len({float(uniforms([key], [5], p)[0]) for p in (SAMPLE, ACCEPT, DRAFT)}) == 3


def test_children_and_seeds_draw_distinct_streams():
    keys = {stream_key(seed, child) for seed in range(50) for child in range(4)}
    assert len(keys) == 200  # seed + child never aliases another (seed, child)
    assert stream_key(1, 0) != stream_key(0, 1)
    assert stream_key(2 ** 63 - 1) != stream_key(0)


def test_uniforms_are_in_the_unit_interval_and_look_uniform():
    n = 100_000
    u = uniforms([stream_key(3)] * n, range(n))
    assert float(u.min()) >= 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005  # std of the mean: 0.0009
    assert abs(float(u.var()) - 1 / 12) < 0.002
    hist = torch.histc(u.float(), bins=20, min=0, max=1)
    expected = n / 20
    assert float(((hist - expected) ** 2 / expected).sum()) < 43.8  # chi2(19), p = 0.001
    # consecutive positions are not correlated
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01


def test_random_keys_follow_torchs_global_seed():
    torch.manual_seed(5)
    a = [random_key() for _ in range(3)]
    torch.manual_seed(5)
    assert [random_key() for _ in range(3)] == a and len(set(a)) == 3
    assert all(0 <= k < 2 ** 64 for k in a)
