"""Processor factories: one product per sequence, released exactly once, failures isolated."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.logits_process import RequestSpecError
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams
from tests.engine.test_engine import make_engine, run_to_completion

PROMPTS = ["Hello there", "The sky is", "Numbers: 1, 2,", "Write a poem about",
           "In 1492,", "def add(a, b):", "Roses are red,", "My favourite food is"]


class Recorder:
    """Stateful processor: remembers every output prefix it was shown."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []
        self.prompt: list[int] | None = None

    def __call__(self, prompt_ids, output_ids, logits):
        if self.prompt is None:
            self.prompt = list(prompt_ids)
        self.seen.append(list(output_ids))
        return logits


class RecorderFactory:
    def __init__(self) -> None:
        self.created: list[Recorder] = []
        self.released: list[Recorder] = []
        self._lock = threading.Lock()

    def create(self) -> Recorder:
        with self._lock:
            r = Recorder()
            self.created.append(r)
            return r

    def release(self, proc: Recorder) -> None:
        with self._lock:
            assert proc in self.created and proc not in self.released, "double release"
            self.released.append(proc)


class RaiseOnNth:
    def __init__(self, n: int, error: Exception | None = None) -> None:
        self.n = n
        self.calls = 0
        self.error = error or RuntimeError(f"boom on call {n}")

    def __call__(self, prompt_ids, output_ids, logits):
        self.calls += 1
        if self.calls == self.n:
            raise self.error
        return logits


class RaiseFactory:
    def __init__(self, n: int, error: Exception | None = None) -> None:
        self.n = n
        self.error = error
        self.released = 0

    def create(self):
        return RaiseOnNth(self.n, self.error)

    def release(self, proc) -> None:
        self.released += 1


@pytest.fixture(scope="module")
def ids(tokenizer):
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


def test_batch_sharing_one_params_object_gives_each_sequence_its_own_processor(
        tiny_model_dir, ids):
    """The seed bug: 16 items share identical params with a stateful processor."""
    factory = RecorderFactory()
    params = SamplingParams(max_new_tokens=6, min_new_tokens=6, logits_processors=[factory])
    engine = make_engine(tiny_model_dir)
    reqs = [(f"r{i}", ids[i % len(ids)], params) for i in range(16)]
    res = run_to_completion(engine, {0: reqs[:8], 2: reqs[8:]})
    assert len(factory.created) == 16 == len(factory.released)
    by_prompt = {}
    for rec in factory.created:
        by_prompt.setdefault(tuple(rec.prompt), []).append(rec)
    for rid, prompt, _ in reqs:
        out = res[rid][0].token_ids
        # some recorder for this prompt saw exactly this output, prefix by prefix
        expect = [out[:i] for i in range(len(out))]
        assert any(r.seen == expect for r in by_prompt[tuple(prompt)]), rid


def test_n_children_get_independent_processors(tiny_model_dir, ids):
    factory = RecorderFactory()
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_new_tokens=5, min_new_tokens=5,
                            logits_processors=[factory])
    engine = make_engine(tiny_model_dir)
    res = run_to_completion(engine, {0: [("a", ids[0], params)]})
    assert len(factory.created) == 4 == len(factory.released)
    outs = sorted(tuple(c.token_ids) for c in res["a"])
    seen = sorted(tuple(r.seen[-1]) for r in factory.created)
    assert seen == sorted(o[:-1] for o in outs)


def test_failing_processor_finishes_only_its_own_sequence(tiny_model_dir, ids):
    base = make_engine(tiny_model_dir)
    healthy = SamplingParams(max_new_tokens=8, min_new_tokens=8)
    expected = run_to_completion(base, {0: [(f"h{i}", ids[i], healthy) for i in range(1, 8)]})

    failing = RaiseFactory(3)
    engine = make_engine(tiny_model_dir)
    bad = SamplingParams(max_new_tokens=8, min_new_tokens=8, logits_processors=[failing])
    reqs = [("bad", ids[0], bad)] + [(f"h{i}", ids[i], healthy) for i in range(1, 8)]
    res = run_to_completion(engine, {0: reqs})
    assert res["bad"][0].finish_reason is FinishReason.ERROR
    assert "boom on call 3" in res["bad"][0].error
    assert res["bad"][0].invalid_field is None  # the server's failure, not the request's
    assert len(res["bad"][0].token_ids) == 2
    assert failing.released == 1
    for i in range(1, 8):
        assert res[f"h{i}"][0].token_ids == expected[f"h{i}"][0].token_ids
    again = run_to_completion(engine, {0: [("after", ids[1], healthy)]})
    assert again["after"][0].token_ids == expected["h1"][0].token_ids
    assert engine.scheduler.allocator.num_used == 0


def test_a_request_spec_error_mid_output_ends_its_sequence_as_the_requests_fault(
        tiny_model_dir, ids):
    """A processor that finds mid-output that the request's spec cannot be enforced (a
    grammar backend's limit): ERROR with its own message and the field at fault, the tokens
    before it kept, the batch mate untouched."""
    failing = RaiseFactory(3, RequestSpecError("grammar", "past the row limit (max is 2000)"))
    engine = make_engine(tiny_model_dir)
    bad = SamplingParams(max_new_tokens=8, min_new_tokens=8, logits_processors=[failing])
    healthy = SamplingParams(max_new_tokens=8, min_new_tokens=8)
    res = run_to_completion(engine, {0: [("bad", ids[0], bad), ("ok", ids[1], healthy)]})
    c = res["bad"][0]
    assert c.finish_reason is FinishReason.ERROR and len(c.token_ids) == 2
    assert (c.invalid_field, c.error) == ("grammar", "past the row limit (max is 2000)")
    assert res["ok"][0].finish_reason is FinishReason.LENGTH
    assert failing.released == 1 and engine.scheduler.allocator.num_used == 0


def test_a_processor_that_changes_logits_steers_only_its_sequence(tiny_model_dir, ids):
    target = 1000

    def force(prompt_ids, output_ids, logits):
        logits = logits.clone()
        logits[:] = -torch.inf
        logits[target] = 0.0
        return logits

    engine = make_engine(tiny_model_dir)
    res = run_to_completion(engine, {0: [
        ("forced", ids[0], SamplingParams(max_new_tokens=4, logits_processors=[force])),
        ("free", ids[0], SamplingParams(max_new_tokens=4, min_new_tokens=4)),
    ]})
    assert res["forced"][0].token_ids == [target] * 4
    assert res["free"][0].token_ids != [target] * 4


def test_preemption_keeps_processor_state_and_output(tiny_model_dir, ids):
    def run(**kw):
        factory = RecorderFactory()
        params = SamplingParams(max_new_tokens=16, min_new_tokens=16,
                                logits_processors=[factory])
        engine = make_engine(tiny_model_dir, **kw)
        res = run_to_completion(engine, {0: [(f"r{i}", p, params) for i, p in enumerate(ids)]})
        states = sorted((tuple(r.prompt), tuple(map(tuple, r.seen))) for r in factory.created)
        outs = [res[f"r{i}"][0].token_ids for i in range(len(ids))]
        return engine, outs, states, factory

    _, outs, states, _ = run()
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4
    engine, outs_p, states_p, factory = run(block_size=4, kv_cache_memory=block_bytes * 14)
    assert engine.scheduler.num_preemptions > 0
    assert outs_p == outs
    assert states_p == states
    assert len(factory.created) == len(factory.released)


def test_random_aborts_and_deadlines_release_every_processor_and_block(tiny_model_dir, ids):
    factory = RecorderFactory()
    engine = make_engine(tiny_model_dir, max_num_seqs=32)
    rng = random.Random(0)
    live: list[str] = []
    for i in range(1000):
        params = SamplingParams(
            n=rng.choice([1, 1, 2]), max_new_tokens=rng.randint(1, 6),
            time_limit_s=rng.choice([None, None, 1e-4]), logits_processors=[factory])
        engine.add_request(f"r{i}", ids[i % len(ids)], params)
        live.append(f"r{i}")
        if rng.random() < 0.3:
            engine.abort(rng.choice(live))
        if i % 4 == 0:
            for out in engine.step():
                if out.finished:
                    live.remove(out.request_id)
    while engine.has_work:
        engine.step()
    assert len(factory.created) == len(factory.released) > 1000
    assert engine.scheduler.allocator.num_used == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting


class NoImmediateRepeat:
    """Per-row form: bans the token just emitted."""

    def __init__(self, fail_on_prompt: list[int] | None = None) -> None:
        self.fail_on_prompt = fail_on_prompt

    def __call__(self, prompt_ids, output_ids, logits):
        if self.fail_on_prompt is not None and list(prompt_ids) == self.fail_on_prompt:
            raise ValueError("this row's processor is broken")
        if output_ids:
            logits = logits.clone()
            logits[output_ids[-1]] = -torch.inf
        return logits


class BatchedNoImmediateRepeat:
    """The same rule as a batched factory: one mask for all rows, built off-thread."""

    def __init__(self, fail_batch: bool = False, fail_on_prompt=None,
                 forward_started: threading.Event | None = None) -> None:
        self.fail_batch = fail_batch
        self.fail_on_prompt = fail_on_prompt
        self.prepare_threads: set[str] = set()
        # Set by the test when a forward begins: a prepare that waits for it proves the
        # forward was launched without waiting for the prepare (no timing involved).
        self.forward_started = forward_started
        self.saw_forward: list[bool] = []
        self.created = self.released = 0

    def create(self):
        self.created += 1
        return NoImmediateRepeat(self.fail_on_prompt)

    def release(self, proc) -> None:
        self.released += 1

    def prepare_batch(self, products, prompt_ids, output_ids):
        self.prepare_threads.add(threading.current_thread().name)
        if self.forward_started is not None:
            self.saw_forward.append(self.forward_started.wait(timeout=10))
            self.forward_started.clear()
        if self.fail_batch:
            raise RuntimeError("batch prepare failed")
        return [out[-1] if out else None for out in output_ids]

    def apply_batch(self, last_tokens, logits):
        for row, tok in enumerate(last_tokens):
            if tok is not None:
                logits[row, tok] = -torch.inf
        return logits


def test_batched_factory_prepares_during_the_forward_and_matches_per_row(tiny_model_dir, ids):
    def run(proc_or_factory, forward_started=None, **kw):
        engine = make_engine(tiny_model_dir, **kw)
        execute = engine.runner.execute

        def signalled(*a, **kw):
            if forward_started is not None:
                forward_started.set()
            return execute(*a, **kw)

        engine.runner.execute = signalled
        params = SamplingParams(max_new_tokens=10, min_new_tokens=10, repetition_penalty=0.5,
                                logits_processors=[proc_or_factory])
        res = run_to_completion(engine, {0: [(f"r{i}", p, params) for i, p in enumerate(ids)]})
        return [res[f"r{i}"][0].token_ids for i in range(len(ids))]

    per_row = run(NoImmediateRepeat())
    inline_factory = BatchedNoImmediateRepeat()
    inline = run(inline_factory, overlap_prepare=False)
    assert inline == per_row
    assert inline_factory.prepare_threads == {threading.current_thread().name}
    started = threading.Event()
    factory = BatchedNoImmediateRepeat(forward_started=started)
    batched = run(factory, forward_started=started, overlap_prepare=True)
    assert batched == per_row
    for out in batched:  # the rule really applied (penalty 0.5 favours repeats)
        assert all(a != b for a, b in zip(out, out[1:], strict=False))
    assert factory.prepare_threads == {"genserve-prepare_0"}
    # every prepare could wait for its step's forward to begin: the engine launched the
    # forward without waiting for the prepare (inline, each wait would time out)
    assert factory.saw_forward and all(factory.saw_forward)
    assert factory.created == factory.released == len(ids)


def test_failing_batch_prepare_falls_back_and_pins_the_error_on_one_sequence(tiny_model_dir,
                                                                               ids):
    factory = BatchedNoImmediateRepeat(fail_batch=True, fail_on_prompt=ids[2])
    engine = make_engine(tiny_model_dir)
    params = SamplingParams(max_new_tokens=6, min_new_tokens=6, logits_processors=[factory])
    res = run_to_completion(engine, {0: [(f"r{i}", p, params) for i, p in enumerate(ids)]})
    assert res["r2"][0].finish_reason is FinishReason.ERROR
    assert "broken" in res["r2"][0].error
    for i in range(len(ids)):
        if i != 2:
            out = res[f"r{i}"][0].token_ids
            assert res[f"r{i}"][0].finish_reason is FinishReason.LENGTH and len(out) == 6
            assert all(a != b for a, b in zip(out, out[1:], strict=False))
    assert factory.created == factory.released == len(ids)


class EndAfter:
    """Forces ``k`` copies of ``token`` then EOS: an output the test knows in advance."""

    def __init__(self, token: int, k: int, eos: int) -> None:
        self.token, self.k, self.eos = token, k, eos

    def __call__(self, prompt_ids, output_ids, logits):
        out = torch.full_like(logits, -torch.inf)
        out[self.token if len(output_ids) < self.k else self.eos] = 0.0
        return out


class CheckedFactory:
    """A factory whose finished outputs must pass ``check_output`` (as a grammar that
    enforces a JSON schema only in part): the engine, not its caller, runs the check."""

    def __init__(self, token: int, k: int, eos: int, problem: str | None) -> None:
        self.token, self.k, self.eos, self.problem = token, k, eos, problem
        self.checked: list[str] = []
        self.released = 0

    def create(self) -> EndAfter:
        return EndAfter(self.token, self.k, self.eos)

    def release(self, proc) -> None:
        self.released += 1

    def check_output(self, text: str) -> str | None:
        self.checked.append(text)
        return self.problem


def test_an_output_failing_its_factorys_check_finishes_with_error_its_text_kept(
        tiny_model_dir, tokenizer, ids):
    engine = make_engine(tiny_model_dir)
    eos = tokenizer.eos_token_id
    token = tokenizer.encode("ab", add_special_tokens=False)[0]
    bad = CheckedFactory(token, 3, eos, "structured_output: not what the schema says")
    good = CheckedFactory(token, 3, eos, None)
    results = run_to_completion(engine, {0: [
        ("bad", ids[0], SamplingParams(max_new_tokens=8, logits_processors=[bad], n=2)),
        ("good", ids[1], SamplingParams(max_new_tokens=8, logits_processors=[good])),
        ("cut", ids[2], SamplingParams(max_new_tokens=2, logits_processors=[
            CheckedFactory(token, 3, eos, "never asked")]))]})
    text = tokenizer.decode([token] * 3)
    for c in results["bad"]:
        assert c.finish_reason is FinishReason.ERROR and c.rejected
        assert c.error == "structured_output: not what the schema says"
        assert c.text == text and c.token_ids == [token] * 3 + [eos]
    assert bad.checked == [text, text] and bad.released == 2
    (ok,) = results["good"]
    assert ok.finish_reason is FinishReason.EOS and not ok.rejected and ok.error is None
    assert good.checked == [text]
    (cut,) = results["cut"]  # only an output the grammar ended (EOS) is checked
    assert cut.finish_reason is FinishReason.LENGTH and not cut.rejected


def allow_none_after(n: int):
    """A processor that leaves no token open once ``n`` tokens are out (as a grammar whose
    only continuations another processor bans does)."""

    def proc(prompt_ids, output_ids, logits):
        return torch.full_like(logits, -torch.inf) if len(output_ids) >= n else logits

    return proc


@pytest.mark.parametrize("sampled", [False, True])
def test_a_row_left_with_no_token_ends_its_sequence_as_the_requests_fault(
        tiny_model_dir, ids, sampled):
    """It crashed the engine loop (top-p of a NaN row; the server then refused everything)
    or, greedy, emitted token 0 against every processor. Now: ERROR naming why, the tokens
    before it kept, a top-p batch mate untouched."""
    engine = make_engine(tiny_model_dir)
    kw = dict(temperature=0.7, seed=1) if sampled else {}
    bad = SamplingParams(max_new_tokens=8, logits_processors=[allow_none_after(2)], **kw)
    mate = SamplingParams(max_new_tokens=8, min_new_tokens=8, temperature=0.9, top_p=0.8,
                          seed=3)
    res = run_to_completion(engine, {0: [("bad", ids[0], bad), ("ok", ids[1], mate)]})
    c = res["bad"][0]
    assert c.finish_reason is FinishReason.ERROR and len(c.token_ids) == 2
    assert c.invalid_field == "" and "no token can follow output token 2" in c.error
    alone = run_to_completion(make_engine(tiny_model_dir), {0: [("ok", ids[1], mate)]})
    assert res["ok"][0].token_ids == alone["ok"][0].token_ids
    assert engine.scheduler.allocator.num_used == 0


def test_a_processor_writing_nan_fails_only_its_own_sequence(tiny_model_dir, ids):
    def nan_at_3(prompt_ids, output_ids, logits):
        if len(output_ids) == 3:
            logits = logits.clone()
            logits[5] = torch.nan
        return logits

    engine = make_engine(tiny_model_dir)
    bad = SamplingParams(max_new_tokens=8, temperature=1.0, seed=2,
                         logits_processors=[nan_at_3])
    mate = SamplingParams(max_new_tokens=8, min_new_tokens=8, temperature=0.9, top_p=0.8,
                          seed=3)
    res = run_to_completion(engine, {0: [("bad", ids[0], bad), ("ok", ids[1], mate)]})
    c = res["bad"][0]
    assert c.finish_reason is FinishReason.ERROR and len(c.token_ids) == 3
    assert c.invalid_field is None and "NaN or +inf" in c.error
    assert res["ok"][0].finish_reason is FinishReason.LENGTH


def test_an_empty_verify_row_cuts_the_accepted_proposals_there(tiny_model_dir, ids):
    """With n-gram proposals: the output is forced to repeat one token (so proposals come
    and are accepted) until 4 tokens are out, after which nothing is allowed. The tokens
    verified before the empty row are kept, none drawn from it or after it."""
    from specdecode.config import SpeculativeConfig
    from specdecode.worker import speculator_for

    def repeat_then_nothing(prompt_ids, output_ids, logits):
        out = torch.full_like(logits, -torch.inf)
        if len(output_ids) < 4:
            out[1000] = 0.0
        return out

    spec = speculator_for(SpeculativeConfig(method="ngram", num_spec_tokens=3))
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir)), speculator=spec)
    bad = SamplingParams(max_new_tokens=12, logits_processors=[repeat_then_nothing])
    res = run_to_completion(engine, {0: [("bad", ids[0] + [1000] * 6, bad)]})
    c = res["bad"][0]
    assert c.finish_reason is FinishReason.ERROR, c
    assert c.token_ids == [1000] * 4 and "no token can follow output token 4" in c.error
    assert engine.stats().spec.accepted > 0
    assert engine.scheduler.allocator.num_used == 0
