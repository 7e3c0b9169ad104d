"""The engine on a tiny random model: greedy parity with HF, batching, preemption, aborts."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import Completion, FinishReason
from engine.sampling_params import SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4,",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "Q: What is the boiling point of water?\nA:",
    "A long prompt " * 20,
]
MAX_NEW = 20


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_outputs(hf_model, prompt_ids):
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            gen = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW,
                                    do_sample=False, min_new_tokens=MAX_NEW)
            outs.append(gen[0, len(ids):].tolist())
    return outs


def make_engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **kw))


def run_to_completion(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int],
                      SamplingParams]]]) -> dict[str, list[Completion]]:
    """Add requests at the given step numbers, step until all finish."""
    results: dict[str, list[Completion]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_work:
        for rid, ids, params in arrivals.get(step, []):
            engine.add_request(rid, ids, params)
            results[rid] = [Completion(i) for i in range(params.n)]
        for out in engine.step():
            for d in out.deltas:
                results[out.request_id][d.index].add(d)
        step += 1
        assert step < 10_000
    return results


def greedy(n: int = MAX_NEW) -> SamplingParams:
    # min_new_tokens = max keeps EOS from ending a random model early, as HF does above.
    return SamplingParams(max_new_tokens=n, min_new_tokens=n)


def test_greedy_matches_hf_generate_one_request_at_a_time(tiny_model_dir, prompt_ids,
                                                          hf_outputs):
    engine = make_engine(tiny_model_dir)
    for i, ids in enumerate(prompt_ids):
        res = run_to_completion(engine, {0: [(f"r{i}", ids, greedy())]})
        assert res[f"r{i}"][0].token_ids == hf_outputs[i], f"prompt {i}"
        assert res[f"r{i}"][0].finish_reason is FinishReason.LENGTH


def test_greedy_matches_hf_when_requests_arrive_at_different_steps(tiny_model_dir, prompt_ids,
                                                                   hf_outputs):
    engine = make_engine(tiny_model_dir)
    arrivals = {3 * i: [(f"r{i}", ids, greedy())] for i, ids in enumerate(prompt_ids)}
    res = run_to_completion(engine, arrivals)
    for i in range(len(prompt_ids)):
        assert res[f"r{i}"][0].token_ids == hf_outputs[i], f"prompt {i}"


def test_chunked_prefill_with_a_small_token_budget_keeps_greedy_output(
        tiny_model_dir, prompt_ids, hf_outputs):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=7)
    res = run_to_completion(engine, {0: [(f"r{i}", ids, greedy())
                                         for i, ids in enumerate(prompt_ids)]})
    for i in range(len(prompt_ids)):
        assert res[f"r{i}"][0].token_ids == hf_outputs[i], f"prompt {i}"


def test_preemption_by_recompute_keeps_greedy_output(tiny_model_dir, prompt_ids, hf_outputs):
    # Room for ~2 sequences at a time: the scheduler must preempt and recompute.
    spec_bytes = 2 * 2 * 4 * 2 * 16 * 4  # 2 (k,v) * layers * block * kv_heads * head_dim * 4B
    engine = make_engine(tiny_model_dir, block_size=4, kv_cache_memory=spec_bytes * 40)
    res = run_to_completion(engine, {0: [(f"r{i}", ids, greedy())
                                         for i, ids in enumerate(prompt_ids)]})
    assert engine.scheduler.num_preemptions > 0
    for i in range(len(prompt_ids)):
        assert res[f"r{i}"][0].token_ids == hf_outputs[i], f"prompt {i}"
    assert engine.scheduler.allocator.num_used == 0


def test_seeded_sampling_is_reproducible_regardless_of_batch_mates(tiny_model_dir,
                                                                   prompt_ids):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_new_tokens=12, n=2)
    engine = make_engine(tiny_model_dir)
    alone = run_to_completion(engine, {0: [("a", prompt_ids[0], params)]})["a"]
    crowd = {0: [(f"x{i}", ids, SamplingParams(temperature=1.0, max_new_tokens=15))
                 for i, ids in enumerate(prompt_ids)]}
    crowd[2] = [("a", prompt_ids[0], params)]
    together = run_to_completion(engine, crowd)["a"]
    assert [c.token_ids for c in alone] == [c.token_ids for c in together]
    assert alone[0].token_ids != alone[1].token_ids  # n children differ


def test_abort_frees_kv_blocks_and_reports_aborted(tiny_model_dir, prompt_ids):
    engine = make_engine(tiny_model_dir)
    engine.add_request("a", prompt_ids[3], SamplingParams(max_new_tokens=50, n=3))
    engine.step()
    engine.step()
    assert engine.scheduler.allocator.num_used > 0
    engine.abort("a")
    assert engine.stats().num_requests == 0  # counted out at once, not at the next step
    assert engine.has_work  # its final output is still to be collected
    outs = engine.step()
    assert engine.scheduler.allocator.num_used == 0
    assert outs[0].finished
    assert {d.finish_reason for d in outs[0].deltas} == {FinishReason.ABORTED}
    assert not engine.has_work


def test_time_limit_finishes_with_time_limit(tiny_model_dir, prompt_ids):
    engine = make_engine(tiny_model_dir)
    params = SamplingParams(max_new_tokens=500, min_new_tokens=500, time_limit_s=0.05)
    res = run_to_completion(engine, {0: [("t", prompt_ids[0], params)]})
    assert res["t"][0].finish_reason is FinishReason.TIME_LIMIT
    assert len(res["t"][0].token_ids) < 500


def test_stop_sequence_and_max_tokens_are_reported(tiny_model_dir, prompt_ids, tokenizer,
                                                   hf_outputs):
    engine = make_engine(tiny_model_dir)
    text = tokenizer.decode(hf_outputs[1])
    mid = len(text) // 2
    stop = next(text[i:i + 3] for i in range(mid, len(text)) if text[i:i + 3].strip())
    res = run_to_completion(engine, {0: [("s", prompt_ids[1], SamplingParams(
        max_new_tokens=MAX_NEW, min_new_tokens=0, stop=[stop], ignore_eos=True))]})
    c = res["s"][0]
    assert c.finish_reason is FinishReason.STOP_SEQUENCE
    assert c.stop_sequence == stop
    assert c.text == text[:text.index(stop)]


def test_invalid_requests_raise_value_error(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_model_len=64, max_waiting=2, max_num_seqs=1)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("v", [10**7], SamplingParams())
    with pytest.raises(ValueError, match="context"):
        engine.add_request("l", [5] * 64, SamplingParams())
    engine.add_request("q1", [5, 6], SamplingParams())
    with pytest.raises(ValueError, match="already"):
        engine.add_request("q1", [5, 6], SamplingParams())


def test_the_queue_bound_is_not_the_synchronous_engines(tiny_model_dir):
    """max_waiting is decided once, by AsyncEngine on the event loop (where a refusal is
    quick); the step loop's engine queues what it is given."""
    engine = make_engine(tiny_model_dir, max_model_len=64, max_waiting=1, max_num_seqs=1)
    for rid in ("q1", "q2", "q3", "q4"):
        engine.add_request(rid, [5, 6], SamplingParams())
    assert engine.num_waiting_requests() == 4


def test_max_new_tokens_is_decided_at_admission_into_the_params(tiny_model_dir):
    """A request asking more than the context's room runs with min(asked, room), and its
    params say so (everything downstream reads them); one within the room is unchanged."""
    engine = make_engine(tiny_model_dir, max_model_len=64)
    asked = SamplingParams(max_new_tokens=100, min_new_tokens=80, ignore_eos=True)
    req = engine.add_request("long", [5] * 54, asked)
    assert (req.params.max_new_tokens, req.params.min_new_tokens) == (10, 10)
    assert (asked.max_new_tokens, asked.min_new_tokens) == (100, 80)  # the caller's, kept
    within = SamplingParams(max_new_tokens=4)
    assert engine.add_request("short", [5, 6], within).params is within
    done = {"long": Completion(0), "short": Completion(0)}
    while engine.has_work:
        for out in engine.step():
            for d in out.deltas:
                done[out.request_id].add(d)
    assert len(done["long"].token_ids) == 10
    assert done["long"].finish_reason is FinishReason.LENGTH
    assert 1 <= len(done["short"].token_ids) <= 4


def test_logprobs_are_reported_for_every_token(tiny_model_dir, prompt_ids):
    engine = make_engine(tiny_model_dir)
    res = run_to_completion(engine, {0: [("l", prompt_ids[0], SamplingParams(
        max_new_tokens=5, min_new_tokens=5, logprobs=True, top_logprobs=3))]})
    c = res["l"][0]
    assert len(c.logprobs) == 5
    for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
        assert lp.token_id == tok
        assert len(lp.top) == 3
        assert lp.top[0][0] == tok  # greedy picks the top raw token
        assert lp.logprob == pytest.approx(lp.top[0][1])
        assert lp.rank == 1


def test_rank_counts_the_tokens_more_likely_than_the_sampled_one(tiny_model_dir, prompt_ids):
    engine = make_engine(tiny_model_dir)
    res = run_to_completion(engine, {0: [("r", prompt_ids[1], SamplingParams(
        max_new_tokens=8, min_new_tokens=8, temperature=5.0, seed=3, logprobs=True,
        top_logprobs=20))]})
    c = res["r"][0]
    assert any(lp.rank > 1 for lp in c.logprobs)  # temperature 5 leaves the argmax often
    for lp in c.logprobs:
        above = [v for _, v in lp.top if v > lp.logprob]
        if lp.rank <= 20:
            assert lp.rank == len(above) + 1


def _hf_prompt_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)


@pytest.mark.parametrize("budget", [None, 7], ids=["whole", "chunked"])
def test_prompt_logprobs_match_a_full_forward(tiny_model_dir, hf_model, prompt_ids, budget):
    """Each prompt token i >= 1 gets its logprob, rank and top-k under position i - 1,
    chunk boundaries included; a request beside it that did not ask gets none."""
    kw = {"max_num_batched_tokens": budget} if budget else {}
    engine = make_engine(tiny_model_dir, **kw)
    ids = prompt_ids[7]
    seen: dict[str, list] = {}
    engine.add_request("p", ids, SamplingParams(max_new_tokens=3, prompt_logprobs=2))
    engine.add_request("plain", prompt_ids[0], SamplingParams(max_new_tokens=3))
    while engine.has_work:
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in seen  # sent once
                seen[out.request_id] = out.prompt_logprobs
    assert list(seen) == ["p"]
    lps = seen["p"]
    ref = _hf_prompt_logprobs(hf_model, ids)
    assert [lp.token_id for lp in lps] == ids[1:]
    for i, lp in enumerate(lps):
        row = ref[i]
        assert lp.logprob == pytest.approx(row[ids[i + 1]].item(), abs=1e-4)
        assert lp.rank == int((row > row[ids[i + 1]]).sum()) + 1
        assert [t for t, _ in lp.top] == row.topk(2).indices.tolist()


def test_greedy_steps_take_the_argmax_without_the_samplers_metadata(tiny_model_dir, prompt_ids,
                                                                    monkeypatch):
    """A step whose rows are all greedy with no penalties picks each row's argmax over its
    non-banned ids directly; the tokens equal the sampler's (min-new-tokens bans included)."""
    from engine.sampler import SamplingMetadata

    engine = make_engine(tiny_model_dir)
    first = run_to_completion(engine, {0: [("x", prompt_ids[4], greedy(1))]})["x"][0]
    banned = SamplingParams(max_new_tokens=6, min_new_tokens=6,
                            stop_token_ids=[first.token_ids[0]])  # its greedy first token
    arrivals = {0: [(f"r{i}", ids, greedy()) for i, ids in enumerate(prompt_ids[:3])],
                2: [("banned", prompt_ids[4], banned)]}

    def no_metadata(*args, **kwargs):
        raise AssertionError("an all-greedy step built sampler metadata")

    with monkeypatch.context() as m:
        m.setattr(SamplingMetadata, "build", no_metadata)
        fast = run_to_completion(engine, arrivals)
    with monkeypatch.context() as m:  # the sampler's path, its penalties at no-ops
        m.setattr(SamplingParams, "penalized", property(lambda self: True))
        sampler = run_to_completion(engine, arrivals)
    assert {k: v[0].token_ids for k, v in fast.items()} == \
        {k: v[0].token_ids for k, v in sampler.items()}
    assert fast["banned"][0].token_ids[0] != first.token_ids[0]
