"""Verification on hand-built target (p) and draft (q) distributions: deterministic proposals
are accepted exactly when they are the plain sample (so speculation never changes a seeded
output), sampled draft proposals get exact rejection sampling."""

from __future__ import annotations

import torch

from engine.counter_rng import ACCEPT, stream_key, uniforms
from engine.sampler import sample_from_probs
from specdecode.rejection import SampledDraft, rejection_sample, verify_matching


def one_hot(ids: list[int], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def targets_of(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``[B, k+1]`` inverse-CDF draws of ``p`` ``[B, k+1, V]`` at ``u`` ``[B, k+1]``."""
    batch, k1, vocab = p.shape
    return sample_from_probs(p.reshape(-1, vocab), u.reshape(-1)).view(batch, k1)


def test_matching_accepts_the_matching_prefix_then_the_targets_token():
    target = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 2, 3, 4]])
    draft = torch.tensor([[5, 6, 7], [5, 6, 7], [0, 2, 3]])
    lengths = torch.tensor([3, 3, 3])
    out = verify_matching(target, draft, lengths)
    assert out.num_accepted == [3, 1, 0]
    assert out.token_ids == [[5, 6, 7, 8], [5, 9], [1]]  # all + bonus / first / none


def test_matching_ignores_padding_past_each_length():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    draft = torch.tensor([[5, 6, 7], [5, 6, 0]])  # row 1 padded after 1 proposal
    out = verify_matching(target, draft, torch.tensor([3, 1]))
    assert out.token_ids == [[5, 6, 7, 8], [5, 6]]


def test_a_deterministic_proposal_yields_exactly_the_plain_sample_for_every_u():
    """For every proposal d and every u on a grid (and on every CDF boundary): the emitted
    token is the inverse-CDF sample at u, d is accepted exactly when u lies in d's interval,
    so the accepted fraction of the grid is p(d) (dyadic probabilities: exact). Checked
    through ``rejection_sample`` with a sampled-draft row beside it, and ``verify_matching``."""
    p0 = torch.tensor([0.25, 0.0, 0.125, 0.0625, 0.5, 0.0625])
    vocab = len(p0)
    cdf = [0.0, *p0.double().cumsum(0).tolist()]
    grid = sorted({i / 256 for i in range(256)} | set(cdf[:-1])
                  | {c - 2.0 ** -30 for c in cdf[1:-1]})
    n = len(grid)
    u0 = torch.tensor(grid, dtype=torch.float64)
    plain = sample_from_probs(p0.expand(n, -1), u0)
    bonus = torch.full((vocab,), 1 / vocab)
    for d in range(vocab):
        p = torch.stack([p0, bonus])[None].expand(n + 1, 2, vocab).contiguous()
        u = torch.stack([torch.cat([u0, u0[:1]]),
                         torch.full((n + 1,), 0.5, dtype=torch.float64)], 1)
        draft = torch.full((n + 1, 1), d)
        lens = torch.ones(n + 1, dtype=torch.long)
        sampled = SampledDraft(torch.tensor([False] * n + [True]),
                               torch.full((n + 1, 1, vocab), 1 / vocab),
                               torch.full((n + 1, 1), 0.5, dtype=torch.float64))
        for out in (rejection_sample(p, draft, lens, targets_of(p, u), u, sampled),
                    verify_matching(targets_of(p, u)[:n], draft[:n], lens[:n])):
            first = [t[0] for t in out.token_ids[:n]]
            assert first == plain.tolist(), f"proposal {d}"
            accepted = out.num_accepted[:n]
            assert accepted == [int(lo <= x < hi and hi > lo) for x, lo, hi in
                                zip(grid, [cdf[d]] * n, [cdf[d + 1]] * n, strict=True)]
            on_grid = [a for a, x in zip(accepted, grid, strict=True) if x * 256 == int(x * 256)]
            assert sum(on_grid) / 256 == p0[d]


def test_speculative_emission_equals_plain_sampling_token_for_token():
    """A toy LM (next-token distribution from the last token), one seeded stream: decoding
    one token a step and decoding with proposals of any quality (k of 1..4, right and
    wrong guesses) emit the same tokens, because each position draws the same uniform."""
    vocab = 12
    table = torch.softmax(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))
                          * 1.5, -1)
    key, prompt, n = stream_key(1234), [3], 60

    def dist(prefix: list[int]) -> torch.Tensor:
        return table[prefix[-1]]

    plain: list[int] = []
    for t in range(n):
        u = uniforms([key], [t])
        plain.append(int(sample_from_probs(dist(prompt + plain)[None], u)[0]))
    guesser = torch.Generator().manual_seed(1)
    out: list[int] = []
    steps = 0
    while len(out) < n:
        k = int(torch.randint(1, 5, (1,), generator=guesser))
        # proposals: the plain continuation, each guess corrupted with probability 1/3
        proposals = [plain[len(out) + j] if len(out) + j < n
                     and torch.rand(1, generator=guesser) > 1 / 3
                     else int(torch.randint(0, vocab, (1,), generator=guesser))
                     for j in range(k)]
        p = torch.stack([dist(prompt + out + proposals[:j]) for j in range(k + 1)])[None]
        u = uniforms([key] * (k + 1), [len(out) + j for j in range(k + 1)])[None]
        verified = verify_matching(targets_of(p, u), torch.tensor([proposals]),
                                   torch.tensor([k]))
        out += verified.token_ids[0]
        steps += 1
    assert out[:n] == plain
    assert steps < n  # proposals were accepted along the way


def test_sampled_draft_all_accepted_when_p_equals_q_and_the_bonus_comes_from_the_last_row():
    vocab = 6
    p = one_hot([2, 3, 4], vocab)[None]  # rows 0..2 of one sequence, k = 2
    q = one_hot([2, 3], vocab)[None]
    u = torch.tensor([[0.3, 0.6, 0.9]], dtype=torch.float64)
    sampled = SampledDraft(torch.tensor([True]), q, torch.tensor([[0.99, 0.99]],
                                                                 dtype=torch.float64))
    out = rejection_sample(p, torch.tensor([[2, 3]]), torch.tensor([2]), targets_of(p, u), u,
                           sampled)
    assert out.num_accepted == [2]
    assert out.token_ids == [[2, 3, 4]]


def test_sampled_draft_first_proposal_rejected_when_the_target_gives_it_no_mass():
    p = torch.tensor([[[0.0, 0.5, 0.5, 0.0], [0.25] * 4]])
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])
    for x in (0.0, 0.3, 0.7, 1 - 2.0 ** -53):
        u = torch.tensor([[x, x]], dtype=torch.float64)
        sampled = SampledDraft(torch.tensor([True]), q, torch.tensor([[0.0]],
                                                                     dtype=torch.float64))
        out = rejection_sample(p, torch.tensor([[0]]), torch.tensor([1]), targets_of(p, u),
                               u, sampled)
        assert out.num_accepted == [0]
        assert out.token_ids[0] == [1 if x < 0.5 else 2]  # max(0, p - q) at u, never 0


def test_rejection_sampling_reproduces_the_target_distribution():
    """Empirical distribution of the first emitted token equals p_0 (tolerance 0.02 in
    total variation over 40k draws, ~5 standard errors), for a q far from p; the uniforms
    are the counter streams of 40k seeds."""
    torch.manual_seed(0)
    vocab, n = 4, 40_000
    p0 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q0 = torch.tensor([0.7, 0.1, 0.1, 0.1])
    p = torch.stack([p0, torch.full((vocab,), 0.25)])[None].expand(n, 2, vocab).contiguous()
    q = q0[None, None].expand(n, 1, vocab).contiguous()
    draft = torch.multinomial(q0, n, replacement=True)[:, None]
    keys = [stream_key(s) for s in range(n)]
    u = torch.stack([uniforms(keys, [0] * n), uniforms(keys, [1] * n)], 1)
    sampled = SampledDraft(torch.ones(n, dtype=torch.bool), q,
                           uniforms(keys, [0] * n, ACCEPT)[:, None])
    out = rejection_sample(p, draft, torch.full((n,), 1), targets_of(p, u), u, sampled)
    first = torch.tensor([t[0] for t in out.token_ids])
    freq = torch.bincount(first, minlength=vocab).float() / n
    assert (freq - p0).abs().sum() / 2 < 0.02
    # and acceptance happens at the theoretical rate sum(min(p, q)) = 0.1+0.1+0.1+0.1
    rate = sum(out.num_accepted) / n
    assert abs(rate - 0.4) < 0.02


def test_deterministic_proposals_keep_the_target_distribution_and_accept_at_p():
    """The matching rule for a fixed proposal: first tokens follow p_0 and the proposal is
    accepted at rate p_0(d) (40k seeds)."""
    vocab, n, d = 4, 40_000, 3
    p0 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    p = torch.stack([p0, torch.full((vocab,), 0.25)])[None].expand(n, 2, vocab).contiguous()
    keys = [stream_key(s) for s in range(n)]
    u = torch.stack([uniforms(keys, [0] * n), uniforms(keys, [1] * n)], 1)
    out = verify_matching(targets_of(p, u), torch.full((n, 1), d), torch.ones(n).long())
    first = torch.tensor([t[0] for t in out.token_ids])
    freq = torch.bincount(first, minlength=vocab).float() / n
    assert (freq - p0).abs().sum() / 2 < 0.02
    assert abs(sum(out.num_accepted) / n - 0.4) < 0.02
