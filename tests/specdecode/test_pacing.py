"""Per-sequence proposal pacing: more proposals while they are accepted, fewer after a
rejection, and a back-off once they keep missing."""

from __future__ import annotations

from types import SimpleNamespace

from specdecode.worker import MAX_BACKOFF, PROBE_EVERY, START_K, _Pace, worth_proposing


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


def test_free_verify_rows_leave_the_pace_alone():
    assert worth_proposing(8, 0.1, row_cost=0.0) == 8


def test_costly_verify_rows_are_proposed_only_where_expected_tokens_pay_for_them():
    # llama.cpp here: one more row costs ~0.6 of a step
    assert worth_proposing(8, 0.3, row_cost=0.6) == 0  # 1.3 tokens for 1.6x the step
    assert worth_proposing(8, 0.99, row_cost=0.6) == 8  # a copy run: all of them
    mid = worth_proposing(8, 0.8, row_cost=0.3)
    assert 0 < mid < 8


def test_acceptance_estimate_follows_recent_steps():
    pace = _Pace(8)
    for _ in range(4):
        pace.observe(8, 8, k_max=8)
    assert pace.alpha > 0.9
    pace.observe(8, 0, k_max=8)
    pace.observe(1, 0, k_max=8)
    assert pace.alpha < 0.3


def test_a_sequence_capped_to_no_proposals_probes_with_one_every_few_steps(tiny_model_dir):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from specdecode.config import SpeculativeConfig
    from specdecode.worker import SpecWorker

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir)))
    worker = SpecWorker(SpeculativeConfig(method="ngram", num_spec_tokens=8), engine.runner)
    worker.target = SimpleNamespace(row_cost=0.6)  # type: ignore[assignment]
    req = engine.add_request("r", [5, 6, 7], SamplingParams(max_new_tokens=64))
    seq = req.sequences[0]
    worker.budgets([seq], 1)
    pace = worker._pace[seq.seq_id]
    pace.alpha, pace.idle = 0.2, 0  # proposals have kept failing
    budgets = [worker.budgets([seq], 1)[0] for _ in range(2 * PROBE_EVERY)]
    assert budgets == ([0] * (PROBE_EVERY - 1) + [1]) * 2
