"""Per-sequence proposal pacing: more proposals while they are accepted, fewer after a
rejection, and a back-off once they keep missing."""

from __future__ import annotations

from specdecode.worker import MAX_BACKOFF, START_K, _Pace


def test_full_acceptance_grows_k_fourfold_up_to_the_cap():
    pace = _Pace(1)
    pace.observe(1, 1, k_max=8)
    assert pace.k == 4
    pace.observe(4, 4, k_max=8)
    assert pace.k == 8
    pace.observe(8, 8, k_max=8)
    assert pace.k == 8


def test_partial_acceptance_proposes_what_was_accepted_plus_one():
    pace = _Pace(8)
    pace.observe(8, 3, k_max=8)
    assert (pace.k, pace.skip) == (4, 0)


def test_one_miss_does_not_skip_but_repeated_misses_back_off_exponentially():
    pace = _Pace(START_K)
    pace.observe(START_K, 0, k_max=8)
    assert (pace.k, pace.skip) == (1, 0)  # a changed word in copied text: try again
    skips = []
    for _ in range(8):
        pace.observe(1, 0, k_max=8)
        skips.append(pace.skip)
    assert skips == [1, 2, 4, 8, 16, 16, 16, 16]
    assert max(skips) == MAX_BACKOFF


def test_an_accepted_proposal_ends_the_back_off():
    pace = _Pace(1)
    for _ in range(4):
        pace.observe(1, 0, k_max=8)
    pace.observe(1, 1, k_max=8)
    assert (pace.misses, pace.skip, pace.k) == (0, 0, 4)
