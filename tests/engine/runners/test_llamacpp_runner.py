"""The llama.cpp runner on the real default GGUF: the engine's greedy output equals
llama.cpp's own greedy generation token for token (alone, staggered, chunked, preempted,
n > 1), speculation leaves it unchanged, grammars hold, a failing processor fails only its
own sequence. Skipped where llama-cpp-python is not installed."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loading.model_loader import default_model_path
from engine.outputs import FinishReason
from engine.runners.llamacpp import INVARIANT_TYPE_V, INVARIANT_UBATCH, UBATCH
from engine.runners.requantize import requantized_path
from engine.runners.select import choose_runner, llama_cpp_available
from engine.sampling_params import SamplingParams
from specdecode.config import SpeculativeConfig
from specdecode.worker import speculator_for
from tests.engine.long_prefill import (
    alone,
    prompt_of,
    short_during_long_prefill,
    time_short_during_long_prefill,
)
from tests.engine.test_engine import run_to_completion
from tests.engine.test_processors import RaiseFactory

pytestmark = [pytest.mark.skipif(not llama_cpp_available(),
                                 reason="llama-cpp-python is not installed"),
              pytest.mark.usefixtures("torch_threads_restored")]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4,",
    "Q: What is the boiling point of water?\nA:",
]
COPY_PROMPT = ("Repeat this list exactly: apples, bananas, cherries, dates, elderberries, "
               "figs, grapes, honeydew, kiwis, lemons, mangoes.\nList: apples, bananas,")
MAX_NEW = 24
THREADS = 1  # robust on a busy machine: 2 spinning threads on 2 shared cores crawl
STREAM = 1024 * 30 * 3 * 64 * 2 * 2  # 1,024 cells x 30 layers x 3 KV heads of 64, K+V f16
KV = 6 * STREAM  # --batch-invariant: six sequences at once, each in a stream of its own


def config(**kw) -> EngineConfig:
    base = dict(model="default", runner="llamacpp", max_model_len=1024, kv_cache_memory=KV,
                max_num_seqs=16, threads=THREADS, batch_invariant=True,  # the shipped
                requantize="none")  # file, in ubatches of 63, as the reference runs it
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(config())


@pytest.fixture(scope="module")
def ids(engine) -> list[list[int]]:
    return [engine.tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(ids) -> list[list[int]]:
    """llama.cpp's own greedy generation (``Llama.generate`` at temperature 0)."""
    import llama_cpp

    # flash attention as the runner's context runs it (llama.cpp's "auto": on for CPU)
    llm = llama_cpp.Llama(default_model_path(), n_ctx=1024, n_threads=THREADS,
                          flash_attn=True, n_ubatch=INVARIANT_UBATCH, type_v=INVARIANT_TYPE_V,
                          verbose=False)  # as ours
    out = [list(itertools.islice(llm.generate(p, temp=0.0, reset=True), MAX_NEW))
           for p in ids]
    llm.close()
    return out


def tokens(results, rid: str, index: int = 0) -> list[int]:
    return results[rid][index].token_ids


def test_auto_picks_llamacpp_for_a_gguf_on_cpu_and_torch_otherwise(tiny_model_dir):
    assert choose_runner(EngineConfig(model="default")) == "llamacpp"
    assert choose_runner(EngineConfig(model=str(tiny_model_dir))) == "torch"
    assert choose_runner(EngineConfig(model="default", runner="torch")) == "torch"
    with pytest.raises(ValueError, match="needs a .gguf"):
        choose_runner(EngineConfig(model=str(tiny_model_dir), runner="llamacpp"))
    with pytest.raises(ValueError, match="runs on the CPU"):
        choose_runner(EngineConfig(model="default", runner="llamacpp", device="cuda"))


def test_model_info_names_the_runner_and_the_hf_tokenizer_matches_llama_vocab(engine, ids):
    assert engine.info.runner == "llamacpp" and engine.info.quantization == "Q4_1"
    assert engine.info.vocab_size == len(engine.tokenizer)
    for text, mine in zip(PROMPTS, ids, strict=True):
        assert engine.runner.tokenize(text) == mine  # type: ignore[attr-defined]


def test_the_cost_of_a_verify_row_is_measured_outside_the_serving_context(engine):
    runner = engine.runner
    # Q4_1 on a CPU: an extra row of a sequence costs a real share of a step (0.6 here);
    # the serving context holds no cell of the timing
    assert 0.05 < runner.row_cost <= 2.0
    lc = runner.llama_cpp  # type: ignore[attr-defined]
    for slot in range(engine.config.max_num_seqs):
        assert lc.llama_memory_seq_pos_max(runner.memory, slot) == -1  # type: ignore[attr-defined]


def test_greedy_alone_matches_llama_cpp_generate(engine, ids, reference):
    for i, p in enumerate(ids):
        res = run_to_completion(engine, {0: [(f"a{i}", p, greedy())]})
        assert tokens(res, f"a{i}") == reference[i], f"prompt {i}"
    assert engine.scheduler.allocator.num_used == 0


def test_by_default_q4_1_runs_as_a_cached_q8_0_copy_in_512_token_ubatches(ids):
    """No --batch-invariant, --requantize auto: the shipped Q4_1 runs requantised to Q8_0
    (cached on disk: a second engine reuses the copy), and greedy output alone equals
    llama.cpp's own on that copy with the same ubatch."""
    import llama_cpp

    default = LLMEngine(config(batch_invariant=False, requantize="auto"))
    runner = default.runner
    assert default.info.quantization == "Q8_0"
    assert runner.requantized_from == "Q4_1"  # type: ignore[attr-defined]
    copy = requantized_path(Path(default_model_path()).resolve(), "Q8_0")
    assert runner.path == str(copy)  # type: ignore[attr-defined]
    assert llama_cpp.llama_n_ubatch(runner.ctx) == UBATCH  # type: ignore[attr-defined]
    llm = llama_cpp.Llama(str(copy), n_ctx=1024, n_threads=THREADS, flash_attn=True,
                          n_ubatch=UBATCH, verbose=False)
    want = [list(itertools.islice(llm.generate(p, temp=0.0, reset=True), MAX_NEW))
            for p in ids[:2]]
    llm.close()
    for i, p in enumerate(ids[:2]):
        res = run_to_completion(default, {0: [(f"q{i}", p, greedy())]})
        assert tokens(res, f"q{i}") == want[i], f"prompt {i}"


def test_greedy_staggered_and_n2_match(engine, ids, reference):
    arrivals = {2 * i: [(f"s{i}", p, greedy())] for i, p in enumerate(ids)}
    arrivals[1] = [("n2", ids[0], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True,
                                                 n=2))]
    res = run_to_completion(engine, arrivals)
    for i in range(len(ids)):
        assert tokens(res, f"s{i}") == reference[i], f"prompt {i}"
    assert tokens(res, "n2", 0) == tokens(res, "n2", 1) == reference[0]


def test_greedy_with_chunked_prefill_and_more_requests_than_kv_streams_matches(ids, reference):
    # 7-token budget: every prompt prefills in chunks; the KV budget holds two streams of a
    # whole 1,024-cell sequence (--batch-invariant), so two run at once and the rest wait.
    tight = LLMEngine(config(max_num_batched_tokens=7, kv_cache_memory=STREAM * 5 // 2))
    assert tight.config.max_num_seqs == tight.scheduler.max_num_seqs == 2
    running: list[int] = []
    step = tight.step

    def counting():
        running.append(len(tight.scheduler.running))
        return step()

    tight.step = counting  # type: ignore[method-assign]
    res = run_to_completion(tight, {0: [(f"c{i}", p, greedy()) for i, p in enumerate(ids)]})
    assert max(running) == 2
    for i in range(len(ids)):
        assert tokens(res, f"c{i}") == reference[i], f"prompt {i}"
        assert res[f"c{i}"][0].finish_reason is FinishReason.LENGTH
    assert tight.scheduler.allocator.num_used == 0


@pytest.mark.parametrize("scorer", ["batch_expansion", "multi_token"])
def test_ngram_speculation_keeps_greedy_output(engine, scorer):
    # One sequence: its rejected proposals' cells are freed at its own tail, so its KV stays
    # in position order (see the README on batch invariance for several at once).
    prompt = engine.tokenizer(COPY_PROMPT)["input_ids"]
    plain = run_to_completion(engine, {0: [("p", prompt, greedy(40))]})
    spec = LLMEngine(config(), speculator=speculator_for(
        SpeculativeConfig(method="ngram", num_spec_tokens=4, scorer=scorer)))
    res = run_to_completion(spec, {0: [("s", prompt, greedy(40))]})
    assert tokens(res, "s") == tokens(plain, "p")
    assert spec.stats().spec.accepted > 0
    assert spec.scheduler.allocator.num_used == 0


def test_draft_model_speculation_keeps_greedy_output(engine):
    """A separate draft model (torch, here the same GGUF dequantised) proposes for the
    llama.cpp target: greedy output unchanged, and most proposals accepted since the draft
    is the target's own weights in fp32."""
    prompt = engine.tokenizer(COPY_PROMPT)["input_ids"]
    plain = run_to_completion(engine, {0: [("p", prompt, greedy(24))]})
    spec = LLMEngine(config(), speculator=speculator_for(
        SpeculativeConfig(method="draft", draft_model="default", num_spec_tokens=3)))
    res = run_to_completion(spec, {0: [("s", prompt, greedy(24))]})
    assert tokens(res, "s") == tokens(plain, "p")
    stats = spec.stats().spec
    assert stats.accepted > stats.proposed // 2
    assert spec.scheduler.allocator.num_used == 0


def test_self_draft_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="self-draft"):
        LLMEngine(config(), speculator=speculator_for(
            SpeculativeConfig(method="draft", draft_model="self:4")))


def test_structured_output_validates(engine):
    from structured.manager import StructuredOutputs
    from structured.spec import StructuredSpec

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    so = StructuredOutputs(engine.tokenizer, engine.info.vocab_size, engine.info.eos_token_ids)
    try:
        factory = asyncio.run(so.factory(StructuredSpec("json_schema", json.dumps(schema))))
        prompt = list(engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Describe a person as JSON."}],
            add_generation_prompt=True, tokenize=True)["input_ids"])
        params = SamplingParams(max_new_tokens=80, logits_processors=[factory])
        res = run_to_completion(engine, {0: [("j", prompt, params)]})
    finally:
        so.close()
    out = json.loads(res["j"][0].text)
    assert set(out) == {"name", "age"} and isinstance(out["age"], int)


def test_a_failing_processor_fails_only_its_sequence(engine, ids):
    # The comparison run ends a healthy sequence at the step the failing one fails (its
    # third), so both runs free the same KV cells at the same step.
    failing = RaiseFactory(3)
    bad = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logits_processors=[failing])
    healthy = [(f"h{i}", p, greedy()) for i, p in enumerate(ids)]
    res = run_to_completion(engine, {0: [("bad", ids[0], bad)] + healthy})
    expected = run_to_completion(engine, {0: [("short", ids[0], greedy(3))] + healthy})
    assert res["bad"][0].finish_reason is FinishReason.ERROR
    assert "boom on call 3" in (res["bad"][0].error or "")
    assert len(tokens(res, "bad")) == 2 and failing.released == 1
    for i in range(len(ids)):
        assert tokens(res, f"h{i}") == tokens(expected, f"h{i}"), f"prompt {i}"
        assert res[f"h{i}"][0].finish_reason is FinishReason.LENGTH
    assert engine.scheduler.allocator.num_used == 0


def test_prompt_logprobs_are_llama_cpps_own(engine, ids):
    """Prompt-logprob rows come back after the sampled rows, as the torch runner orders
    them; their values are llama.cpp's own logits of the prompt."""
    import llama_cpp
    import numpy as np

    prompt = ids[2] + ids[4]
    llm = llama_cpp.Llama(default_model_path(), n_ctx=1024, n_threads=THREADS, flash_attn=True,
                          n_ubatch=INVARIANT_UBATCH, type_v=INVARIANT_TYPE_V, logits_all=True,
                          verbose=False)
    llm.eval(prompt)
    scores = np.asarray(llm.scores[:len(prompt) - 1], dtype=np.float64)
    llm.close()
    lse = np.log(np.exp(scores - scores.max(-1, keepdims=True)).sum(-1)) + scores.max(-1)
    expected = scores[np.arange(len(prompt) - 1), prompt[1:]] - lse
    # Beside another request (still running when the prompt is done: no cells freed
    # meanwhile) and in 7-token chunks, so rows of both kinds share steps.
    chunked = LLMEngine(config(max_num_batched_tokens=7))
    chunked.add_request("other", ids[0], greedy(12))
    chunked.add_request("p", prompt, SamplingParams(max_new_tokens=2, prompt_logprobs=1))
    got = None
    while chunked.has_work:
        for out in chunked.step():
            if out.request_id == "p" and out.prompt_logprobs is not None:
                got = out.prompt_logprobs
    assert got is not None and [t.token_id for t in got] == prompt[1:]
    np.testing.assert_allclose([t.logprob for t in got], expected, atol=1e-4)


def test_seeded_sampling_is_the_same_alone_among_mates_and_with_speculation(engine, ids):
    """A seeded sampled request (temperature 0.7, top-p 0.95) on a copy-heavy prompt emits
    the same tokens alone, among random batch mates, with n-gram speculation of several k,
    and when a crowd turns speculation off for some steps: each output position draws one
    uniform whether or not it speculated (mates that end first and free their cells:
    test_llamacpp_kv_streams.py). At 0.7 the sample keeps copying the list, so proposals
    are accepted on any CPU (at 0.9, seed 11 wandered off the list on an AVX2 EPYC and
    speculation accepted nothing there: the test then proved only the rejection path)."""
    prompt = engine.tokenizer(COPY_PROMPT)["input_ids"]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0.7, top_p=0.95,
                            seed=11)

    def mates(at: int, size: int) -> list[tuple[str, list[int], SamplingParams]]:
        return [(f"m{at}-{i}", ids[i % len(ids)], SamplingParams(
            max_new_tokens=48, ignore_eos=True, temperature=1.0)) for i in range(size)]

    def seeded(eng: LLMEngine, arrivals=None) -> list[int]:
        arrivals = {k: list(v) for k, v in (arrivals or {}).items()}
        arrivals.setdefault(0, []).append(("s", prompt, params))
        return tokens(run_to_completion(eng, arrivals), "s")

    def speculating(k: int, off_above: int = 64) -> LLMEngine:
        eng = LLMEngine(config(), speculator=speculator_for(SpeculativeConfig(
            method="ngram", num_spec_tokens=k, disable_batch_size=off_above)))
        # Verify rows priced free: the pacer would otherwise weigh a row cost timed on
        # this (shared, noisy) machine and may propose for too few steps to test anything.
        eng.runner._row_cost = 0.0  # type: ignore[attr-defined]
        return eng

    alone = seeded(engine)
    other = run_to_completion(engine, {0: [("o", prompt, dataclasses.replace(params, seed=7))]})
    assert tokens(other, "o") != alone  # it really samples
    assert seeded(engine, {0: mates(0, 2), 3: mates(3, 3)}) == alone
    for k in (2, 8):
        spec = speculating(k)
        assert seeded(spec) == alone, f"k={k}"
        assert spec.stats().spec.accepted > 0
    spec = speculating(4, off_above=3)
    off: list[bool] = []
    budgets = spec.speculator.budgets

    def recording(seqs, num_running):
        off.append(num_running > 3)
        return budgets(seqs, num_running)

    spec.speculator.budgets = recording
    assert seeded(spec, {6: mates(6, 3)}) == alone
    assert any(off) and not all(off)  # speculation on for some steps, off for others
    assert spec.stats().spec.accepted > 0
    assert spec.scheduler.allocator.num_used == 0


# No head-of-line blocking on this runner, whose prefill is slow (~4.5 ms a token on 2
# cores): four 128-token chunks, the short request arriving after two (the issue's
# 3,600-token case on the default flags is the next test; 480 keeps this one cheap).
LONG_PROMPT = 480


@pytest.fixture(scope="module")
def long_ids(engine) -> list[int]:
    return prompt_of(engine.tokenizer, LONG_PROMPT)


def test_a_short_request_during_a_long_prefill_gets_its_token_next_step_output_unchanged(
        engine, long_ids, ids):
    """First token one step after it arrives, while the long prompt still prefills (in
    128-token chunks beside the short one); the long request's greedy tokens equal those
    of its prefill as one 1,024-token step (ubatches of 63 keep them batch invariant)."""
    assert engine.scheduler.long_prefill_token_threshold == 128  # this runner's default
    # one step alone (a 256-token chunk: twice the threshold), then the short one comes
    got = short_during_long_prefill(engine, long_ids, greedy(8), ids[1], greedy(4),
                                    after_steps=1)
    assert got.steps_to_first_token == 1 and got.long_prefilling
    whole = LLMEngine(config(long_prefill_token_threshold=0, max_num_batched_tokens=1024))
    assert got.long_tokens == alone(whole, long_ids, greedy(8))
    assert engine.scheduler.allocator.num_used == 0


def test_short_ttft_while_a_3600_token_prompt_prefills_is_within_two_steps_of_idle():
    """The issue's case, on the default configuration (not batch invariant) with room for
    a 3,600-token prompt; the long request is aborted once the short one has its token."""
    long_engine = LLMEngine(config(max_model_len=4096, kv_cache_memory=128 << 20,
                                   batch_invariant=False, requantize="auto"))
    short_ids = prompt_of(long_engine.tokenizer, 16, "Hello there, how are you today? ")
    long_ids = prompt_of(long_engine.tokenizer, 3600,
                         "Rivers carry sand and stones from the hills down to the sea. ")
    t = time_short_during_long_prefill(long_engine, long_ids, short_ids, abort_long=True)
    assert t.short_first, "the short request's first token came after the long prompt's"
    # waits out the step it arrives in, then one step with a chunk; x1.5 for the noise
    assert t.busy_ttft <= t.idle_ttft + 1.5 * 2 * t.step + 0.05, t


def test_llama_errors_keeps_one_log_callback_and_collects_only_its_threads_lines():
    """llama.cpp has one process-wide log callback, called from whichever thread logs. Each
    adapter load used to install its own callback and put the old one back, freeing its
    own while the engine thread's llama_decode could still call it: the server segfaulted
    under adapter churn (a soak, 2 of 2 runs). Now one callback stays installed for good,
    and a block collects the errors of its own thread only."""
    import threading

    import llama_cpp

    import engine.runners.llamacpp as runner_mod
    from engine.runners.llamacpp import llama_errors

    def load_missing() -> None:
        params = llama_cpp.llama_model_default_params()
        assert not llama_cpp.llama_model_load_from_file(b"/no/such/model.gguf", params)

    with llama_errors(llama_cpp) as mine:
        other = threading.Thread(target=load_missing)
        other.start()
        other.join()
    assert mine == []  # another thread's errors are not this block's
    installed = runner_mod._log_callback
    with llama_errors(llama_cpp) as mine:
        load_missing()
    assert any("/no/such/model.gguf" in line for line in mine)
    assert installed is not None and runner_mod._log_callback is installed
