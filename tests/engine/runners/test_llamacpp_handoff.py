"""The llama.cpp runner's torch prefill (``--torch-prefill-tokens``) on the real default
GGUF: a long prompt prefilled by torch (bf16, or float32 on a CPU without AVX512-BF16) and
handed to llama.cpp decodes the same
greedy tokens as llama.cpp's own prefill, while a short request decodes in the same
steps; its blocks are cached once handed over (a later prompt hits them, same output);
a hit whose uncached tail is long prefills the tail in torch over the cached KV read out of
llama.cpp (same output); an abort mid-prefill leaves nothing behind; a hand-over in the
wrong K layout is caught by the start-up probe."""

from __future__ import annotations

import pytest
import torch

import specdecode.worker
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loading import weights_cache
from engine.loading.model_loader import resolve_model
from engine.runners import llamacpp_handoff, llamacpp_host_blocks
from engine.runners.select import llama_cpp_available
from engine.sampling_params import SamplingParams
from specdecode.config import SpeculativeConfig
from specdecode.worker import speculator_for
from tests.engine.long_prefill import prompt_of
from tests.engine.test_engine import run_to_completion


def _torch_prefill_cpu() -> bool:
    return llama_cpp_available() and torch.backends.mkldnn.is_available()


pytestmark = [pytest.mark.skipif(not _torch_prefill_cpu(),
                                 reason="needs llama-cpp-python and torch with oneDNN"),
              pytest.mark.usefixtures("torch_threads_restored")]

LONG = 600  # tokens: chunks of 256, 512 while alone
MID = 200  # tokens: over the default threshold (128), one chunk
MAX_NEW = 24


def config(**kw) -> EngineConfig:
    base = dict(model="default", runner="llamacpp", max_model_len=2048,
                kv_cache_memory=256 << 20, max_num_seqs=8, threads=2)
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    """bf16 on a CPU with AVX512-BF16, else float32, whose copy takes only prompts from
    ``FLOAT32_MIN_TOKENS`` by default: here from the flag's 128, as a bf16 copy does."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llamacpp_handoff, "FLOAT32_MIN_TOKENS", 0)
        return LLMEngine(config())


@pytest.fixture(scope="module")
def own() -> LLMEngine:
    return LLMEngine(config(torch_prefill_tokens=0))


@pytest.fixture(scope="module")
def long_ids(engine) -> list[int]:
    return prompt_of(engine.tokenizer, LONG)


@pytest.fixture
def handovers(engine, monkeypatch) -> list[int]:
    """Bytes of each KV handed to llama.cpp in the test."""
    sizes: list[int] = []
    real = llamacpp_handoff.set_seq_state

    def counted(lc, ctx, slot, data):
        sizes.append(len(data))
        real(lc, ctx, slot, data)

    monkeypatch.setattr(llamacpp_handoff, "set_seq_state", counted)
    return sizes


def test_a_handed_over_prompt_decodes_as_llama_cpps_own_prefill_beside_a_short_one(
        engine, own, long_ids, handovers):
    assert engine.runner.handoff is not None and own.runner.handoff is None
    short = engine.tokenizer("The capital of France is")["input_ids"]
    arrivals = {0: [("short", short, greedy(40))], 2: [("long", long_ids, greedy())]}
    got = run_to_completion(engine, arrivals)
    ref = run_to_completion(own, arrivals)
    assert len(handovers) == 1  # the long prompt's, not the short one's
    assert got["long"][0].token_ids == ref["long"][0].token_ids
    # The short one's tokens of the steps it shared with the long prompt's torch chunks
    # (its rows and torch's assembled into one step's logits); later it decodes beside the
    # long one, whose batch mates differ by mode, and near-ties may move (the default is
    # not batch invariant)
    assert got["short"][0].token_ids[:8] == ref["short"][0].token_ids[:8]
    assert len(got["short"][0].token_ids) == 40
    assert engine.scheduler.allocator.num_used == 0


def test_a_mid_length_prompt_takes_the_torch_prefill_by_default(engine, own, handovers):
    """Prompts from 128 tokens prefill in torch (it was the faster prefill from there up);
    the decoded tokens are llama.cpp's own."""
    assert engine.config.torch_prefill_tokens == EngineConfig.torch_prefill_tokens == 128
    ids = prompt_of(engine.tokenizer, MID, "Ships sail out of the harbour at dawn. ")
    got = run_to_completion(engine, {0: [("r", ids, greedy())]})["r"][0].token_ids
    ref = run_to_completion(own, {0: [("r", ids, greedy())]})["r"][0].token_ids
    assert len(handovers) == 1 and got == ref
    assert engine.scheduler.allocator.num_used == 0


def test_a_float32_copy_takes_only_prompts_from_float32_min_tokens(engine, own, handovers,
                                                                   monkeypatch):
    """Without AVX512-BF16 the copy is float32, and it pays from ~100 tokens
    (llamacpp_handoff.FLOAT32_MIN_TOKENS, 128); shorter prompts and tails stay llama.cpp's,
    and with no shorter-tail-over-long-context rule (measured for bf16 only)."""
    from engine.loading.model_loader import resolve_model

    assert llamacpp_handoff.FLOAT32_MIN_TOKENS == 128
    prefill = llamacpp_handoff.load_torch_prefill(resolve_model("default"), 2, True, 2048,
                                                  torch.float32)
    assert prefill.min_tokens == 128 and next(prefill.model.parameters()).dtype == \
        torch.float32
    monkeypatch.setattr(engine.runner.handoff, "min_tokens", prefill.min_tokens)
    short = prompt_of(engine.tokenizer, 100, "Bees carry pollen from flower to flower. ")
    got = run_to_completion(engine, {0: [("r", short, greedy())]})["r"][0].token_ids
    assert handovers == []  # 100 tokens: llama.cpp's own prefill
    ref = run_to_completion(own, {0: [("r", short, greedy())]})["r"][0].token_ids
    assert got == ref
    # a prompt no other test ran (a cached one would hit the prefix cache, not prefill)
    long = prompt_of(engine.tokenizer, LONG, "Wolves roam the northern forests in winter. ")
    got = run_to_completion(engine, {0: [("r", long, greedy())]})["r"][0].token_ids
    assert len(handovers) == 1  # 600 tokens: handed over
    ref = run_to_completion(own, {0: [("r", long, greedy())]})["r"][0].token_ids
    assert got == ref


def test_blocks_are_cached_once_handed_over_and_a_later_prompt_hits_them(engine, own,
                                                                        handovers):
    ids = prompt_of(engine.tokenizer, LONG, "Rivers carry sand and stones from the hills. ")
    engine.add_request("first", ids, greedy(4))
    pending_seen = []
    while engine.has_work:
        seqs = list(engine.scheduler.running)
        pending_seen += [engine.runner.block_keeper.kv_pending(s.seq_id) for s in seqs]
        engine.step()
    assert any(pending_seen) and len(handovers) == 1
    tail = prompt_of(engine.tokenizer, 30,
                     "Now a question about all of that, asked in some more words? ")
    prompt = ids[:-40] + tail  # shares the first's blocks up to 560 tokens
    engine.add_request("second", prompt, greedy())
    usage, tokens = None, []
    while engine.has_work:
        for out in engine.step():
            tokens += [t for d in out.deltas for t in d.token_ids]
            usage = out.usage if out.finished else usage
    assert usage is not None and usage.cached_prompt_tokens >= 512
    # the hit prefilled only its tail, in llama.cpp: 30 rows over 590 tokens are below
    # where torch pays (worth_torch)
    assert not llamacpp_handoff.worth_torch(len(prompt) - usage.cached_prompt_tokens,
                                            len(prompt), engine.config.torch_prefill_tokens)
    assert len(handovers) == 1
    ref = run_to_completion(own, {0: [("r", prompt, greedy())]})["r"][0].token_ids
    assert tokens == ref


def _generate(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens and cached prompt tokens of one request run alone."""
    engine.add_request(request_id, prompt, greedy())
    usage, tokens = None, []
    while engine.has_work:
        for out in engine.step():
            tokens += [t for d in out.deltas for t in d.token_ids]
            usage = out.usage if out.finished else usage
    assert usage is not None
    return tokens, usage.cached_prompt_tokens


@pytest.mark.parametrize("placed", [True, False], ids=["handed-over", "llama.cpp-refuses"])
def test_a_hit_with_a_long_tail_prefills_it_in_torch_over_the_cached_kv(
        engine, own, handovers, monkeypatch, placed):
    """A prompt that finds 560 cached tokens and adds 100: the tail runs in torch over
    the cached prefix's KV read out of llama.cpp's cells, and only the tail's cells are
    handed over (shared into the sequence after its cached ones); greedy output equals
    llama.cpp's own prefill of the whole prompt. When llama.cpp cannot place the tail's
    state, llama.cpp prefills the tail instead (same output)."""
    story = "Lanterns glow along the canal when the evening boats come in. "
    ids = prompt_of(engine.tokenizer, LONG, story + ("" if placed else "Again. "))
    _generate(engine, "first", ids)  # prefilled in torch, cached once handed over
    assert len(handovers) == 1
    if not placed:
        real = llamacpp_handoff.set_seq_state

        def refuse_tails(lc, ctx, slot, data):
            if slot != engine.runner._kept.host.scratch:
                return real(lc, ctx, slot, data)
            raise RuntimeError("llama.cpp did not take a handed-over KV")

        monkeypatch.setattr(llamacpp_handoff, "set_seq_state", refuse_tails)
    tail = prompt_of(engine.tokenizer, 100, "A long follow-up question, asked with care, "
                     "about each of the things described above, one by one? ")
    prompt = ids[:-40] + tail
    tokens, cached = _generate(engine, "second", prompt)
    assert cached >= 512
    assert llamacpp_handoff.worth_torch(len(prompt) - cached, len(prompt),
                                        engine.config.torch_prefill_tokens)
    if placed:
        first_size, tail_size = handovers
        assert tail_size < first_size * (len(prompt) - cached + 1) / len(ids)  # the tail
    else:
        assert len(handovers) == 1
    ref = run_to_completion(own, {0: [("r", prompt, greedy())]})["r"][0].token_ids
    assert tokens == ref
    # and the sequence's whole KV is llama.cpp's to cache: a third prompt hits all of it
    _, cached_again = _generate(engine, "third", prompt[:-3] + tail[:3])
    assert cached_again >= len(prompt) - 16 - 3
    assert engine.scheduler.allocator.num_used == 0
    assert not any(s in engine.runner.handoff for s in range(100))


def test_an_abort_mid_tail_leaves_no_torch_cache_and_the_prefix_still_cached(engine, own):
    """A 600-token tail after a cached prompt runs in torch over two steps (512 tokens
    alone, then the rest); aborted after the first, nothing is left in torch or held, and
    the next prompt with that prefix still hits it (same output as llama.cpp's own)."""
    ids = prompt_of(engine.tokenizer, 300, "Foxes den under the roots of old oaks. ")
    _generate(engine, "first", ids)
    long_tail = prompt_of(engine.tokenizer, 600, "Then a long letter, read aloud. ")
    engine.add_request("gone", ids[:288] + long_tail, greedy())
    engine.step()
    seq = next(iter(engine.scheduler.running))
    assert seq.seq_id in engine.runner.handoff
    assert engine.runner.handoff.first_position(seq.seq_id) == 288
    engine.abort("gone")
    while engine.has_work:
        engine.step()
    assert seq.seq_id not in engine.runner.handoff
    assert engine.scheduler.allocator.num_used == 0
    prompt = ids[:288] + long_tail[:40]
    tokens, cached = _generate(engine, "again", prompt)
    assert cached == 288
    assert tokens == run_to_completion(own, {0: [("r", prompt, greedy())]})["r"][0].token_ids


def test_the_cached_prefix_read_back_into_torch_is_the_kv_torch_wrote(engine):
    """State -> HF cache is the exact inverse of the hand-over's HF cache -> state, up to
    the f16 llama.cpp keeps (bf16 values below f16's normal range lose bits there); K's
    rotary pairs go back to halves."""
    prefill = engine.runner.handoff
    ids = engine.runner.tokenize("Owls hunt mice in the fields by night. " * 4)
    prefill.run(-5, ids, 0, 0)
    before = [(layer.keys.clone(), layer.values.clone())
              for layer in prefill._caches[-5].layers]
    state = prefill.state(-5)
    prefill.drop(-5)
    prefill.begin_after(-6, llamacpp_host_blocks.parse_state(state))
    try:
        after = prefill._caches[-6].layers
        assert prefill.first_position(-6) == len(ids)
        for (k, v), layer in zip(before, after, strict=True):
            for got, want in ((layer.keys, k), (layer.values, v)):
                assert torch.equal(got, want.to(torch.float16).to(want.dtype))
    finally:
        prefill.drop(-6)


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "ngram"])
def test_a_prompt_whose_last_chunk_is_its_last_token_finishes_the_hand_over(
        engine, own, handovers, monkeypatch, speculate):
    """513 tokens alone: a 512-token chunk in torch, then the last prompt token, which the
    step runs as a decode row (with n-gram proposals after it when speculating). That row
    ends the hand-over: it once met llama.cpp cells that were never filled and crashed the
    engine loop (found by a soak: "a chunk at position 512 after only 0 cached positions")."""
    ids = prompt_of(engine.tokenizer, 513, "Clouds drift over the valley in the late day. ")
    ends = []
    real = llamacpp_handoff.TorchPrefill.run

    def run(self, seq_id, token_ids, start_pos, num_logits):
        if num_logits:
            ends.append((start_pos, len(token_ids), num_logits))
        return real(self, seq_id, token_ids, start_pos, num_logits)

    monkeypatch.setattr(llamacpp_handoff.TorchPrefill, "run", run)
    target = engine
    if speculate:  # proposing whenever the n-gram finds any (not only where it pays)
        monkeypatch.setattr(specdecode.worker, "worth_proposing", lambda k, alpha, cost: k)
        monkeypatch.setattr(llamacpp_handoff, "FLOAT32_MIN_TOKENS", 0)  # as ``engine``
        target = LLMEngine(config(), speculator=speculator_for(
            SpeculativeConfig(method="ngram", num_spec_tokens=3)))
        handovers.clear()  # its start-up probe's
        ends.clear()
    got = run_to_completion(target, {0: [("r", ids, greedy())]})["r"][0].token_ids
    ref = run_to_completion(own, {0: [("r", ids, greedy())]})["r"][0].token_ids
    assert got == ref and len(handovers) == 1
    assert ends[0][:2] == (512, ends[0][2])  # the last token and its proposals
    assert (ends[0][2] > 1) == speculate
    assert not any(s in target.runner.handoff for s in range(100))
    assert target.scheduler.allocator.num_used == 0


def test_an_abort_mid_prefill_leaves_no_torch_cache_and_no_blocks(engine, handovers):
    ids = prompt_of(engine.tokenizer, LONG, "Bees visit flowers all day in the warm sun. ")
    engine.add_request("gone", ids, greedy())  # a prompt no earlier test cached
    engine.step()  # alone: its first chunk is 512 of its 600 tokens
    seq = next(iter(engine.scheduler.running))
    assert seq.seq_id in engine.runner.handoff
    engine.abort("gone")
    while engine.has_work:
        engine.step()
    assert seq.seq_id not in engine.runner.handoff and not handovers
    assert engine.scheduler.allocator.num_used == 0


def test_a_state_llama_cpp_cannot_place_is_prefilled_by_llama_cpp_instead(engine, own,
                                                                         monkeypatch):
    """llama.cpp restores a state into one run of free cells only: when it refuses (a
    fragmented cache), the prompt is prefilled by llama.cpp and the output is the same."""
    def refuse(lc, ctx, slot, data):
        raise RuntimeError("llama.cpp did not take a handed-over KV")

    monkeypatch.setattr(llamacpp_handoff, "set_seq_state", refuse)
    ids = prompt_of(engine.tokenizer, LONG, "Snow falls on the high mountain passes in winter. ")
    got = run_to_completion(engine, {0: [("r", ids, greedy())]})["r"][0].token_ids
    ref = run_to_completion(own, {0: [("r", ids, greedy())]})["r"][0].token_ids
    assert got == ref and engine.scheduler.allocator.num_used == 0
    assert not any(s in engine.runner.handoff for s in range(100))


def test_a_model_whose_torch_copy_does_not_fit_starts_without_it_and_converts_nothing(
        engine, own, tmp_path, monkeypatch, caplog):
    """With too little memory for converting the .gguf to float32 (a Llama 3 8B would
    need ~64 GiB; the default model ~1 GiB, so 600 MiB here), the runner starts without
    the torch prefill, saying why, and converts no weights: its HF tokenizer and configs
    go into a tokenizer entry (no weights), which the next start reads; it serves as
    before."""
    from engine.runners import requantize

    monkeypatch.setenv("GENSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(llamacpp_handoff, "available_memory", lambda: 600 << 20)
    # a bf16 copy's 270 MB fit there (a float32 one's 540 MB would not, whatever the
    # conversion needs): the conversion is what is refused
    monkeypatch.setattr(requantize, "cpu_has_bf16_gemm", lambda lc: True)
    with caplog.at_level("INFO"):
        small = LLMEngine(config(requantize="none"))
    assert small.runner.handoff is None
    assert "--torch-prefill-tokens off: converting the .gguf" in caplog.text
    entries = list(tmp_path.glob("SmolLM2*"))
    assert [e.name.endswith(weights_cache.TOKENIZER_SUFFIX) for e in entries] == [True]
    assert not list(entries[0].glob("*.safetensors"))
    rebuilt: list = []  # a second start reads that entry, converting nothing
    monkeypatch.setattr(weights_cache, "convert_tokenizer", lambda *a: rebuilt.append(a))
    again = LLMEngine(config(requantize="none", kv_cache_memory=16 << 20))
    assert again.runner.handoff is None and not rebuilt
    assert again.tokenizer.vocab == small.tokenizer.vocab
    text = "Rivers carry sand, stones and 42 boats down to the sea."
    assert small.tokenizer(text)["input_ids"] == engine.tokenizer(text)["input_ids"]
    assert small.runner.eos_token_ids() == engine.runner.eos_token_ids()
    ids = prompt_of(engine.tokenizer, MID, "Kites rise over the dunes in the wind. ")
    got = run_to_completion(small, {0: [("r", ids, greedy())]})["r"][0].token_ids
    assert len(got) == MAX_NEW


@pytest.mark.parametrize("available, cached, why", [
    (None, False, None),  # memory unknown: only the disk is checked
    (8 << 30, False, None),
    (200 << 20, True, "bf16 copy would keep"),  # 270 MB resident > half of 200 MiB
    (600 << 20, True, None),  # converted already: only the resident copy counts
    (600 << 20, False, "converting the .gguf"),
], ids=["unknown", "plenty", "resident", "cached", "converting"])
def test_the_torch_copys_memory_is_checked_before_it_is_made(engine, monkeypatch, available,
                                                             cached, why):
    monkeypatch.setattr(weights_cache, "cached_model_dir",
                        lambda gguf, build=True: gguf.parent if cached else None)
    n = engine.runner.llama_cpp.llama_model_n_params(engine.runner.model)
    got = llamacpp_handoff.memory_problem(n, resolve_model("default"), available)
    assert (got is None) if why is None else (why in got), got


def test_a_float32_copy_is_counted_at_four_bytes_a_parameter(engine, monkeypatch):
    monkeypatch.setattr(weights_cache, "cached_model_dir", lambda gguf, build=True: gguf.parent)
    n = engine.runner.llama_cpp.llama_model_n_params(engine.runner.model)
    source = resolve_model("default")
    assert llamacpp_handoff.memory_problem(n, source, 800 << 20) is None  # bf16: 270 MB
    got = llamacpp_handoff.memory_problem(n, source, 800 << 20, torch.float32)
    assert got is not None and "float32 copy would keep 0.5 GiB" in got


def test_the_start_up_probe_refuses_a_hand_over_in_the_wrong_k_layout(engine):
    prefill = engine.runner.handoff
    wrong = llamacpp_handoff.TorchPrefill(prefill.model, prefill.threads,
                                          not prefill.rope_pairs)
    text = engine.runner.tokenize("The river carries sand and stones to the sea. " * 8)
    why = llamacpp_handoff.probe(wrong, engine.runner, text[:llamacpp_handoff.PROBE_TOKENS])
    assert why is not None and "differ from llama.cpp's own" in why
    assert llamacpp_handoff.probe(prefill, engine.runner,
                                  text[:llamacpp_handoff.PROBE_TOKENS]) is None


def test_with_a_kv_stream_per_sequence_a_handed_over_prompt_decodes_as_llama_cpps_own(
        own, long_ids, handovers):
    """--kv-streams: llama.cpp's sequence states then list every stream (all but the
    sequence's own empty); the probe reads that layout and the hand-over writes it, into
    the sequence's own stream, beside a short request in the next one. A later prompt that
    finds the cached prefix (written into its stream from host memory) has its long tail
    prefilled in torch, and the stream rewritten with prefix and tail."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llamacpp_handoff, "FLOAT32_MIN_TOKENS", 0)
        streams = LLMEngine(config(kv_streams=True, max_num_seqs=4))
    handoff = streams.runner.handoff
    assert handoff is not None and handoff.streams == 4
    handovers.clear()  # the start-up probe's
    short = streams.tokenizer("The capital of France is")["input_ids"]
    arrivals = {0: [("short", short, greedy(40))], 2: [("long", long_ids, greedy())]}
    got = run_to_completion(streams, arrivals)
    ref = run_to_completion(own, arrivals)
    assert len(handovers) == 1
    assert got["long"][0].token_ids == ref["long"][0].token_ids
    assert got["short"][0].token_ids[:8] == ref["short"][0].token_ids[:8]
    tail = prompt_of(streams.tokenizer, 100, "A long follow-up question, asked with care, "
                     "about each of the things described above, one by one? ")
    prompt = long_ids[:-40] + tail
    tokens, cached = _generate(streams, "second", prompt)
    assert cached >= 512 and len(handovers) == 2
    assert tokens == run_to_completion(own, {0: [("r", prompt, greedy())]})["r"][0].token_ids
    assert streams.scheduler.allocator.num_used == 0
