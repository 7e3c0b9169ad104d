"""Sampler: HF-equal penalties and warpers, exact inverse-CDF sampling from counter-based
uniforms, seeded reproducibility, logprobs."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

import engine.sampler as sampler_mod
from engine.counter_rng import random_key, stream_key, uniforms
from engine.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    compute_probs,
    sample_from_probs,
)
from engine.sampling_params import SamplingParams

V = 64
CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA"))]


def meta_for(params: list[SamplingParams], *, prompts=None, outputs=None, keys=None,
             banned=None, device="cpu") -> SamplingMetadata:
    """Rows without a key get a fresh random stream each (from torch's global RNG)."""
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        keys if keys is not None else [random_key() for _ in range(n)],
        banned if banned is not None else [[] for _ in range(n)],
        device,
    )


def rand_logits(rows: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def inverse_cdf_reference(probs: torch.Tensor, u: float) -> int:
    """The token whose interval [cdf before it, cdf at it) of the row holds ``u``, by a
    plain loop in exact-ish float64."""
    cum = 0.0
    for i, p in enumerate(probs.double().tolist()):
        if p > 0 and cum <= u < cum + p:
            return i
        cum += p
    return max(i for i, p in enumerate(probs.tolist()) if p > 0)


def hf_warpers(p: SamplingParams) -> LogitsProcessorList:
    """HF's warper chain for ``p``, built the way ``generate`` builds it."""
    chain = LogitsProcessorList()
    if p.temperature != 1.0:
        chain.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k:
        chain.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        chain.append(TopPLogitsWarper(p.top_p))
    if p.min_p:
        chain.append(MinPLogitsWarper(p.min_p))
    if p.typical_p < 1.0:
        chain.append(TypicalLogitsWarper(p.typical_p))
    return chain


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return float(((counts.double()[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# Chi-square critical values at p = 0.001 for the degrees of freedom used below.
CHI2_CRIT_001 = {7: 24.32, 6: 22.46, 4: 18.47}


# ------------------------------------------------------------------------------ metadata


def test_build_derives_flags_and_host_facts():
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=5, logprobs=True),
              SamplingParams(temperature=1.0, presence_penalty=0.5, top_logprobs=3)]
    meta = meta_for(params)
    assert meta.temperature.tolist() == pytest.approx([0.0, 0.8, 1.0])
    assert meta.top_k.dtype == torch.int64
    assert (meta.max_top_logprobs, meta.need_logprobs) == (3, True)
    assert (meta.all_greedy, meta.no_penalties, meta.no_top_filters) == (False, False, False)
    assert meta.sampled_rows == [1, 2]
    plain = meta_for([SamplingParams()] * 2)
    assert (plain.all_greedy, plain.no_penalties, plain.no_top_filters) == (True, True, True)
    assert (plain.need_logprobs, plain.max_top_logprobs, plain.sampled_rows) == (False, 0, [])


def test_host_facts_are_read_back_from_the_tensors():
    params = [SamplingParams(temperature=0.5, repetition_penalty=1.2, top_k=7), SamplingParams(),
              SamplingParams(temperature=1.0, typical_p=0.5, top_p=0.9, min_p=0.1, top_k=3)]
    meta = meta_for(params)
    assert meta.sampled_rows == [0, 2] and meta.max_top_k == 7
    assert meta.any_top_p and meta.any_min_p and meta.any_typical_p
    assert meta.any_repetition_penalty
    plain = dataclasses.replace(meta, temperature=torch.zeros(3), top_k=torch.zeros(3).long(),
                                top_p=torch.ones(3), min_p=torch.zeros(3),
                                typical_p=torch.ones(3), repetition_penalty=torch.ones(3))
    assert plain.sampled_rows == [] and plain.max_top_k == 0
    assert not (plain.any_top_p or plain.any_min_p or plain.any_typical_p
                or plain.any_repetition_penalty)


# -------------------------------------------------------------------------------- greedy


def test_greedy_rows_pick_the_argmax_and_leave_the_callers_logits_alone():
    logits = rand_logits(6)
    before = logits.clone()
    out = Sampler()(logits, meta_for([SamplingParams()] * 6))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64 and out.token_ids.device.type == "cpu"
    assert out.logprobs is None and out.top_token_ids is None and out.top_logprobs is None
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-6])
def test_vanishing_temperatures_are_greedy(temperature):
    """Dividing by a denormal temperature overflows; such rows must pick the argmax."""
    params = SamplingParams(temperature=temperature, seed=1)
    assert params.temperature == 0.0
    logits = rand_logits(4)
    out = Sampler()(logits, meta_for([params] * 4))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_all_greedy_without_penalties_is_a_single_argmax(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the all-greedy fast path must not warp or sample")

    monkeypatch.setattr(sampler_mod, "_warp", boom)
    monkeypatch.setattr(sampler_mod, "sample_from_probs", boom)
    logits = rand_logits(4)
    out = Sampler()(logits, meta_for([SamplingParams()] * 4))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_sampling_draws_nothing_from_the_global_rng_and_greedy_rows_no_uniform(monkeypatch):
    params = [SamplingParams(seed=7), SamplingParams(temperature=1.0, seed=8),
              SamplingParams(temperature=0.5, top_p=0.9)]
    meta = meta_for(params, keys=[stream_key(7), stream_key(8), 123])
    drawn: list[list[int]] = []

    def recording(keys, positions, purpose=0):
        drawn.append(list(keys))
        return uniforms(keys, positions, purpose)

    monkeypatch.setattr(sampler_mod, "uniforms", recording)
    global_state = torch.get_rng_state()
    Sampler()(rand_logits(3), meta)
    assert torch.equal(torch.get_rng_state(), global_state)
    assert drawn == [[stream_key(8), 123]]  # the greedy row drew nothing


# ----------------------------------------------------------------------------- penalties


def test_repetition_penalty_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -4.0]])
    meta = meta_for([SamplingParams(repetition_penalty=2.0)], prompts=[[0, 4]], outputs=[[1, 1]])
    # seen ids 0, 1, 4: positive logits divided, negative ones multiplied; 2 and 3 unseen
    expected = torch.tensor([[1.0, -2.0, 0.5, 3.0, -8.0]])
    assert torch.equal(apply_penalties(logits, meta), expected)


def test_presence_and_frequency_penalties_hand_computed_on_output_only():
    logits = torch.zeros(1, 6)
    meta = meta_for([SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)],
                    prompts=[[0, 0, 1]], outputs=[[3, 3, 5]])
    # id 3: 0.5 + 2 * 0.25; id 5: 0.5 + 0.25; prompt ids 0, 1 untouched
    expected = torch.tensor([[0.0, 0.0, 0.0, -1.0, 0.0, -0.75]])
    assert torch.allclose(apply_penalties(logits, meta), expected)


def test_penalties_apply_per_row_in_hf_order():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.0]] * 3)
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0),
              SamplingParams(),
              SamplingParams(presence_penalty=-1.0)]
    meta = meta_for(params, prompts=[[0], [0], [0]], outputs=[[2], [2], [2]],
                    banned=[[], [1], []])
    expected = torch.tensor([
        [1.0, 1.0, -3.0, 0.0],  # repetition first (2 -> 1, -1 -> -2), then frequency on id 2
        [2.0, -torch.inf, -1.0, 0.0],  # banned only
        [2.0, 1.0, 0.0, 0.0],  # negative presence penalty raises output ids
    ])
    assert torch.equal(apply_penalties(logits, meta), expected)


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_matches_hf_processor(penalty):
    logits = rand_logits(3, seed=1)
    ids = torch.randint(0, V, (3, 12), generator=seeded(2))
    meta = meta_for([SamplingParams(repetition_penalty=penalty)] * 3,
                    prompts=[r[:7].tolist() for r in ids], outputs=[r[7:].tolist() for r in ids])
    expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    assert torch.equal(apply_penalties(logits, meta), expected)


def test_greedy_decoding_with_repetition_penalty_follows_hf_step_by_step():
    table = rand_logits(V, seed=3)  # a toy LM: next-token logits depend on the last token
    prompt = [5, 9, 5]
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5)])
    hf_ids = torch.tensor([prompt])
    for _ in range(20):
        scores = processors(hf_ids, table[hf_ids[:, -1]].clone())
        hf_ids = torch.cat([hf_ids, scores.argmax(-1, keepdim=True)], dim=1)
    ours: list[int] = []
    params = [SamplingParams(repetition_penalty=1.5)]
    for _ in range(20):
        logits = table[(prompt + ours)[-1]][None]
        meta = meta_for(params, prompts=[prompt], outputs=[ours])
        ours += Sampler()(logits, meta).token_ids.tolist()
    assert ours == hf_ids[0, len(prompt):].tolist()


def test_banned_ids_are_never_sampled():
    logits = torch.zeros(64, 8)
    logits[:, 3] = 10.0  # the banned id would win almost always
    params = [SamplingParams()] + [SamplingParams(temperature=1.5)] * 63
    meta = meta_for(params, banned=[[3, 5]] * 64)
    torch.manual_seed(0)
    for _ in range(20):
        tokens = Sampler()(logits, meta).token_ids
        assert not torch.isin(tokens, torch.tensor([3, 5])).any()


def test_all_greedy_rows_with_bans_pick_the_best_allowed_id_without_copying_the_logits(
        monkeypatch):
    """Greedy + bans only (min_new_tokens): the argmax over the allowed ids, ties to the
    first id as torch's argmax, and the caller's logits untouched."""
    def boom(*args, **kwargs):
        raise AssertionError("greedy rows with bans only need no penalty pass")

    monkeypatch.setattr(sampler_mod, "apply_penalties", boom)
    logits = rand_logits(5, seed=3)
    logits[0, 7] = logits[0, 9] = 50.0  # tie: the first id wins
    logits[1, 2] = 60.0  # banned winner: the best allowed id instead
    logits[1, 4] = logits[1, 6] = 40.0  # ... which ties: the first of them
    logits[3, 11] = 70.0  # another row's banned id is allowed here
    before = logits.clone()
    banned = [[], [2], [0, 1], [], [11]]
    out = Sampler()(logits, meta_for([SamplingParams()] * 5, banned=banned))
    masked = logits.clone()
    for i, ids in enumerate(banned):
        masked[i, ids] = float("-inf")
    assert out.token_ids.tolist() == masked.argmax(-1).tolist()
    assert out.token_ids.tolist()[:2] == [7, 4] and out.token_ids[3] == 11
    assert torch.equal(logits, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_greedy_rows_pick_the_samplers_greedy_id_with_bans_ties_and_nan(dtype):
    """The engine's greedy fast path (numpy alone for CPU float32 logits, the llama.cpp
    runner's; torch otherwise) picks what the sampler's greedy pick would on each row it
    is asked for: min_new_tokens bans EOS, ties go to the first id, NaN wins; the
    caller's logits are left alone."""
    from types import SimpleNamespace

    from engine.sampling_rows import greedy_rows
    from engine.step_layout import RowView

    def view(outputs: int, min_new: int) -> RowView:
        seq = SimpleNamespace(request=SimpleNamespace(params=SamplingParams()),
                              output=SimpleNamespace(min_new_tokens=min_new), processors=[])
        return RowView(seq, [0] * outputs)  # type: ignore[arg-type]

    logits = rand_logits(5, seed=4)
    logits[0, 7] = logits[0, 9] = 50.0  # tie: the first id
    logits[1, 2] = 60.0  # EOS (2) wins, but min_new_tokens is unmet: banned
    logits[1, 4] = logits[1, 6] = 40.0  # ... then the first of these
    logits[2, 30] = float("nan")
    logits[4, 2] = 60.0  # EOS allowed here: min_new_tokens met
    logits = logits.to(dtype)
    before = logits.clone()
    views = [view(3, 0), view(0, 2), view(3, 0), view(3, 0), view(2, 2)]
    masked = logits.float().clone()
    masked[1, 2] = float("-inf")
    for rows in ([0, 1, 2, 3, 4], [1, 2, 4]):  # every row in order, and a subset
        assert greedy_rows(rows, views, logits, {2}) == masked[rows].argmax(-1).tolist()
    assert greedy_rows([0, 1], views, logits, {2})[:2] == [7, 4]
    assert torch.equal(logits.isnan(), before.isnan())
    assert torch.equal(logits.nan_to_num(), before.nan_to_num())


def test_row_argmax_is_torchs_argmax_including_ties_and_nan():
    from engine.sampler import row_argmax

    x = rand_logits(8, vocab=1000, seed=5)
    x[1, 10] = x[1, 20] = 99.0
    x[2, 30] = float("nan")
    x[3] = float("-inf")
    assert row_argmax(x).tolist() == x.argmax(-1).tolist()
    assert row_argmax(x[:, ::2]).tolist() == x[:, ::2].argmax(-1).tolist()  # strided view
    assert row_argmax(x.double()).tolist() == x.argmax(-1).tolist()


# ------------------------------------------------------------------------------ warpers

WARPED = [
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.0, top_k=V + 10),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=1.0, typical_p=0.7),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, typical_p=0.9),
    SamplingParams(temperature=1.3, top_p=0.5),
    SamplingParams(temperature=0.5),
]


@pytest.mark.parametrize("device", DEVICES)
def test_compute_probs_matches_hf_warpers_row_by_row(device):
    logits = rand_logits(len(WARPED), seed=4)
    probs = compute_probs(logits.to(device), meta_for(WARPED, device=device)).cpu()
    for row, p in enumerate(WARPED):
        expected = hf_warpers(p)(None, logits[row:row + 1].clone()).softmax(-1)[0]
        assert torch.equal(probs[row] > 0, expected > 0), f"support differs for {p}"
        assert torch.allclose(probs[row], expected, atol=1e-6), f"probs differ for {p}"


def test_compute_probs_rows_sum_to_one_and_greedy_rows_are_one_hot():
    params = [SamplingParams(), *WARPED, SamplingParams(repetition_penalty=1.5)]
    logits = rand_logits(len(params), seed=5)
    meta = meta_for(params, outputs=[[int(logits[i].argmax())] for i in range(len(params))])
    probs = compute_probs(logits, meta)
    assert torch.allclose(probs.sum(-1), torch.ones(len(params)))
    for row in (0, len(params) - 1):
        penalised = apply_penalties(logits, meta)[row]
        assert torch.equal(probs[row], torch.nn.functional.one_hot(penalised.argmax(), V).float())
    assert compute_probs(logits[:1], meta_for(params[:1])).sum() == 1


@pytest.mark.parametrize(("params", "support"), [
    (SamplingParams(temperature=0.5, top_p=0.5), [0]),  # top-p sees the tempered distribution
    (SamplingParams(temperature=1.0, top_k=2, top_p=0.5), [0]),  # ... renormalised by top-k
    (SamplingParams(temperature=1.0, top_p=0.5, min_p=0.6), [0, 1]),  # ... before min-p
])
def test_filters_compose_in_hf_order(params, support):
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    probs = compute_probs(logits, meta_for([params]))[0]
    assert probs.nonzero().flatten().tolist() == support
    assert torch.equal(hf_warpers(params)(None, logits.clone()) > -torch.inf, probs[None] > 0)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_p=0.75),
                                    SamplingParams(temperature=1.0, min_p=0.5)])
def test_top_p_and_min_p_boundaries_match_hf(params):
    # exact dyadic probabilities: the mass before the third token is exactly 0.75 (removed),
    # and the second token's probability is exactly min_p times the first's (kept)
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    probs = compute_probs(logits, meta_for([params]))[0]
    assert probs.tolist() == pytest.approx([2 / 3, 1 / 3, 0.0, 0.0])
    assert torch.equal(hf_warpers(params)(None, logits.clone()) > -torch.inf, probs[None] > 0)


def test_top_k_keeps_ties_with_the_kth_logit_like_hf():
    logits = torch.randint(-3, 4, (4, V), generator=seeded(11)).float()  # many ties
    for k in (1, 3, 10):
        meta = meta_for([SamplingParams(temperature=1.0, top_k=k)] * 4)
        expected = TopKLogitsWarper(k)(None, logits.clone()).softmax(-1)
        assert torch.equal(compute_probs(logits, meta) > 0, expected > 0)


@pytest.mark.parametrize("candidates", [4, 16, 1024])
def test_top_p_matches_hf_whether_or_not_the_candidates_hold_enough_mass(
        monkeypatch, candidates):
    monkeypatch.setattr(sampler_mod, "_TOP_P_CANDIDATES", candidates)
    peaked, flat = rand_logits(3, seed=12, scale=4.0), rand_logits(3, seed=13, scale=0.3)
    logits = torch.cat([peaked, flat])
    params = [SamplingParams(temperature=1.0, top_p=p) for p in (0.5, 0.9, 1.0) * 2]
    probs = compute_probs(logits, meta_for(params))
    for row, p in enumerate(params):
        expected = hf_warpers(p)(None, logits[row:row + 1].clone()).softmax(-1)[0]
        assert torch.equal(probs[row] > 0, expected > 0), f"row {row}"
        assert torch.allclose(probs[row], expected, atol=1e-6)


def test_top_k_one_equals_greedy():
    logits = rand_logits(16, seed=6, scale=0.1)  # nearly flat: only top-k can make it greedy
    meta = meta_for([SamplingParams(temperature=2.0, top_k=1)] * 16)
    torch.manual_seed(0)
    for _ in range(10):
        assert torch.equal(Sampler()(logits, meta).token_ids, logits.argmax(-1))


def test_tiny_top_p_keeps_only_the_top_token():
    logits = rand_logits(16, seed=7, scale=0.1)
    meta = meta_for([SamplingParams(temperature=2.0, top_p=1e-6)] * 16)
    probs = compute_probs(logits, meta)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), V).float())
    torch.manual_seed(0)
    assert torch.equal(Sampler()(logits, meta).token_ids, logits.argmax(-1))


# ----------------------------------------------------------------------------- sampling


def test_unseeded_samples_follow_softmax_at_temperature_one():
    torch.manual_seed(1234)
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.5])
    n = 20_000
    out = Sampler()(row.expand(n, -1), meta_for([SamplingParams(temperature=1.0)] * n))
    counts = torch.bincount(out.token_ids, minlength=8)
    assert chi_square(counts, row.softmax(-1)) < CHI2_CRIT_001[7]


def test_seeded_and_warped_samples_follow_compute_probs():
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.5])
    n = 5_000
    params = [SamplingParams(temperature=0.7, top_k=5, seed=i) for i in range(n)]
    meta = meta_for(params, keys=[stream_key(i) for i in range(n)])
    logits = row.expand(n, -1)
    counts = torch.bincount(Sampler()(logits, meta).token_ids, minlength=8)
    assert chi_square(counts, compute_probs(logits[:1], meta_for(params[:1]))[0]) \
        < CHI2_CRIT_001[4]


def test_sample_from_probs_never_picks_zero_probability_tokens():
    probs = torch.zeros(260, V)
    probs[:, 10] = 0.25
    probs[:, 20] = 0.75
    edges = [0.0, 0.25, 1 - 2.0 ** -53, 0.25 - 2.0 ** -53]  # the ends and the boundary
    u = torch.cat([torch.tensor(edges, dtype=torch.float64), uniforms(range(256), [0] * 256)])
    tokens = sample_from_probs(probs, u).tolist()
    assert set(tokens) == {10, 20}
    assert tokens[:4] == [10, 20, 20, 10]


def test_sample_from_probs_is_the_inverse_cdf_at_u():
    """Token i exactly when u falls in [cdf before i, cdf at i): probabilities that are
    dyadic (exact in float), u on a fine grid and on every boundary."""
    probs = torch.tensor([0.125, 0.0, 0.25, 0.0625, 0.0, 0.5, 0.0625, 0.0])
    cdf = probs.double().cumsum(0).tolist()
    grid = [i / 512 for i in range(512)] + cdf[:-2] + [c - 2.0 ** -40 for c in cdf[:-2]]
    got = sample_from_probs(probs.expand(len(grid), -1),
                            torch.tensor(grid, dtype=torch.float64)).tolist()
    assert got == [inverse_cdf_reference(probs, u) for u in grid]


def test_sample_from_probs_scales_u_by_a_row_total_off_one():
    """Rounding leaves rows summing to a little more or less than 1: u is a fraction of the
    row's own total, so the largest u still lands on the last possible token (not on the
    zero-probability one after it) and a row of NaNs stays in range."""
    probs = torch.tensor([[0.5, 0.5 - 1e-6, 0.0], [0.5, 0.5 + 1e-6, 0.0],
                          [float("nan")] * 3])
    top = torch.tensor([1 - 2.0 ** -53] * 3, dtype=torch.float64)
    got = sample_from_probs(probs, top).tolist()
    assert got[:2] == [1, 1] and 0 <= got[2] < 3


@pytest.mark.parametrize("device", DEVICES)
def test_inverse_cdf_samples_follow_probs_over_many_seeds(device):
    """Chi-square of 20k draws (fixed seeds 0..19999, position 0) against a distribution with
    tiny, zero and large probabilities; and position 1 of the same streams is as good."""
    probs = torch.tensor([0.3, 0.0, 0.05, 0.2, 0.01, 0.14, 0.25, 0.05])
    n = 20_000
    keys = [stream_key(s) for s in range(n)]
    for position in (0, 1):
        u = uniforms(keys, [position] * n)
        tokens = sample_from_probs(probs.to(device).expand(n, -1), u).cpu()
        counts = torch.bincount(tokens, minlength=len(probs))
        assert chi_square(counts, probs) < CHI2_CRIT_001[6]


def _seeded_run(position: int, batch: int, device: str, steps: int = 6) -> list[int]:
    """Tokens of one seeded, penalised, top-p row at ``position`` among random batch mates."""
    mine = SamplingParams(temperature=0.9, top_p=0.95, frequency_penalty=0.3, seed=42)
    mates = [SamplingParams(), SamplingParams(temperature=1.2),
             SamplingParams(temperature=0.8, top_k=7, seed=1),
             SamplingParams(temperature=1.0, repetition_penalty=1.3)]
    tokens: list[int] = []
    torch.manual_seed(position * 100 + batch)  # the global RNG differs between runs
    for step in range(steps):
        params = [mates[(i + step) % len(mates)] for i in range(batch)]
        keys = [stream_key(99) if p.seed is not None else random_key() for p in params]
        logits = rand_logits(batch, seed=1000 + step * 10 + batch)  # batch mates vary
        params[position], keys[position] = mine, stream_key(42)
        logits[position] = rand_logits(1, seed=step)[0]  # my row's logits don't
        outputs = [[7] * ((i + step) % 3) for i in range(batch)]  # mates at other positions
        outputs[position] = tokens
        meta = meta_for(params, outputs=outputs, keys=keys, device=device)
        out = Sampler()(logits.to(device), meta)
        tokens = tokens + [int(out.token_ids[position])]
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_is_independent_of_batch_mates_and_position(device):
    alone = _seeded_run(position=0, batch=1, device=device)
    assert _seeded_run(position=5, batch=8, device=device) == alone
    assert _seeded_run(position=2, batch=8, device=device) == alone
    assert len(set(alone)) > 1  # it really sampled


def test_a_rows_draw_depends_on_its_key_and_output_position_only():
    """The same key and output length draw the same uniform whatever else is in the batch:
    a row sampled alone equals the row sampled among others at another index."""
    params = SamplingParams(temperature=1.0)
    logits = rand_logits(1, seed=21, scale=0.5)  # flat: nearly every uniform moves the token
    out = [[3, 4, 5]]
    alone = [Sampler()(logits, meta_for([params], outputs=out, keys=[k])).token_ids[0]
             for k in range(40)]
    crowd = [Sampler()(torch.cat([rand_logits(2, seed=k), logits]),
                       meta_for([params] * 3, outputs=[[], [1]] + out, keys=[7, 8, k])
                       ).token_ids[2] for k in range(40)]
    assert alone == crowd
    assert len(set(int(t) for t in alone)) > 5  # the key really moves the draw


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_and_top_logprobs_come_from_the_raw_distribution():
    params = [SamplingParams(logprobs=True),
              SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.7, top_logprobs=4),
              SamplingParams(temperature=1.0, presence_penalty=2.0, top_logprobs=2)]
    logits = rand_logits(3, seed=8)
    meta = meta_for(params, outputs=[[1, 2], [3, 4], [5, 6]])
    torch.manual_seed(0)
    out = Sampler()(logits, meta)
    raw = logits.log_softmax(-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    assert out.top_token_ids is not None
    assert out.logprobs.dtype == torch.float32 and out.top_token_ids.dtype == torch.int64
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None])[:, 0])
    assert out.top_token_ids.shape == out.top_logprobs.shape == (3, 4)
    top = raw.topk(4, dim=-1)
    assert torch.equal(out.top_token_ids, top.indices)
    assert torch.allclose(out.top_logprobs, top.values)


def test_logprobs_without_top_logprobs_and_half_precision_logits():
    logits = rand_logits(2, seed=9).to(torch.bfloat16)
    out = Sampler()(logits, meta_for([SamplingParams(logprobs=True), SamplingParams()]))
    assert out.top_token_ids is None and out.top_logprobs is None
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    raw = logits.float().log_softmax(-1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None])[:, 0])


# ---------------------------------------------------------------------------- mixed batch


def test_mixed_batch_of_greedy_sampled_and_penalised_rows():
    params = [SamplingParams(),
              SamplingParams(temperature=1.0, top_k=1, seed=5),
              SamplingParams(repetition_penalty=3.0),
              SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, typical_p=0.95),
              SamplingParams(frequency_penalty=2.0, presence_penalty=2.0),
              SamplingParams(temperature=1.0, logprobs=True)]
    logits = rand_logits(len(params), seed=10)
    top = logits.argmax(-1).tolist()
    outputs = [[], [], [top[2]], [], [top[4]], []]
    banned = [[], [], [], [], [], [top[5]]]
    meta = meta_for(params, outputs=outputs, banned=banned)
    before = logits.clone()
    torch.manual_seed(0)
    out = Sampler()(logits, meta)
    assert torch.equal(logits, before)
    tokens = out.token_ids.tolist()
    assert tokens[:2] == top[:2]  # greedy; top_k=1
    penalised = apply_penalties(logits, meta)
    assert tokens[2] == penalised[2].argmax() != top[2]  # penalties moved both argmaxes
    assert tokens[4] == penalised[4].argmax() != top[4]
    assert compute_probs(logits, meta)[3, tokens[3]] > 0
    assert tokens[5] != top[5]
    assert out.logprobs is not None and out.logprobs.shape == (len(params),)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_sampling_waits_for_the_device_once():
    params = [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.9, seed=1, logprobs=True),
              SamplingParams(temperature=1.0, top_k=5, repetition_penalty=1.2, top_logprobs=3)]
    logits = rand_logits(3).cuda()
    meta = meta_for(params, prompts=[[1, 2]] * 3, outputs=[[3]] * 3, banned=[[4]] * 3,
                    keys=[1, stream_key(1), 2], device="cuda")
    Sampler()(logits, meta)  # warm up lazy initialisation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Sampler()(logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len([w for w in caught if "synchroniz" in str(w.message)]) == 1


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_batch_matches_seeded_reproducibility_and_returns_cpu_tensors():
    params = [SamplingParams(temperature=0.9, top_k=10, seed=11, top_logprobs=2),
              SamplingParams(), SamplingParams(temperature=1.0, repetition_penalty=1.2)]
    logits = rand_logits(3, seed=12).cuda().half()

    def run(rows: list[int]) -> torch.Tensor:
        keys = [stream_key(11) if i == 0 else random_key() for i in rows]
        meta = meta_for([params[i] for i in rows], keys=keys, outputs=[[1]] * len(rows),
                        device="cuda")
        out = Sampler()(logits[rows], meta)
        assert out.token_ids.device.type == "cpu" and out.top_logprobs is not None
        assert out.top_logprobs.device.type == "cpu"
        return out.token_ids

    assert run([0])[0] == run([2, 1, 0])[2]
    assert run([1, 0])[0] == logits[1].argmax().item()
    cpu = meta_for(params[:1], keys=[stream_key(11)], outputs=[[1]])
    assert Sampler()(logits[:1].cpu(), cpu).token_ids[0] == run([0])[0]  # the same on the CPU


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_repetition_penalty_that_overflows_a_logit_samples_that_token(top_p):
    """repetition_penalty=1e-38 (valid: > 0) divides a seen positive logit past float32's
    range: +inf, a NaN distribution, and top-p's threshold then indexed -1 and crashed the
    engine loop. The overflowed token is the certain choice, greedy and sampled alike."""
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.5], [5.0, 1.0, 4.0, 0.5]])
    params = [SamplingParams(temperature=1.0, top_p=top_p, repetition_penalty=1e-38, seed=1),
              SamplingParams(repetition_penalty=1e-38)]
    meta = meta_for(params, prompts=[[2], [2]])
    assert Sampler()(logits, meta).token_ids.tolist() == [2, 2]
    probs = compute_probs(logits, meta)
    assert torch.equal(probs, torch.tensor([[0.0, 0.0, 1.0, 0.0]] * 2))
