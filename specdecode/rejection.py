"""Verification: keep the longest prefix of proposals the target agrees with, plus one.

Every row of a sequence (its last token and each proposal) has a *target token*: the
argmax for greedy rows, and for sampled rows the inverse-CDF draw of the row's distribution
at the uniform of its own output position (``engine.counter_rng``), i.e. exactly the token
plain sampling would pick there.

A proposal made without randomness of its own (n-gram lookup, a greedy draft) is accepted
when it *is* the target token: ``u`` falls in the proposal's interval of the target's CDF,
which happens with probability ``p(x)``, the acceptance rule of rejection sampling for a
one-hot ``q``; where it is rejected the target token is the replacement, distributed as the
normalised residual ``max(0, p - q)`` (``p`` without ``x``). The same rule serves a draft
that samples from the very uniforms the target uses (seeded rows of a draft model): the
coupling is less efficient than rejection sampling's, but either way the emitted tokens are
those of plain sampling, token for token, whatever was proposed.

A proposal drawn from a draft distribution ``q`` with independent randomness (an unseeded
row of a sampling draft model) gets exact rejection sampling (Leviathan et al. / Chen et
al.): accepted with probability ``min(1, p(x) / q(x))`` on its own uniform, replaced at the
first rejection by a draw from ``normalise(max(0, p - q))``. That keeps the target's
distribution with the best acceptance, but not the plain-sampling tokens.
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


@dataclass
class SampledDraft:
    """The rows whose proposals were drawn from a draft distribution with randomness of
    their own, and what rejection sampling needs of them."""

    rows: torch.Tensor  # [B] bool
    q: torch.Tensor  # [B, k, V] draft probabilities (rows not in ``rows``: never read)
    accept_u: torch.Tensor  # [B, k] float64 uniforms of the accept tests


def verify_matching(target_ids: torch.Tensor, draft_ids: torch.Tensor,
                    lengths: torch.Tensor) -> Verified:
    """Accept while the proposal is the target token, then emit the target token.
    ``target_ids`` ``[B, k+1]``; ``draft_ids`` ``[B, k]`` (padded past ``lengths``)."""
    k = draft_ids.shape[1]
    match = (draft_ids == target_ids[:, :k]) & (torch.arange(k) < lengths[:, None])
    n_acc = match.int().cumprod(1).sum(1)
    return _emitted(n_acc, draft_ids, target_ids.gather(1, n_acc[:, None])[:, 0])


def rejection_sample(p: torch.Tensor, draft_ids: torch.Tensor, lengths: torch.Tensor,
                     target_ids: torch.Tensor, u: torch.Tensor,
                     draft: SampledDraft) -> Verified:
    """Exact rejection sampling for ``draft.rows``, ``verify_matching`` for the others.

    ``p`` ``[B, k+1, V]`` target probs of each prefix; ``target_ids`` ``[B, k+1]`` (CPU) the
    target token of each row drawn with ``u`` ``[B, k+1]``, the rows' own uniforms, which
    also draw a replacement from the residual.
    """
    batch, k1, vocab = p.shape
    k = k1 - 1
    dev = p.device
    ids = draft_ids.clamp(0, vocab - 1)
    p_x = p[:, :k].gather(2, ids.to(dev)[..., None])[..., 0]
    q_x = draft.q.to(dev).gather(2, ids.to(dev)[..., None])[..., 0]
    by_q = (draft.accept_u.to(dev) * q_x < p_x).cpu()
    matches = draft_ids == target_ids[:, :k]
    accept = torch.where(draft.rows[:, None], by_q, matches) & (torch.arange(k) < lengths[:, None])
    n_acc = accept.int().cumprod(1).sum(1)
    final = target_ids.gather(1, n_acc[:, None])[:, 0].clone()
    redo = (draft.rows & (n_acc < lengths)).nonzero().flatten()
    if len(redo):
        at = n_acc[redo]
        p_at = p[redo.to(dev), at.to(dev)]
        residual = (p_at - draft.q.to(dev)[redo.to(dev), at.to(dev)]).clamp_min(0)
        mass = residual.sum(-1, keepdim=True)
        # A rejection with (numerically) no residual mass means p ~= q there: fall back to p.
        residual = torch.where(mass > _EPS, residual / mass.clamp_min(_EPS), p_at)
        final[redo] = sample_from_probs(residual, u[redo, at]).cpu()
    return _emitted(n_acc, draft_ids, final)


def _emitted(n_acc: torch.Tensor, draft_ids: torch.Tensor, last: torch.Tensor) -> Verified:
    n = n_acc.cpu().tolist()
    drafts = draft_ids.cpu().tolist()
    final = last.cpu().tolist()
    return Verified(n, [d[:a] + [t] for d, a, t in zip(drafts, n, final, strict=True)])
