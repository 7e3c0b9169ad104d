"""Prompt-lookup proposals and the batch-expansion contraction."""

from __future__ import annotations

import pytest
import torch

from specdecode.batch_expansion import contract
from specdecode.ngram import NgramProposer


def test_proposes_what_followed_the_latest_match_of_the_longest_ngram():
    p = NgramProposer(1, 3)
    #          0  1  2  3  4  5  6  7  8  9
    context = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    # tail (1,2,3) occurs at 0 -> [4, 9, ...]; (2,3) also at 5 but the 3-gram wins.
    assert p.lookup(context, 3) == [4, 9, 2]


def test_falls_back_to_shorter_ngrams_and_to_nothing():
    p = NgramProposer(1, 3)
    assert p.lookup([7, 8, 9, 5, 8, 9], 2) == [5, 8]  # 2-gram (8, 9) at 1
    assert p.lookup([7, 1, 2, 3], 2) == []  # 3 never seen before
    assert NgramProposer(2, 3).lookup([7, 3, 5, 3], 2) == []  # 1-gram match not allowed


def test_proposals_are_cut_at_the_budget_and_the_context_end():
    p = NgramProposer(1, 2)
    assert [p.lookup(c, k) for c, k in [([1, 2, 1], 4), ([4, 5, 6, 4], 1)]] == [[2, 1], [5]]


def test_bad_ngram_range_is_rejected():
    with pytest.raises(ValueError, match="ngram_min"):
        NgramProposer(3, 2)


def test_contract_groups_rows_per_sequence_and_pads_with_the_last_row():
    rows = torch.arange(9)
    assert contract(rows, [2, 0, 4]).tolist() == [[0, 1, 2, 2, 2], [3, 3, 3, 3, 3],
                                                  [4, 5, 6, 7, 8]]
