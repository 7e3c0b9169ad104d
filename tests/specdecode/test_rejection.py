"""The rejection sampler on hand-built target (p) and draft (q) distributions."""

from __future__ import annotations

import torch

from specdecode.rejection import rejection_sample, verify_greedy


def one_hot(ids: list[int], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def test_greedy_accepts_the_matching_prefix_then_the_targets_token():
    target = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 2, 3, 4]])
    draft = torch.tensor([[5, 6, 7], [5, 6, 7], [0, 2, 3]])
    lengths = torch.tensor([3, 3, 3])
    out = verify_greedy(target, draft, lengths)
    assert out.num_accepted == [3, 1, 0]
    assert out.token_ids == [[5, 6, 7, 8], [5, 9], [1]]  # all + bonus / first / none


def test_greedy_ignores_padding_past_each_length():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    draft = torch.tensor([[5, 6, 7], [5, 6, 0]])  # row 1 padded after 1 proposal
    out = verify_greedy(target, draft, torch.tensor([3, 1]))
    assert out.token_ids == [[5, 6, 7, 8], [5, 6]]


def test_all_accepted_when_p_equals_q_and_the_bonus_comes_from_the_last_row():
    vocab = 6
    p = one_hot([2, 3, 4], vocab)[None]  # rows 0..2 of one sequence, k = 2
    q = one_hot([2, 3], vocab)[None]
    out = rejection_sample(p, torch.tensor([[2, 3]]), torch.tensor([2]), q, [None])
    assert out.num_accepted == [2]
    assert out.token_ids == [[2, 3, 4]]


def test_first_proposal_rejected_when_the_target_gives_it_no_mass():
    p = torch.tensor([[[0.0, 0.5, 0.5, 0.0], [0.25] * 4]])
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])
    out = rejection_sample(p, torch.tensor([[0]]), torch.tensor([1]), q, [None])
    assert out.num_accepted == [0]
    assert out.token_ids[0][0] in (1, 2)  # drawn from max(0, p - q), never the rejected 0


def test_ngram_proposals_are_one_hot_q_and_a_sequence_without_proposals_samples_p():
    vocab = 5
    p = torch.stack([one_hot([3, 1], vocab), one_hot([4, 4], vocab)])  # greedy-like rows
    draft = torch.tensor([[3], [0]])
    out = rejection_sample(p, draft, torch.tensor([1, 0]), None, [None, None])
    assert out.num_accepted == [1, 0]
    assert out.token_ids == [[3, 1], [4]]


def test_rejection_sampling_reproduces_the_target_distribution():
    """Empirical distribution of the first emitted token equals p_0 (tolerance 0.02 in
    total variation over 40k draws, ~5 standard errors), for a q far from p."""
    torch.manual_seed(0)
    vocab, n = 4, 40_000
    p0 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q0 = torch.tensor([0.7, 0.1, 0.1, 0.1])
    p = torch.stack([p0, torch.full((vocab,), 0.25)])[None].expand(n, 2, vocab)
    q = q0[None, None].expand(n, 1, vocab)
    draft = torch.multinomial(q0, n, replacement=True)[:, None]
    out = rejection_sample(p.contiguous(), draft, torch.full((n,), 1), q.contiguous(),
                           [None] * n)
    first = torch.tensor([t[0] for t in out.token_ids])
    freq = torch.bincount(first, minlength=vocab).float() / n
    assert (freq - p0).abs().sum() / 2 < 0.02
    # and acceptance happens at the theoretical rate sum(min(p, q)) = 0.1+0.1+0.1+0.1
    rate = sum(out.num_accepted) / n
    assert abs(rate - 0.4) < 0.02


def test_seeded_rows_are_reproducible():
    vocab = 8
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(3, 4, vocab, generator=g), -1)
    q = torch.softmax(torch.randn(3, 3, vocab, generator=g), -1)
    draft = torch.randint(0, vocab, (3, 3), generator=g)

    def run():
        gens = [torch.Generator().manual_seed(s) for s in (7, 8, 9)]
        return rejection_sample(p, draft, torch.tensor([3, 2, 1]), q, gens).token_ids

    assert run() == run()
