"""Vectorised sampling over a batch whose rows each carry their own parameters.

Order, as HF's logits processors apply them (so greedy + penalties match ``generate``):
banned ids -> repetition penalty -> presence/frequency penalties -> (greedy: argmax) ->
temperature -> top-k -> top-p -> min-p -> typical-p -> sample.

Sampling is by inverse CDF: the token whose interval of the cumulative distribution holds
one uniform, and that uniform is a pure function of the row's stream key and the token's
output position (``engine.counter_rng``). So a seeded request samples the same tokens
whatever its batch mates, its row, a preemption, or speculation (which verifies a proposal
by the same draw: accepted exactly when the plain sample is that token). Greedy rows draw
nothing. Everything stays on the logits' device except the uniforms, made on the CPU (one
small copy); only the small final outputs are copied back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from engine.counter_rng import SAMPLE, uniforms
from engine.sampling_params import SamplingParams

_NEG_INF = float("-inf")
_FLOAT_MAX = torch.finfo(torch.float32).max
# Tokens top-p sorts on the CPU before it falls back to sorting the whole vocabulary.
_TOP_P_CANDIDATES = 1024


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of one batch, as tensors on the logits' device."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy row
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    min_p: torch.Tensor  # [B] float32, 0 = off
    typical_p: torch.Tensor  # [B] float32, 1 = off
    repetition_penalty: torch.Tensor  # [B], 1 = off
    presence_penalty: torch.Tensor  # [B], 0 = off
    frequency_penalty: torch.Tensor  # [B], 0 = off
    keys: list[int]  # per row: its sequence's random stream (engine.counter_rng)
    prompt_token_ids: list[list[int]]  # repetition penalty counts prompt + output (HF)
    output_token_ids: list[list[int]]  # presence/frequency count output only (vLLM/OpenAI)
    banned_token_ids: list[list[int]]  # -inf before anything else (min_new_tokens)
    max_top_logprobs: int
    need_logprobs: bool
    all_greedy: bool
    no_penalties: bool
    no_top_filters: bool
    # Host-side facts for choosing fast paths, read back once from the tensors above so the
    # sampler needs no further device syncs.
    sampled_rows: list[int] = field(init=False)  # rows with temperature > 0
    max_top_k: int = field(init=False)  # 0 = no row uses top-k
    any_top_p: bool = field(init=False)
    any_min_p: bool = field(init=False)
    any_typical_p: bool = field(init=False)
    any_repetition_penalty: bool = field(init=False)

    def __post_init__(self) -> None:
        columns = (self.temperature, self.top_k, self.top_p, self.min_p, self.typical_p,
                   self.repetition_penalty)
        temp, top_k, top_p, min_p, typical_p, rep = (
            torch.stack([c.float() for c in columns]).cpu().tolist() if len(self.temperature)
            else [[]] * len(columns))
        self.sampled_rows = [i for i, t in enumerate(temp) if t > 0]
        self.max_top_k = int(max(top_k, default=0))
        self.any_top_p = any(p < 1 for p in top_p)
        self.any_min_p = any(p > 0 for p in min_p)
        self.any_typical_p = any(p < 1 for p in typical_p)
        self.any_repetition_penalty = any(r != 1 for r in rep)

    def uniforms(self, rows: list[int] | None = None, purpose: int = SAMPLE) -> torch.Tensor:
        """``[len(rows)]`` float64 uniforms on the CPU, one per row (all rows if None) at
        its own output position: the length of the output before the row's token."""
        rows = list(range(len(self.keys))) if rows is None else rows
        return uniforms([self.keys[i] for i in rows],
                        [len(self.output_token_ids[i]) for i in rows], purpose)

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], keys: list[int],
              banned_token_ids: list[list[int]], device: torch.device | str
              ) -> SamplingMetadata:
        # The columns are made on the CPU, where __post_init__ reads them for free, then
        # moved to the device in one copy. Host-to-device copies here are non-blocking (from
        # pageable memory CUDA stages them at once), so only the outputs wait for the GPU.
        table = torch.tensor([[float(getattr(p, c)) for p in params] for c in _COLUMNS])
        table = table.view(len(_COLUMNS), len(params))
        meta = cls(
            **_columns(table),
            keys=keys, prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids, banned_token_ids=banned_token_ids,
            max_top_logprobs=max((p.top_logprobs for p in params), default=0),
            need_logprobs=any(p.logprobs or p.top_logprobs > 0 for p in params),
            all_greedy=all(p.greedy for p in params),
            no_penalties=not any(p.penalized for p in params),
            no_top_filters=all(p.top_k == 0 and p.top_p == 1 and p.min_p == 0
                               and p.typical_p == 1 for p in params),
        )
        for name, column in _columns(table.to(device, non_blocking=True)).items():
            setattr(meta, name, column)
        return meta


# The per-row parameter columns of SamplingMetadata, in field order.
_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty",
            "presence_penalty", "frequency_penalty")


def _columns(table: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rows of a float ``[len(_COLUMNS), B]`` table by field name, top_k as int64."""
    columns = dict(zip(_COLUMNS, table, strict=True))
    columns["top_k"] = columns["top_k"].long()
    return columns


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64, CPU
    logprobs: torch.Tensor | None  # [B] float32, CPU: chosen token under the raw logits
    top_token_ids: torch.Tensor | None  # [B, max_top_logprobs] int64, CPU (raw distribution)
    top_logprobs: torch.Tensor | None  # [B, max_top_logprobs] float32, CPU


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (first maximum; NaN wins, as in torch). On the CPU through numpy:
    torch's CPU argmax measured 13x slower here (1.3 ms for 32 rows of a 49k vocabulary,
    1% of a llama.cpp decode step of 32 sequences)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2:
        return torch.from_numpy(np.argmax(x.detach().numpy(), axis=-1))
    return x.argmax(-1)


def greedy_with_bans(logits: torch.Tensor, banned: list[list[int]]) -> torch.Tensor:
    """The argmax of each row over its non-banned ids, without copying the logits: a row
    whose overall argmax is not banned has the same first maximum either way, and the rows
    whose argmax is banned (rare: EOS before min_new_tokens) are redone on a masked copy."""
    tokens = row_argmax(logits)
    picked = tokens.tolist()
    for i, ids in enumerate(banned):
        if ids and picked[i] in ids:
            row = logits[i].clone()
            row[ids] = _NEG_INF
            tokens[i] = row_argmax(row[None])[0]
    return tokens


# ---------------------------------------------------------------------------- penalties


def _flat_index(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Indices into a flattened ``[B, V]`` tensor of every id of every row (no padding)."""
    ids = torch.tensor(list(chain.from_iterable(rows)), dtype=torch.long)
    row = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(r) for r in rows]))
    return (row * vocab + ids).to(device, non_blocking=True)


def _token_counts(rows: list[list[int]], like: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` float32 occurrence counts of each row's ids, by one scatter_add."""
    counts = torch.zeros(like.shape, device=like.device)
    index = _flat_index(rows, like.shape[1], like.device)
    counts.view(-1).scatter_add_(0, index, torch.ones_like(index, dtype=counts.dtype))
    return counts


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Banned ids (-inf), then HF's repetition penalty over prompt + output, then OpenAI's
    presence/frequency penalties over the output. Returns a new tensor."""
    if any(meta.banned_token_ids):
        index = _flat_index(meta.banned_token_ids, logits.shape[1], logits.device)
        logits = logits.flatten().index_fill(0, index, _NEG_INF).view_as(logits)
    if meta.no_penalties:
        return logits
    out_counts = _token_counts(meta.output_token_ids, logits)
    if meta.any_repetition_penalty:
        seen = (_token_counts(meta.prompt_token_ids, logits) + out_counts) > 0
        rep = meta.repetition_penalty[:, None]
        logits = torch.where(seen, torch.where(logits < 0, logits * rep, logits / rep), logits)
    return (logits - meta.frequency_penalty[:, None] * out_counts
            - meta.presence_penalty[:, None] * (out_counts > 0))


# ------------------------------------------------------------------------------ warping


def _top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """HF's top-k: drop logits below the k-th largest (ties with it survive), found with one
    ``topk(max_k)`` rather than a sort of the vocabulary. Rows with k = 0 are untouched."""
    k = top_k.clamp(1, logits.shape[1])
    kth = logits.topk(min(max_k, logits.shape[1]), dim=-1).values.gather(1, k[:, None] - 1)
    kth = kth.masked_fill((top_k == 0)[:, None], _NEG_INF)
    return logits.masked_fill(logits < kth, _NEG_INF)


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """HF's top-p: keep the most likely tokens until the mass before the next one reaches p
    (the top token always). Rows with p = 1 are untouched."""
    probs = logits.softmax(-1)
    cut = (probs < _top_p_threshold(probs, top_p)) & (top_p < 1)[:, None]
    return logits.masked_fill(cut, _NEG_INF)


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` probability of the least likely token top-p keeps.

    On the CPU sorting the vocabulary is slow (~10 ms a row for 49k tokens) and the cut
    usually falls among the few most likely tokens: sort only those, and the whole row only
    where they hold less than p. Elsewhere the sort is cheap and the check would need a sync.
    """
    if probs.device.type != "cpu" or probs.shape[1] <= _TOP_P_CANDIDATES:
        return _last_kept(probs.sort(dim=-1, descending=True).values, top_p)
    top = probs.topk(_TOP_P_CANDIDATES, dim=-1).values
    threshold = _last_kept(top, top_p)
    short = ((top.sum(-1) < top_p) & (top_p < 1)).nonzero().flatten()
    if len(short):
        everything = probs[short].sort(dim=-1, descending=True).values
        threshold[short] = _last_kept(everything, top_p[short])
    return threshold


def _last_kept(top: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The last probability, in descending ``top``, with less than p of mass before it."""
    kept = ((top.cumsum(-1) - top) < top_p[:, None]).sum(-1)  # >= 1: none before the first
    return top.gather(1, kept.clamp(min=1)[:, None] - 1)  # (0 only for a row of NaNs)


def _min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """HF's min-p: drop tokens less likely than ``min_p`` times the most likely one."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), _NEG_INF)


def _typical(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """HF's TypicalLogitsWarper per row: keep the tokens whose surprise is closest to the
    entropy, the fewest reaching ``mass``; rows with mass 1 are left alone."""
    logp = logits.log_softmax(-1)
    entropy = -(logp * logp.exp()).nansum(-1, keepdim=True)
    shifted, order = (-logp - entropy).abs().sort(dim=-1)
    cum = logits.gather(1, order).softmax(-1).cumsum(-1)
    last = (cum < mass[:, None]).sum(-1).clamp(max=logits.shape[1] - 1)
    cut = shifted > shifted.gather(1, last[:, None])
    cut[:, 0] = False
    cut &= (mass < 1)[:, None]
    return logits.masked_fill(cut.scatter(1, order, cut), _NEG_INF)


def _warp(logits: torch.Tensor, meta: SamplingMetadata,
          rows: torch.Tensor | None = None) -> torch.Tensor:
    """Temperature then the top filters for ``rows`` (all rows if None) of the penalised
    logits; greedy rows among them are left at temperature 1."""

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t if rows is None else t[rows]

    temperature = pick(meta.temperature)
    logits = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    if meta.any_repetition_penalty:
        # a tiny penalty (any > 0 is valid, as in HF) can overflow a seen token's logit to
        # +inf, whose softmax is NaN: the largest float keeps it the one certain choice
        logits = logits.clamp(max=_FLOAT_MAX)
    if meta.no_top_filters:
        return logits
    if meta.max_top_k:
        logits = _top_k(logits, pick(meta.top_k), meta.max_top_k)
    if meta.any_top_p:
        logits = _top_p(logits, pick(meta.top_p))
    if meta.any_min_p:
        logits = _min_p(logits, pick(meta.min_p))
    if meta.any_typical_p:
        logits = _typical(logits, pick(meta.typical_p))
    return logits


# ----------------------------------------------------------------------------- sampling


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One exact categorical draw per row by inverse CDF: the token ``i`` with
    ``cdf[i - 1] <= u * total < cdf[i]``, so the draw depends on the row's uniform alone.

    ``u``: ``[B]`` float64 in [0, 1) (any device). The cumulative sum is in float64 and
    scaled by the row's own total, so rounding never lands on a token of probability 0 nor
    past the last possible one. Reusable by speculative decoding's verification.
    """
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    point = torch.minimum(u.to(cdf.device, non_blocking=True)[:, None] * total,
                          torch.nextafter(total, torch.zeros_like(total)))
    # A row of NaNs (a broken processor) would search past the end: clamp it in range.
    return torch.searchsorted(cdf, point, right=True)[:, 0].clamp_(max=probs.shape[1] - 1)


def compute_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The processed distribution the sampler draws from ([B, V] probs; greedy rows are
    one-hot at their argmax). Exposed because speculative decoding's rejection sampler
    needs p(x) for each row."""
    logits = apply_penalties(logits.float(), meta)
    greedy = torch.nn.functional.one_hot(row_argmax(logits), logits.shape[1]).to(logits.dtype)
    if meta.all_greedy:
        return greedy
    probs = _warp(logits, meta).softmax(-1)
    return torch.where((meta.temperature > 0)[:, None], probs, greedy)


class Sampler:
    """Picks one token per row and reports raw-distribution logprobs."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata,
                 logprobs: bool = True) -> SamplerOutput:
        """``logprobs=False``: tokens only (the engine reports logprobs itself)."""
        raw = logits.float()  # a copy unless already float32; never modified in place
        tokens = self._tokens(raw, meta)
        if not logprobs:
            return SamplerOutput(tokens.cpu(), None, None, None)
        return self._output(raw, tokens, meta)

    def _tokens(self, raw: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        rows = meta.sampled_rows
        if not rows and meta.no_penalties:  # greedy, min-new-tokens bans at most
            return greedy_with_bans(raw, meta.banned_token_ids)
        processed = apply_penalties(raw, meta)
        if not rows:
            return row_argmax(processed)
        if len(rows) == len(raw):
            return self._sample(processed, meta, rows, None)
        index = torch.tensor(rows).to(raw.device, non_blocking=True)
        sampled = self._sample(processed, meta, rows, index)
        return row_argmax(processed).index_copy(0, index, sampled)

    @staticmethod
    def _sample(processed: torch.Tensor, meta: SamplingMetadata, rows: list[int],
                index: torch.Tensor | None) -> torch.Tensor:
        """Sampled tokens for ``rows`` (``index`` on the device; None = every row)."""
        sub = processed if index is None else processed[index]
        probs = _warp(sub, meta, index).softmax(-1)
        return sample_from_probs(probs, meta.uniforms(rows))

    @staticmethod
    def _output(raw: torch.Tensor, tokens: torch.Tensor,
                meta: SamplingMetadata) -> SamplerOutput:
        """Chosen-token and top logprobs under the raw distribution, moved to the CPU."""
        if not meta.need_logprobs:
            return SamplerOutput(tokens.cpu(), None, None, None)
        k = min(meta.max_top_logprobs, raw.shape[1])
        ids, chosen, _, top_ids, top_lps = _logprob_table(raw, tokens, k)
        return SamplerOutput(ids, chosen, top_ids if k else None, top_lps if k else None)


def _logprob_table(raw: torch.Tensor, tokens: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor]:
    """Tokens, their logprobs and 1-based ranks, and the top-``k`` of each row, on the CPU
    in one copy (one sync): ids, ranks and float32 logprobs are exact in float64."""
    logp = raw.float().log_softmax(-1)
    top = logp.topk(k, dim=-1)
    tokens = tokens.to(logp.device)
    chosen = logp.gather(1, tokens[:, None])
    rank = (logp > chosen).sum(-1, keepdim=True) + 1
    parts = (tokens[:, None], chosen, rank, top.indices, top.values)
    host = torch.cat([p.double() for p in parts], dim=1).cpu()
    ids, chosen, ranks, top_ids, top_lps = host.split([1, 1, 1, k, k], dim=1)
    return (ids[:, 0].long(), chosen[:, 0].float(), ranks[:, 0].long(), top_ids.long(),
            top_lps.float())


@dataclass
class LogprobTable:
    """Per row: the chosen token's logprob and rank, and the row's top ``k`` (Python lists,
    ready to be split into ``TokenLogprob``s)."""

    chosen: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_lps: list[list[float]]


def token_logprobs(raw: torch.Tensor, tokens: torch.Tensor, k: int) -> LogprobTable:
    """Logprob and rank of ``tokens[i]`` under row ``i`` of ``raw`` and the row's top
    ``k``."""
    k = min(k, raw.shape[1])
    _, chosen, ranks, top_ids, top_lps = _logprob_table(raw, tokens, k)
    return LogprobTable(chosen.tolist(), ranks.tolist(), top_ids.tolist(), top_lps.tolist())
