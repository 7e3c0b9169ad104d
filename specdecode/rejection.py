"""Verification: keep the longest prefix of proposals the target agrees with, plus one.

Exact rejection sampling (Leviathan et al. / Chen et al.): proposal ``x_j`` drawn from the
draft's ``q_j`` is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))``; at the first
rejection the replacement is drawn from ``normalise(max(0, p_j - q_j))``; if every proposal
is accepted a bonus token is drawn from ``p_k``. The emitted tokens are then distributed
exactly as the target's own samples. Deterministic proposals (n-gram) are ``q = one-hot``.
Greedy rows have one-hot ``p``, which turns the same arithmetic into "accept while the
proposal is the target's argmax, then emit the argmax": no randomness is consumed for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampler import sample_from_probs

_EPS = 1e-12


@dataclass
class Verified:
    num_accepted: list[int]  # per sequence, 0..len(proposals)
    token_ids: list[list[int]]  # accepted proposals + the bonus / replacement token


def verify_greedy(target_ids: torch.Tensor, draft_ids: torch.Tensor,
                  lengths: torch.Tensor) -> Verified:
    """``target_ids`` ``[B, k+1]`` argmax of each row; ``draft_ids`` ``[B, k]`` (padded)."""
    k = draft_ids.shape[1]
    match = (draft_ids == target_ids[:, :k]) & (torch.arange(k) < lengths[:, None])
    n_acc = match.int().cumprod(1).sum(1)
    return _emitted(n_acc, draft_ids, target_ids.gather(1, n_acc[:, None])[:, 0])


def rejection_sample(p: torch.Tensor, draft_ids: torch.Tensor, lengths: torch.Tensor,
                     q: torch.Tensor | None,
                     generators: list[torch.Generator | None]) -> Verified:
    """``p`` ``[B, k+1, V]`` target probs of each prefix; ``draft_ids`` ``[B, k]`` padded with
    anything past ``lengths``; ``q`` ``[B, k, V]`` draft probs or None (= one-hot).

    A row with a generator draws all its randomness from it, ``k`` uniforms and one
    ``V``-sized race per step whatever it accepts, so seeded requests are reproducible.
    """
    batch, k1, vocab = p.shape
    k = k1 - 1
    dev = p.device
    rows = torch.arange(batch, device=dev)
    ids = draft_ids.to(dev).clamp(0, vocab - 1)
    lens = lengths.to(dev)
    if k:
        p_x = p[:, :k].gather(2, ids[..., None])[..., 0]
        q_x = torch.ones_like(p_x) if q is None else q.gather(2, ids[..., None])[..., 0]
        u = _uniforms(batch, k, generators, dev)
        accept = (u * q_x < p_x) & (torch.arange(k, device=dev) < lens[:, None])
        n_acc = accept.int().cumprod(1).sum(1)
    else:
        n_acc = torch.zeros(batch, dtype=torch.long, device=dev)
    final_p = p[rows, n_acc]
    rejected = n_acc < lens
    if k:
        at = n_acc.clamp(max=k - 1)
        if q is None:
            final_q = torch.nn.functional.one_hot(ids[rows, at], vocab).to(p.dtype)
        else:
            final_q = q[rows, at]
        residual = (final_p - final_q).clamp_min(0)
        mass = residual.sum(-1, keepdim=True)
        # A rejection with (numerically) no residual mass means p ~= q there: fall back to p.
        use = rejected[:, None] & (mass > _EPS)
        final_p = torch.where(use, residual / mass.clamp_min(_EPS), final_p)
    bonus = sample_from_probs(final_p, generators)
    return _emitted(n_acc.cpu(), draft_ids, bonus.cpu())


def _uniforms(batch: int, k: int, generators: list[torch.Generator | None],
              device: torch.device) -> torch.Tensor:
    u = torch.rand(batch, k, device=device)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(k, device=g.device, generator=g).to(device)
    return u


def _emitted(n_acc: torch.Tensor, draft_ids: torch.Tensor, last: torch.Tensor) -> Verified:
    n = n_acc.cpu().tolist()
    drafts = draft_ids.cpu().tolist()
    final = last.cpu().tolist()
    return Verified(n, [d[:a] + [t] for d, a, t in zip(drafts, n, final, strict=True)])
