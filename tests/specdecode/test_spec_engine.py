"""Speculative decoding in the engine, on tiny random models: greedy output is unchanged
token for token, sampling keeps its distribution, and the bookkeeping is right."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import FinishReason
from engine.runners.base import DecodeRow, PrefillWork
from engine.runners.torch.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from specdecode.batch_expansion import expand, multi_token
from specdecode.config import SpeculativeConfig
from specdecode.worker import speculator_for
from tests.conftest import build_tiny_model
from tests.engine.test_engine import run_to_completion

PROMPTS = [
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):",
    "Hello",
    "Once upon a time, in a land far away, there lived a",
    "A B C D E F G A B C D",
    "Roses are red, violets are blue,",
    "x = [1, 1, 2, 3, 5, 8, 13,",
]


class CopyPrompt:
    """Forces the output to repeat the prompt cyclically: copy-heavy text that n-gram
    lookup predicts, decided per row from that row's own prefix."""

    def __call__(self, prompt_ids, output_ids, logits):
        forced = prompt_ids[len(output_ids) % len(prompt_ids)]
        out = torch.full_like(logits, float("-inf"))
        out[forced] = logits[forced]
        return out


@pytest.fixture(scope="module")
def ids(tokenizer):
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory, tokenizer_dir):
    """A different random model with the same vocabulary: low acceptance."""
    return build_tiny_model(tmp_path_factory.mktemp("draft"), tokenizer_dir, seed=1)


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory, tokenizer_dir):
    """Four layers, so self:N has layers to drop."""
    return build_tiny_model(tmp_path_factory.mktemp("deep"), tokenizer_dir, num_layers=4)


def engine_for(model_dir, method=None, draft=None, k=4, **kw) -> LLMEngine:
    spec = SpeculativeConfig(method=method, draft_model=draft and str(draft),
                             num_spec_tokens=k, ngram_min=1, ngram_max=3,
                             disable_batch_size=kw.pop("disable_batch_size", 64),
                             scorer=kw.pop("scorer", "batch_expansion"))
    return LLMEngine(EngineConfig(model=str(model_dir), **kw), speculator=speculator_for(spec))


def workload(ids, batch: int, n: int = 1):
    """Mixed rows: copy-heavy (processor) and free ones, different lengths, some clipped by
    the context (max_model_len 96 in the callers) and min tokens so EOS does not end the
    random model early."""
    arrivals = {}
    for i in range(batch):
        prompt = ids[i % len(ids)]
        if i % 4 == 3:
            prompt = (prompt * 12)[:80]  # reaches the 96-token context before max_new
        max_new = 12 + 7 * (i % 3)
        procs = [CopyPrompt()] if i % 2 == 0 else []
        params = SamplingParams(max_new_tokens=max_new, min_new_tokens=max_new, n=n,
                                logits_processors=procs)
        arrivals.setdefault(i % 2, []).append((f"r{i}", prompt, params))
    return arrivals


def outputs(engine, arrivals):
    res = run_to_completion(engine, arrivals)
    return {rid: [(c.token_ids, c.finish_reason) for c in cs] for rid, cs in res.items()}


METHODS = ["ngram", "draft-target", "draft-random", "self:2"]


def method_engine(method, deep_model_dir, other_draft_dir, **kw):
    if method == "ngram":
        return engine_for(deep_model_dir, "ngram", **kw)
    if method == "draft-target":
        return engine_for(deep_model_dir, "draft", deep_model_dir, **kw)
    if method == "draft-random":
        return engine_for(deep_model_dir, "draft", other_draft_dir, **kw)
    return engine_for(deep_model_dir, "draft", "self:2", **kw)


@pytest.fixture(scope="module")
def plain(deep_model_dir, ids):
    engine = engine_for(deep_model_dir, max_model_len=96)
    return {(b, n): outputs(engine, workload(ids, b, n)) for b in (1, 3, 8) for n in (1, 2)}


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_with_speculation_equals_output_without(
        method, batch, deep_model_dir, other_draft_dir, ids, plain):
    engine = method_engine(method, deep_model_dir, other_draft_dir, max_model_len=96)
    got = outputs(engine, workload(ids, batch))
    assert got == plain[(batch, 1)]
    stats = engine.stats()
    assert stats.spec.steps > 0 and stats.spec.proposed > 0
    # n-gram predicts the copying rows; a draft equal to the target predicts the free ones
    # (the draft does not run the copying processor)
    if method == "ngram" or (method == "draft-target" and batch > 1):
        assert stats.spec.accepted > 0
    assert stats.spec.emitted >= stats.spec.accepted + stats.spec.steps
    assert engine.scheduler.allocator.num_used == 0


@pytest.mark.parametrize("method,batch", [("ngram", 1), ("ngram", 8), ("draft-random", 3),
                                          ("draft-target", 8)])
def test_the_multi_token_scorer_gives_the_same_greedy_output(
        method, batch, deep_model_dir, other_draft_dir, ids, plain):
    engine = method_engine(method, deep_model_dir, other_draft_dir, max_model_len=96,
                           scorer="multi_token")
    assert engine.speculator is not None and engine.speculator.multi_token
    assert outputs(engine, workload(ids, batch)) == plain[(batch, 1)]
    stats = engine.stats()
    assert stats.spec.steps > 0 and stats.spec.proposed > 0
    if method != "draft-random":  # a random draft may see all its guesses rejected
        assert stats.spec.accepted > 0


def test_an_unknown_scorer_is_refused(deep_model_dir):
    with pytest.raises(ValueError, match="scorer"):
        engine_for(deep_model_dir, "ngram", scorer="tree")


def test_a_draft_equal_to_the_target_has_every_proposal_accepted(deep_model_dir, ids):
    engine = engine_for(deep_model_dir, "draft", deep_model_dir)
    run_to_completion(engine, {0: [(f"r{i}", ids[i], SamplingParams(
        max_new_tokens=20, min_new_tokens=20)) for i in range(4)]})
    stats = engine.stats()
    assert stats.spec.accepted == stats.spec.proposed > 0
    assert stats.spec.emitted == stats.spec.accepted + stats.spec.steps * 4 \
        or stats.spec.emitted > 2 * stats.spec.steps


def test_n_greater_than_one_with_speculation(deep_model_dir, other_draft_dir, ids, plain):
    for method in ("ngram", "draft-target"):
        engine = method_engine(method, deep_model_dir, other_draft_dir, max_model_len=96)
        assert outputs(engine, workload(ids, 3, n=2)) == plain[(3, 2)]


def test_a_stop_sequence_inside_an_accepted_run_ends_the_output_there(deep_model_dir,
                                                                       tokenizer, ids):
    prompt = ids[1]
    base = engine_for(deep_model_dir)
    free = run_to_completion(base, {0: [("r", prompt, SamplingParams(
        max_new_tokens=24, min_new_tokens=24, logits_processors=[CopyPrompt()]))]})["r"][0]
    stop = tokenizer.decode(free.token_ids[9:11])

    def run(engine):
        params = SamplingParams(max_new_tokens=24, stop=[stop],
                                logits_processors=[CopyPrompt()])
        return run_to_completion(engine, {0: [("r", prompt, params)]})["r"][0]

    want = run(base)
    spec_engine = engine_for(deep_model_dir, "draft", deep_model_dir, k=6)
    got = run(spec_engine)
    assert want.finish_reason is FinishReason.STOP_SEQUENCE
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids,
                                                           want.finish_reason)
    # the stop fell inside a run of accepted tokens: fewer steps than tokens
    assert spec_engine.stats().spec.steps < len(got.token_ids)


def test_logprobs_are_reported_for_every_emitted_token(deep_model_dir, ids):
    def run(engine):
        params = SamplingParams(max_new_tokens=16, min_new_tokens=16, logprobs=True,
                                top_logprobs=3, logits_processors=[CopyPrompt()])
        return run_to_completion(engine, {0: [("r", ids[0], params)]})["r"][0]

    want = run(engine_for(deep_model_dir))
    got = run(engine_for(deep_model_dir, "ngram"))
    assert got.token_ids == want.token_ids
    assert [lp.token_id for lp in got.logprobs] == got.token_ids
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_usage_counts_proposed_and_accepted_tokens(deep_model_dir, ids):
    engine = engine_for(deep_model_dir, "ngram")
    req = engine.add_request("r", ids[0], SamplingParams(
        max_new_tokens=20, min_new_tokens=20, logits_processors=[CopyPrompt()]))
    while engine.has_work:
        engine.step()
    assert req.usage.spec_proposed_tokens == engine.stats().spec.proposed > 0
    assert 0 < req.usage.spec_accepted_tokens <= req.usage.spec_proposed_tokens


def test_speculation_turns_off_for_big_batches_and_per_request(deep_model_dir, ids):
    engine = engine_for(deep_model_dir, "draft", deep_model_dir, disable_batch_size=2)
    run_to_completion(engine, {0: [(f"r{i}", ids[i], SamplingParams(max_new_tokens=8))
                                   for i in range(3)]})
    assert engine.stats().spec.steps == 0
    engine = engine_for(deep_model_dir, "draft", deep_model_dir)
    run_to_completion(engine, {0: [("off", ids[0], SamplingParams(
        max_new_tokens=8, speculative=False))]})
    assert engine.stats().spec.steps == 0
    run_to_completion(engine, {0: [("on", ids[0], SamplingParams(max_new_tokens=8))]})
    assert engine.stats().spec.steps > 0


def test_seeded_sampling_with_speculation_is_reproducible(deep_model_dir, other_draft_dir,
                                                          ids):
    def run():
        engine = engine_for(deep_model_dir, "draft", other_draft_dir)
        params = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=20, seed=42)
        return run_to_completion(engine, {0: [("r", ids[2], params)]})["r"][0].token_ids

    assert run() == run()


def test_batch_expansion_scores_equal_one_token_at_a_time_decoding(deep_model_dir, ids):
    """The k+1 expanded rows of one forward give the logits sequential decodes give."""
    config = EngineConfig(model=str(deep_model_dir))
    runner = ModelRunner(config)
    prompt, proposals = ids[1], [11, 12, 13]
    table = list(range(8))

    class Seq:  # the fields expand() reads
        prompt_token_ids = prompt[:-1] + [prompt[-1]]
        output_token_ids: list[int] = []
        block_table = table
        num_tokens = len(prompt)
        seq_id = 0

        def token_at(self, i):
            return prompt[i]

    runner.execute([], [PrefillWork(prompt[:-1], 0, table, False)])
    rows = expand(Seq(), proposals)  # type: ignore[arg-type]
    expanded = runner.execute(rows, [])
    tokens = [prompt[-1], *proposals]
    sequential = torch.stack([runner.execute([DecodeRow(t, len(prompt) - 1 + j, table)], [])[0]
                              for j, t in enumerate(tokens)])
    torch.testing.assert_close(expanded, sequential, rtol=1e-4, atol=1e-4)
    # the multi-token scorer: one causal query of the same tokens, the same scores
    work = multi_token(Seq(), proposals)  # type: ignore[arg-type]
    torch.testing.assert_close(runner.execute([], [work]), expanded, rtol=1e-4, atol=1e-4)


def test_sampled_distributions_match_with_and_without_speculation(deep_model_dir, ids):
    """Next-token and 3-token distributions agree with a draft whose distribution differs
    from the target's (self:3: the target without its last layer; about a third of its
    proposals are rejected). Top-k 3 keeps the support small (3 / 27 outcomes). Tolerance:
    total variation < 0.07 for one token and < 0.12 for three with 1500 samples each
    (expected TV from sampling noise alone is ~0.02 / ~0.06)."""
    samples = 1500
    params = dict(max_new_tokens=3, min_new_tokens=3, temperature=1.0, top_k=3, n=100)

    def distribution(engine, seed):
        torch.manual_seed(seed)
        arrivals = {0: [(f"r{i}", ids[6], SamplingParams(**params))
                        for i in range(samples // 100)]}
        res = run_to_completion(engine, arrivals)
        seqs = [tuple(c.token_ids) for cs in res.values() for c in cs]
        return Counter(s[:1] for s in seqs), Counter(seqs)

    kw = dict(max_num_seqs=256, max_num_batched_tokens=4096)
    plain_1, plain_3 = distribution(engine_for(deep_model_dir, **kw), 0)
    spec = engine_for(deep_model_dir, "draft", "self:3", k=2, disable_batch_size=256,
                      **kw)
    spec_1, spec_3 = distribution(spec, 1)
    stats = spec.stats()
    assert stats.spec.proposed > stats.spec.accepted > 0  # rejections happen

    def tv(a: Counter, b: Counter) -> float:
        return sum(abs(a[x] - b[x]) for x in set(a) | set(b)) / (2 * samples)

    assert tv(plain_1, spec_1) < 0.07
    assert tv(plain_3, spec_3) < 0.12


def _record_forwards(engine) -> list[tuple[int, int]]:
    """(decode rows, prefill chunks) of every target forward from now on."""
    calls: list[tuple[int, int]] = []
    execute = engine.runner.execute

    def recorded(decodes, prefills):
        calls.append((len(decodes), len(prefills)))
        return execute(decodes, prefills)

    engine.runner.execute = recorded
    return calls


@pytest.mark.parametrize("scorer", ["batch_expansion", "multi_token"])
def test_accepted_tokens_are_never_recomputed(deep_model_dir, ids, scorer):
    """A draft equal to the target has every proposal accepted: N new tokens with k
    proposals take 1 + ceil((N - 1) / (k + 1)) forwards, and after the prompt's prefill
    no forward recomputes a token (no prefill chunk but the scorer's own query)."""
    k, new = 4, 21
    engine = engine_for(deep_model_dir, "draft", deep_model_dir, k=k, scorer=scorer)
    calls = _record_forwards(engine)
    out = run_to_completion(engine, {0: [("r", ids[1], SamplingParams(
        max_new_tokens=new, min_new_tokens=new))]})["r"][0]
    assert len(out.token_ids) == new
    assert len(calls) == 1 + -(-(new - 1) // (k + 1))  # 1 prefill + 4 speculative steps
    assert calls[0] == (0, 1)
    if scorer == "batch_expansion":
        assert all(prefills == 0 and decodes == k + 1 for decodes, prefills in calls[1:])
    else:
        assert all(decodes == 0 and prefills == 1 for decodes, prefills in calls[1:])
    stats = engine.stats().spec
    assert stats.accepted == stats.proposed == new - 1 - stats.steps


def test_ngram_speculates_on_consecutive_steps(deep_model_dir, ids):
    engine = engine_for(deep_model_dir, "ngram", k=4)
    calls = _record_forwards(engine)
    run_to_completion(engine, {0: [("r", ids[0], SamplingParams(
        max_new_tokens=40, min_new_tokens=40, logits_processors=[CopyPrompt()]))]})
    speculated = [decodes > 1 for decodes, _ in calls]
    assert any(a and b for a, b in zip(speculated, speculated[1:], strict=False))
    assert all(prefills == 0 for _, prefills in calls[1:])  # nothing recomputed
    assert len(calls) < 40 / 2


# ------------------------------------------------- seeded sampling under speculation and load


class CopyBias:
    """Gives the token that repeats the prompt cyclically as much weight as all the others
    (more after temperature 0.9 and top-p): sampled text that mostly copies (n-gram lookup
    proposes, and is often right) and often enough does not."""

    def __call__(self, prompt_ids, output_ids, logits):
        out = logits.clone()
        out[prompt_ids[len(output_ids) % len(prompt_ids)]] = logits.logsumexp(0)
        return out


SEEDED_NEW = 40


def seeded_params(seed: int = 2024) -> SamplingParams:
    return SamplingParams(max_new_tokens=SEEDED_NEW, min_new_tokens=SEEDED_NEW,
                          temperature=0.9, top_p=0.95, seed=seed, n=2,
                          logits_processors=[CopyBias()])


def crowd(ids, size: int, at: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Unseeded sampled batch mates of different lengths, half of them copy-biased."""
    return [(f"mate{at}-{i}", ids[i % len(ids)], SamplingParams(
        max_new_tokens=4 + 3 * (i % 4), min_new_tokens=4 + 3 * (i % 4), temperature=1.0,
        logits_processors=[CopyBias()] if i % 2 else [])) for i in range(size)]


def seeded_run(engine, ids, arrivals=None) -> list[list[int]]:
    """The seeded request's children (prompt: a copy-heavy sentence), among ``arrivals``."""
    arrivals = {k: list(v) for k, v in (arrivals or {}).items()}
    arrivals.setdefault(0, []).append(("seeded", ids[1] * 2, seeded_params()))
    res = run_to_completion(engine, arrivals)
    return [c.token_ids for c in res["seeded"]]


def count_forced_off(engine) -> list[int]:
    """Records, per step of the speculator, whether the batch was past its off threshold."""
    spec = engine.speculator
    off: list[int] = []
    budgets = spec.budgets

    def recording(seqs, num_running):
        off.append(int(num_running > spec.disable_batch_size))
        return budgets(seqs, num_running)

    spec.budgets = recording
    return off


@pytest.fixture(scope="module")
def seeded_alone(deep_model_dir, ids):
    return seeded_run(engine_for(deep_model_dir), ids)


def test_seeded_reference_really_samples(seeded_alone, deep_model_dir, ids):
    a, b = seeded_alone
    assert len(a) == len(b) == SEEDED_NEW and a != b  # n children draw distinct streams
    other = run_to_completion(engine_for(deep_model_dir), {0: [
        ("s", ids[1] * 2, seeded_params(7))]})["s"][0].token_ids
    assert other != a  # another seed, another output


def test_seeded_output_is_the_same_among_random_batch_mates(seeded_alone, deep_model_dir,
                                                            ids):
    engine = engine_for(deep_model_dir)
    assert seeded_run(engine, ids, {0: crowd(ids, 3, 0), 4: crowd(ids, 5, 4)}) == seeded_alone


@pytest.mark.parametrize("k", [1, 3, 8])
def test_seeded_output_is_the_same_with_ngram_speculation(seeded_alone, deep_model_dir, ids,
                                                          k):
    engine = engine_for(deep_model_dir, "ngram", k=k)
    assert seeded_run(engine, ids) == seeded_alone
    stats = engine.stats().spec
    assert stats.proposed > stats.accepted > 0  # proposals both accepted and rejected


def test_seeded_output_is_the_same_when_speculation_turns_off_for_some_steps(
        seeded_alone, deep_model_dir, ids):
    """A crowd arrives and leaves: past 3 running sequences speculation is off for the step,
    then on again; batch mates speculate too."""
    engine = engine_for(deep_model_dir, "ngram", k=4, disable_batch_size=3)
    off = count_forced_off(engine)
    got = seeded_run(engine, ids, {3: crowd(ids, 4, 3), 20: crowd(ids, 3, 20)})
    assert got == seeded_alone
    assert 0 < sum(off) < len(off)  # some steps off, some on
    assert engine.stats().spec.accepted > 0


@pytest.mark.parametrize("method", ["draft-target", "draft-random", "self:2"])
def test_seeded_output_is_the_same_with_a_sampling_draft_model(
        seeded_alone, method, deep_model_dir, other_draft_dir, ids):
    """A seeded row's draft samples from the target's own per-position uniforms: its
    output is plain sampling's, alone and in a crowd that turns speculation off."""
    engine = method_engine(method, deep_model_dir, other_draft_dir, disable_batch_size=4)
    assert seeded_run(engine, ids) == seeded_alone
    assert seeded_run(engine, ids, {2: crowd(ids, 5, 2)}) == seeded_alone
    stats = engine.stats().spec
    assert stats.proposed > 0
    if method == "draft-target":  # the target drafting for itself: its draws agree
        assert stats.accepted > 0
    # other drafts' acceptance depends on how close two random models are: not asserted


def test_seeded_output_is_the_same_after_preemption_with_speculation(
        seeded_alone, deep_model_dir, ids):
    """Room for one and a half of its children: preempted and recomputed, with n-gram
    speculation."""
    per_block = 2 * 4 * 2 * 16 * 4 * 4  # (k, v) * layers * kv heads * head dim * fp32 * 4
    engine = engine_for(deep_model_dir, "ngram", k=4, block_size=4,
                        kv_cache_memory=per_block * 24)
    got = seeded_run(engine, ids, {1: crowd(ids, 4, 1)})
    assert engine.scheduler.num_preemptions > 0
    assert got == seeded_alone


def test_no_repeat_window_gives_the_same_output_with_speculation(deep_model_dir, ids):
    """The built-in ``no_repeat_window`` kept a running count of the outputs it was shown;
    verify rows end in proposals, so rejected ones stayed counted and their replacements
    never were: the output changed with speculation. Here the output is steered along the
    prompt's cycle ``a b a c d`` (so n-gram proposes it) and the window of 3 bans the
    second ``a`` each time (so proposals are rejected)."""
    from service.builtin_processors import NoRepeatWindowProcessor

    a, b, c, d = ids[0][:4]
    cycle = [a, b, a, c, d]

    def steer(prompt_ids, output_ids, logits):
        logits = logits.clone()
        logits[cycle[len(output_ids) % len(cycle)]] += 100.0
        return logits

    params = SamplingParams(max_new_tokens=24, min_new_tokens=24,
                            logits_processors=[steer, NoRepeatWindowProcessor(3)])
    got = {}
    for method in (None, "ngram"):
        engine = engine_for(deep_model_dir, method)
        got[method] = run_to_completion(engine, {0: [("r", ids[1] + cycle * 6, params)]}
                                        )["r"][0].token_ids
        if method:
            stats = engine.stats().spec
            assert stats.accepted > 0 and stats.proposed > stats.accepted
    assert got["ngram"] == got[None]
    out = got[None]
    assert all(t not in out[max(0, i - 3):i] for i, t in enumerate(out))
