"""A differential soak on the default model: requests arrive at random steps, some are
aborted, most share one of a few long prompt prefixes, some ask ``n = 2`` or seeded
sampling; n-gram speculation runs; the KV cache is small enough to preempt and evict, and
the chunk budget small enough to split prompts (leaving one-token tails). Every request
must finish, and on the torch runner (batch invariant) equal the same request run alone
on a plain engine, token for token. The default llama.cpp runner is not batch invariant
(near-ties may move with batch mates): there every request must finish with all its
tokens. This is how the hand-off's one-token-tail crash was found (2026-11-27)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.runners.select import llama_cpp_available
from engine.sampling_params import SamplingParams
from specdecode.config import SpeculativeConfig
from specdecode.worker import speculator_for

CHUNK = 48  # a long prompt's chunk (long_prefill_token_threshold)
WORDS = ["the", "river", "king", "queen", "sword", "castle", "forest", "night", "day",
         "story", "dragon", "knight", "magic", "of", "a", "to", "in", "is", "was",
         "that", "for", "on", "with", "as", "by", "at", "from", "his", "her", "they",
         "which"]


@dataclass
class Req:
    request_id: str
    prompt: list[int]
    params: dict
    abort_after: int | None  # steps after its arrival; None = runs out


def scenario(tokenizer, rng: random.Random, n: int, long_questions: float = 0.0
             ) -> list[Req]:
    """``long_questions``: the share of questions of 60-120 words (a cache hit's tail the
    llama.cpp runner prefills in torch)."""
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(k)) for k in (60, 110, 170)]
    reqs = []
    for i in range(n):
        words = rng.randint(60, 120) if long_questions and rng.random() < long_questions \
            else rng.randint(3, 20)
        text = (rng.choice(prefixes) if rng.random() < 0.8 else "") + f" Question {i}: " \
            + " ".join(rng.choice(WORDS) for _ in range(words))
        kind = rng.choice(["greedy", "greedy", "seeded", "n2"])
        params: dict = dict(max_new_tokens=rng.randint(6, 16), ignore_eos=True)
        if kind == "seeded":
            params.update(temperature=0.8, top_p=0.9, seed=rng.randint(0, 999))
        elif kind == "n2":
            params.update(n=2)
        ids = tokenizer(text)["input_ids"]
        if i % 3 == 0:  # a prompt of its own (prefilled in torch), chunks and one token
            ids = tokenizer(" ".join(rng.choice(WORDS) for _ in range(200)))["input_ids"]
            ids = ids[:rng.choice([3, 4]) * CHUNK + 1]
        reqs.append(Req(f"r{i}", ids, params,
                        rng.randint(1, 12) if rng.random() < 0.15 else None))
    return reqs


def alone(engine: LLMEngine, reqs: list[Req]) -> dict[str, dict[int, list[int]]]:
    out: dict[str, dict[int, list[int]]] = {}
    for r in reqs:
        engine.add_request(r.request_id, r.prompt, SamplingParams(**r.params))
        while engine.has_work:
            for o in engine.step():
                for d in o.deltas:
                    out.setdefault(o.request_id, {}).setdefault(d.index, []).extend(d.token_ids)
    return out


def under_load(engine: LLMEngine, reqs: list[Req], rng: random.Random
               ) -> dict[str, dict[int, list[int]]]:
    out: dict[str, dict[int, list[int]]] = {}
    pending, aborts, step = list(reqs), {}, 0
    while pending or engine.has_work:
        if pending and rng.random() < 0.5:
            r = pending.pop(0)
            engine.add_request(r.request_id, r.prompt, SamplingParams(**r.params))
            if r.abort_after is not None:
                aborts[step + r.abort_after] = r.request_id
        if step in aborts:
            engine.abort(aborts.pop(step))
        for o in engine.step():
            for d in o.deltas:
                out.setdefault(o.request_id, {}).setdefault(d.index, []).extend(d.token_ids)
        step += 1
        assert step < 5_000
    return out


def loaded_engine(runner: str, **kw) -> LLMEngine:
    """Six samples' worth of KV for eight seats, chunks of 96 (48 for a long prompt)."""
    spec = SpeculativeConfig(method="ngram", num_spec_tokens=3)
    return LLMEngine(EngineConfig(model="default", runner=runner, enforce_eager=True,
                                  max_model_len=1024, kv_cache_memory=kw.pop("kv"),
                                  max_num_seqs=8, max_num_batched_tokens=96,
                                  long_prefill_token_threshold=CHUNK, **kw),
                     speculator=speculator_for(spec))


@pytest.mark.usefixtures("torch_threads_restored")
def test_torch_runner_under_load_equals_each_request_alone():
    rng = random.Random(3)
    engine = loaded_engine("torch", kv=14 << 20)  # 19 blocks of 16 tokens
    reqs = scenario(engine.tokenizer, rng, 12)
    got = under_load(engine, reqs, rng)
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.allocator.stats.hits > 0
    ref = LLMEngine(EngineConfig(model="default", runner="torch", enforce_eager=True,
                                 enable_prefix_caching=False, kv_cache_memory=64 << 20),
                    share_weights=engine)
    expect = alone(ref, reqs)
    for r in reqs:
        if r.abort_after is None:
            assert got[r.request_id] == expect[r.request_id], r
        else:  # what an aborted request got before its abort is what it would have got
            for k, tokens in got.get(r.request_id, {}).items():
                assert tokens == expect[r.request_id][k][:len(tokens)], r
    assert engine.scheduler.allocator.num_used == 0


@pytest.mark.skipif(not llama_cpp_available(), reason="needs llama-cpp-python")
@pytest.mark.usefixtures("torch_threads_restored")
@pytest.mark.parametrize("streams", [False, True], ids=["unified", "kv-streams"])
def test_llama_cpp_runner_under_load_finishes_every_request_with_all_its_tokens(monkeypatch,
                                                                                 streams):
    """On one unified cache (preempting: 8 MiB for 8 seats) and with a KV stream per
    sequence (what auto gives this model by default; here 4 streams, cached prefixes
    through host memory, sequences moved down between steps)."""
    rng = random.Random(1)
    from engine.runners import llamacpp_handoff

    # a float32 copy (no AVX512-BF16) takes these prompts and tails too, as a bf16 one does
    monkeypatch.setattr(llamacpp_handoff, "FLOAT32_MIN_TOKENS", 0)
    kv = 4 * 1024 * 30 * 3 * 128 * 2 if streams else 8 << 20  # 4 streams of 1,024 cells
    engine = loaded_engine("llamacpp", kv=kv, torch_prefill_tokens=128, kv_streams=streams)
    assert (engine.runner.streams is not None) == streams  # type: ignore[attr-defined]
    handoff = engine.runner.handoff  # None without oneDNN
    tails: list[int] = []  # cache hits whose tails went to torch
    if handoff is not None:
        real = type(handoff).begin_after
        monkeypatch.setattr(type(handoff), "begin_after", lambda self, seq_id, past: (
            tails.append(seq_id), real(self, seq_id, past))[1])
    reqs = scenario(engine.tokenizer, rng, 24, long_questions=0.3)
    got = under_load(engine, reqs, rng)
    assert (streams or engine.scheduler.num_preemptions > 0) and \
        engine.scheduler.allocator.stats.hits > 0
    assert handoff is None or tails
    for r in reqs:
        if r.abort_after is None:
            assert [len(got[r.request_id][k]) for k in range(r.params.get("n", 1))] == \
                [r.params["max_new_tokens"]] * r.params.get("n", 1), r
    assert engine.scheduler.allocator.num_used == 0
    assert handoff is None or not any(s in handoff for s in range(200))
