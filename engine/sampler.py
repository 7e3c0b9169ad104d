"""Vectorised sampling over a batch whose rows each carry their own parameters.

Order, as HF's logits processors apply them (so greedy + penalties match ``generate``):
banned ids -> repetition penalty -> presence/frequency penalties -> (greedy: argmax) ->
temperature -> top-k -> top-p -> min-p -> typical-p -> sample.
Sampling uses the exponential race ``argmax(p / q), q ~ Exp(1)``: an exact categorical
draw whose noise for a seeded row comes from that row's own generator with a fixed-size
draw, so a seeded request samples the same tokens whatever its batch mates are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B], 0 = greedy row
    top_k: torch.Tensor  # [B] long, 0 = off
    top_p: torch.Tensor
    min_p: torch.Tensor
    typical_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    generators: list[torch.Generator | None]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    banned_token_ids: list[list[int]]
    max_top_logprobs: int
    need_logprobs: bool
    all_greedy: bool
    no_penalties: bool
    no_top_filters: bool

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], generators: list[torch.Generator | None],
              banned_token_ids: list[list[int]], device: torch.device | str) -> SamplingMetadata:
        def col(name: str, dtype=torch.float32) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)

        no_penalties = all(p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
                           and p.frequency_penalty == 0.0 for p in params)
        no_top_filters = all(p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0
                             and p.typical_p == 1.0 for p in params)
        return cls(
            temperature=col("temperature"), top_k=col("top_k", torch.long),
            top_p=col("top_p"), min_p=col("min_p"), typical_p=col("typical_p"),
            repetition_penalty=col("repetition_penalty"),
            presence_penalty=col("presence_penalty"),
            frequency_penalty=col("frequency_penalty"),
            generators=generators, prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids, banned_token_ids=banned_token_ids,
            max_top_logprobs=max((p.top_logprobs for p in params), default=0),
            need_logprobs=any(p.logprobs or p.top_logprobs for p in params),
            all_greedy=all(p.temperature == 0.0 for p in params),
            no_penalties=no_penalties, no_top_filters=no_top_filters,
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] long, CPU
    logprobs: torch.Tensor | None  # [B] raw logprob of the chosen token, CPU
    top_token_ids: torch.Tensor | None  # [B, max_top_logprobs], CPU
    top_logprobs: torch.Tensor | None


def _padded(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids padded to ``[B, L]`` (pad 0) and the matching validity mask."""
    width = max((len(r) for r in rows), default=0) or 1
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            ids[i, :len(r)] = torch.tensor(r)
            valid[i, :len(r)] = True
    return ids.to(device), valid.to(device)


def _counts(rows: list[list[int]], vocab: int, device) -> torch.Tensor:
    ids, valid = _padded(rows, device)
    counts = torch.zeros(len(rows), vocab, device=device)
    counts.scatter_add_(1, ids, valid.float())
    return counts


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Banned ids, repetition (prompt + output) and presence/frequency (output) penalties."""
    if any(meta.banned_token_ids):
        ids, valid = _padded(meta.banned_token_ids, logits.device)
        ban = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, valid)
        logits = logits.masked_fill(ban, -torch.inf)
    if meta.no_penalties:
        return logits
    vocab = logits.shape[1]
    rep = meta.repetition_penalty[:, None]
    if (meta.repetition_penalty != 1.0).any():
        seen = _counts([p + o for p, o in zip(meta.prompt_token_ids, meta.output_token_ids,
                                              strict=True)], vocab, logits.device) > 0
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    if (meta.presence_penalty != 0).any() or (meta.frequency_penalty != 0).any():
        counts = _counts(meta.output_token_ids, vocab, logits.device)
        logits = (logits - meta.frequency_penalty[:, None] * counts
                  - meta.presence_penalty[:, None] * (counts > 0))
    return logits


def _filter(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature and top-k/top-p/min-p/typical-p on sampled rows; -inf where cut."""
    temp = torch.where(meta.temperature > 0, meta.temperature, torch.ones_like(meta.temperature))
    logits = logits / temp[:, None]
    if meta.no_top_filters:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    cut = torch.zeros_like(sorted_logits, dtype=torch.bool)
    k = torch.where(meta.top_k > 0, meta.top_k, torch.full_like(meta.top_k, vocab))
    cut |= ranks >= k[:, None]
    probs = sorted_logits.masked_fill(cut, -torch.inf).softmax(-1)
    # top-p: drop tokens once the mass *before* them reaches p (keeps at least one).
    mass_before = probs.cumsum(-1) - probs
    cut |= mass_before >= meta.top_p[:, None]
    # min-p: drop tokens below min_p * p(top token).
    cut |= probs < meta.min_p[:, None] * probs[:, :1]
    cut[:, 0] = False  # the top token always survives
    sorted_logits = sorted_logits.masked_fill(cut, -torch.inf)
    logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if (meta.typical_p < 1.0).any():
        logits = _typical(logits, meta.typical_p)
    return logits


def _typical(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """HF's TypicalLogitsWarper: keep the tokens whose surprise is closest to the entropy,
    the smallest such set reaching ``mass``; rows with mass 1 are untouched."""
    logp = torch.log_softmax(logits, -1)
    p = logp.exp()
    entropy = -(logp * p).nansum(-1, keepdim=True)
    shifted = (-logp - entropy).abs()
    sorted_shifted, idx = shifted.sort(dim=-1)
    cum = logits.gather(1, idx).softmax(-1).cumsum(-1)
    last = (cum < mass[:, None]).sum(-1).clamp(max=logits.shape[1] - 1)
    remove_sorted = sorted_shifted > sorted_shifted.gather(1, last[:, None])
    remove_sorted[:, 0] = False
    remove = remove_sorted.scatter(1, idx, remove_sorted) & (mass[:, None] < 1.0)
    return logits.masked_fill(remove, -torch.inf)


def compute_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution each row is drawn from; greedy rows are one-hot at their argmax."""
    logits = apply_penalties(logits.float(), meta)
    probs = _filter(logits, meta).softmax(-1)
    greedy = meta.temperature == 0
    if greedy.any():
        onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def _exponential(shape: tuple[int, int], generators: list[torch.Generator | None],
                 device) -> torch.Tensor:
    q = torch.empty(shape, device=device)
    q.exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            q[i].exponential_(generator=g)
    return q


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        raw = logits.float()
        processed = apply_penalties(raw, meta)
        if meta.all_greedy:
            tokens = processed.argmax(-1)
        else:
            probs = _filter(processed, meta).softmax(-1)
            sampled_rows = (meta.temperature > 0).nonzero().squeeze(1).tolist()
            gens = [meta.generators[i] for i in sampled_rows]
            q = _exponential((len(sampled_rows), probs.shape[1]), gens, probs.device)
            tokens = processed.argmax(-1)
            tokens[sampled_rows] = (probs[sampled_rows] / q).argmax(-1)
        logprobs = top_ids = top_lps = None
        if meta.need_logprobs:
            logp = torch.log_softmax(raw, -1)
            logprobs = logp.gather(1, tokens[:, None]).squeeze(1).cpu()
            if meta.max_top_logprobs:
                top_lps, top_ids = logp.topk(meta.max_top_logprobs, dim=-1)
                top_lps, top_ids = top_lps.cpu(), top_ids.cpu()
        return SamplerOutput(tokens.cpu(), logprobs, top_ids, top_lps)
