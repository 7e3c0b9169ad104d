"""Incremental detokenization and stop handling (engine/detokenizer.py, engine/stop_checker.py).

Uses the real default-model tokenizer (byte-level BPE), so multi-byte characters really
are split over several tokens. The reference text is always the tokenizer's own ``decode``
of the kept ids (without clean-up heuristics, which the incremental path never applies).
"""

from __future__ import annotations

import random

import pytest

from engine.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer, backend_decode
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams
from engine.stop_checker import AppendResult, OutputState

TEXTS = [
    "Hello, world! How are you today?",
    "naïve café résumé — déjà vu, Ærøskøbing, São Paulo",
    "日本語のテキストです。中文也可以。한국어도 됩니다.",
    "emoji 😀👍🏽👨‍👩‍👧 🇫🇷 done 🎉",
    "def f(x):\n    return x  # ok\n\n\tprint(f(1))",
    "  leading  spaces\tand tabs , and . odd ' spacing ",
    "Math: ∑ᵢ xᵢ² ≤ ∞ ± ε → ∀x∈ℝ",
]


def decode(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.step(t) for t in ids]


@pytest.fixture(scope="module")
def partial_ids(tokenizer) -> list[int]:
    """Tokens whose text ends in an incomplete (or invalid) UTF-8 sequence."""
    return [i for i in range(len(tokenizer)) if decode(tokenizer, [i]).endswith("\ufffd")]


@pytest.fixture(scope="module")
def special_ids(tokenizer) -> list[int]:
    return sorted(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)


def random_ids(rng: random.Random, n: int, vocab: int, partial: list[int],
               special: list[int]) -> list[int]:
    """Random tokens, biased towards byte fragments and special tokens."""
    out = []
    for _ in range(n):
        r = rng.random()
        out.append(rng.choice(partial) if r < 0.4 else
                   rng.choice(special) if r < 0.45 else rng.randrange(vocab))
    return out


class CountingTokenizer:
    """Wraps a tokenizer to record how many ids each ``decode`` call gets."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls = 0
        self.longest = 0

    def decode(self, ids, **kw):
        self.calls += 1
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, **kw)


# ---- detokenizer ----------------------------------------------------------------------


def test_tokenizer_splits_multibyte_characters(tokenizer, partial_ids):
    """Guard: the texts really exercise characters spread over several tokens."""
    ids = [t for text in TEXTS for t in tokenizer.encode(text)]
    assert any(t in set(partial_ids) for t in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_decode_without_prompt(tokenizer, text):
    ids = tokenizer.encode(text)
    pieces = stream(IncrementalDetokenizer(tokenizer, []), ids)
    assert "".join(pieces) == decode(tokenizer, ids) == text
    assert not any("\ufffd" in p for p in pieces)  # never half a character


def test_incomplete_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("a😀")
    assert len(ids) >= 3  # 'a' plus the emoji's four bytes over several tokens
    pieces = stream(IncrementalDetokenizer(tokenizer, []), ids)
    assert pieces[0] == "a" and pieces[-1] == "😀"
    assert all(p == "" for p in pieces[1:-1])


@pytest.mark.parametrize("text", TEXTS)
def test_stream_with_prompt_equals_decode_suffix(tokenizer, text):
    """Every split of the ids into prompt and output, including splits inside a character."""
    ids = tokenizer.encode(text)
    for cut in range(len(ids) + 1):
        prompt, out = ids[:cut], ids[cut:]
        detok = IncrementalDetokenizer(tokenizer, prompt)
        got = "".join(stream(detok, out)) + detok.flush()
        assert got == decode(tokenizer, ids)[len(decode(tokenizer, prompt)):], cut


def test_first_token_keeps_leading_space(tokenizer):
    prompt = tokenizer.encode("The answer is")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert detok.step(tokenizer.encode(" forty")[0]).startswith(" ")


def test_random_ids_stream_equals_decode(tokenizer, partial_ids, special_ids):
    """Random ids (lots of byte fragments): what step() emits is always a prefix of the
    full decode, and with flush() at the end it is all of it, with or without prompt."""
    rng = random.Random(0)
    for _ in range(400):
        prompt = random_ids(rng, rng.randint(0, 8), len(tokenizer), partial_ids, special_ids)
        out = random_ids(rng, rng.randint(0, 40), len(tokenizer), partial_ids, special_ids)
        for p in ([], prompt):
            detok = IncrementalDetokenizer(tokenizer, p)
            expected = decode(tokenizer, p + out)[len(decode(tokenizer, p)):]
            streamed = "".join(stream(detok, out))
            assert expected.startswith(streamed)
            assert streamed + detok.flush() == expected
            assert detok.flush() == ""


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hi there") + [eos] + tokenizer.encode(" again") + [eos]
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
    pieces = stream(detok, ids)
    assert "".join(pieces) + detok.flush() == decode(tokenizer, ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(pieces)) is not skip


@pytest.mark.parametrize("garbage", [False, True])
def test_cost_per_token_is_a_small_window(tokenizer, partial_ids, special_ids, garbage):
    """A long output is never re-decoded: every decode sees a short window of ids."""
    if garbage:
        ids = random_ids(random.Random(1), 3000, len(tokenizer), partial_ids, special_ids)
    else:
        ids = tokenizer.encode(" ".join(TEXTS) * 20)
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, tokenizer.encode("some prompt " * 50))
    got = "".join(stream(detok, ids)) + detok.flush()
    assert got == decode(tokenizer, ids)
    assert counting.longest <= 2 * MAX_PENDING_TOKENS
    assert counting.calls <= 2 * len(ids) + 2


def test_stock_fast_tokenizer_decodes_through_its_rust_backend(tokenizer):
    """The detokenizer calls the Rust decode directly only where transformers' ``decode``
    adds nothing once clean-up is off; a wrapper or an overridden ``decode`` keeps its own
    (the other tests' streams equal ``tokenizer.decode`` through both paths)."""
    assert backend_decode(tokenizer) == tokenizer.backend_tokenizer.decode
    assert backend_decode(CountingTokenizer(tokenizer)) is None

    class Custom(type(tokenizer)):
        def decode(self, *args, **kwargs):
            return "custom"

    custom = Custom.__new__(Custom)
    custom.__dict__.update(tokenizer.__dict__)
    assert backend_decode(custom) is None
    assert IncrementalDetokenizer(custom, []).step(tokenizer.encode(" hi")[0]) == "custom"


# ---- stop handling --------------------------------------------------------------------


def make_state(tokenizer, max_new_tokens: int = 100, prompt: list[int] | None = None,
               **params) -> OutputState:
    sp = SamplingParams(max_new_tokens=max_new_tokens, **params)
    detok = IncrementalDetokenizer(tokenizer, prompt or [], sp.skip_special_tokens)
    return OutputState(sp, detok, {tokenizer.eos_token_id})


def run(state: OutputState, chunks: list[list[int]]) -> AppendResult:
    """Feed ``chunks`` until the sequence finishes (abort if it has not); merge results."""
    total = AppendResult([], "")
    for chunk in chunks:
        res = state.append(chunk)
        total.token_ids += res.token_ids
        total.text += res.text
        if res.finish_reason is not None:
            total.finish_reason, total.stop_sequence = res.finish_reason, res.stop_sequence
            return total
    res = state.finish(FinishReason.ABORTED)
    total.text += res.text
    total.finish_reason = res.finish_reason
    return total


def one_by_one(ids: list[int]) -> list[list[int]]:
    return [[t] for t in ids]


def test_no_stop_strings_nothing_held(tokenizer):
    state = make_state(tokenizer)
    ids = tokenizer.encode("Hello world, and more")
    assert "".join(state.append([t]).text for t in ids) == "Hello world, and more"


def test_stop_string_spanning_tokens(tokenizer):
    ids = tokenizer.encode("Hello world and more")
    assert len(tokenizer.encode("lo wo")) > 1
    state = make_state(tokenizer, stop=["lo wo"])
    results = [state.append([t]) for t in ids[:2]]  # "Hello", " world"
    assert [r.finish_reason for r in results] == [None, FinishReason.STOP_SEQUENCE]
    assert "".join(r.text for r in results) == "Hel"
    assert results[-1].stop_sequence == "lo wo"
    assert state.num_tokens == 2
    with pytest.raises(RuntimeError):
        state.append(ids[2:])


def test_stop_string_inside_multi_token_append_drops_the_rest(tokenizer):
    ids = tokenizer.encode("one two three four five")
    state = make_state(tokenizer, stop=[" thr"])
    res = state.append(ids)
    assert res.finish_reason is FinishReason.STOP_SEQUENCE and res.stop_sequence == " thr"
    assert res.text == "one two"
    assert res.token_ids == ids[:3]  # up to the token that completed the match
    assert state.num_tokens == 3


def test_include_stop_sequence(tokenizer):
    ids = tokenizer.encode("one two three four five")
    state = make_state(tokenizer, stop=[" thr"], include_stop_sequence=True)
    res = run(state, one_by_one(ids))
    assert res.text == "one two thr"
    assert res.token_ids == ids[:3]


def test_earliest_stop_string_wins(tokenizer):
    ids = tokenizer.encode("the cat sat on the mat")
    state = make_state(tokenizer, stop=["mat", "on", "sat"])
    res = state.append(ids)
    assert (res.text, res.stop_sequence) == ("the cat ", "sat")
    # Same start, both completed by the token " sat": the shorter one ends first.
    state = make_state(tokenizer, stop=["sat", "sa"], include_stop_sequence=True)
    res = state.append(ids)
    assert (res.text, res.stop_sequence) == ("the cat sa", "sa")


def test_stop_string_not_matched_again_in_old_text(tokenizer):
    """A stop string only counts if it ends in newly decoded text (checked once)."""
    ids = tokenizer.encode("xx stop yy")
    assert decode(tokenizer, ids[:2]) == "xx stop" and len(ids) > 2
    state = make_state(tokenizer, stop=["stop"], min_new_tokens=2)  # " yy" could stop
    res = run(state, [ids])
    assert res.finish_reason is FinishReason.ABORTED
    assert res.text == "xx stop yy"


def test_eos(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Done here")
    state = make_state(tokenizer, stop=["zzz"])
    res = state.append(ids + [eos] + ids)
    assert res.finish_reason is FinishReason.EOS
    assert res.token_ids == ids + [eos]
    assert res.text == "Done here"
    assert state.num_tokens == len(ids) + 1


def test_ignore_eos(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Done here")
    seq = ids + [eos] + ids
    state = make_state(tokenizer, max_new_tokens=len(seq), ignore_eos=True)
    res = state.append(seq)
    assert res.finish_reason is FinishReason.LENGTH
    assert res.token_ids == seq
    assert res.text == "Done hereDone here"


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_ids(tokenizer, include):
    ids = tokenizer.encode("alpha beta gamma delta")
    stop_id = ids[2]
    state = make_state(tokenizer, stop_token_ids=[stop_id], include_stop_sequence=include)
    res = run(state, one_by_one(ids))
    assert res.finish_reason is FinishReason.STOP_TOKEN and res.stop_sequence is None
    assert res.token_ids == ids[:3]
    assert res.text == decode(tokenizer, ids[:3] if include else ids[:2])


def test_length_exactly_at_max(tokenizer):
    ids = tokenizer.encode("a b c d e f")
    state = make_state(tokenizer, max_new_tokens=3)
    results = [state.append([t]) for t in ids[:3]]
    assert [r.finish_reason for r in results] == [None, None, FinishReason.LENGTH]
    assert "".join(r.text for r in results) == decode(tokenizer, ids[:3])

    res = make_state(tokenizer, max_new_tokens=3).append(ids)
    assert res.finish_reason is FinishReason.LENGTH and res.token_ids == ids[:3]

    # EOS as the last allowed token is an EOS finish, not LENGTH.
    state = make_state(tokenizer, max_new_tokens=3)
    res = state.append(ids[:2] + [tokenizer.eos_token_id])
    assert res.finish_reason is FinishReason.EOS


def test_held_back_text_released_at_finish(tokenizer):
    ids = tokenizer.encode("Say Hello")
    state = make_state(tokenizer, stop=["Hello world"])
    res = state.append(ids)
    assert res.finish_reason is None
    assert res.text == "Say "  # "Hello" may start the stop string: held back
    assert state.finish(FinishReason.ABORTED).text == "Hello"

    state = make_state(tokenizer, max_new_tokens=len(ids), stop=["Hello world"])
    res = state.append(ids)
    assert (res.finish_reason, res.text) == (FinishReason.LENGTH, "Say Hello")


def test_only_possible_stop_prefixes_are_held(tokenizer):
    state = make_state(tokenizer, stop=["###"])
    assert state.append(tokenizer.encode("plain text")).text == "plain text"
    assert state.append(tokenizer.encode(" then #")).text == " then "
    assert state.append(tokenizer.encode("!")).text == "#!"


@pytest.mark.parametrize("reason", [FinishReason.ABORTED, FinishReason.TIME_LIMIT,
                                    FinishReason.ERROR])
def test_external_finish_flushes(tokenizer, reason):
    ids = tokenizer.encode("wait for it 😀")
    state = make_state(tokenizer, stop=["it 😀!"])
    assert decode(tokenizer, ids[:-1]).endswith("\ufffd")
    streamed = state.append(ids[:-1]).text  # emoji incomplete, "it " held back
    assert streamed == "wait for "
    res = state.finish(reason)
    assert (res.finish_reason, res.token_ids) == (reason, [])
    assert streamed + res.text == decode(tokenizer, ids[:-1])  # ends in U+FFFD, like decode
    with pytest.raises(RuntimeError):
        state.finish(reason)


def test_min_new_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    a, b, c, d = tokenizer.encode(" one two three four")
    # EOS and stop ids among the first min_new_tokens tokens are ordinary tokens.
    state = make_state(tokenizer, min_new_tokens=3, stop_token_ids=[b])
    res = state.append([a, b, eos, c, eos])
    assert res.finish_reason is FinishReason.EOS
    assert res.token_ids == [a, b, eos, c, eos]
    assert res.text == " one two three"
    # A stop string ending within the first min_new_tokens tokens does not match ...
    state = make_state(tokenizer, min_new_tokens=2, stop=["two"])
    assert run(state, [[a, b, c, d]]).finish_reason is FinishReason.ABORTED
    # ... one ending after them does, even if it started before.
    state = make_state(tokenizer, min_new_tokens=2, stop=["o three"])
    res = run(state, one_by_one([a, b, c, d]))
    assert (res.finish_reason, res.text, res.token_ids) == (
        FinishReason.STOP_SEQUENCE, " one tw", [a, b, c])


def test_streaming_equals_one_shot(tokenizer, partial_ids, special_ids):
    """Random splits of a token list into appends give the same tokens, text and reason
    as one append of the whole list; streamed text is never more than the final text."""
    rng = random.Random(2)
    eos = tokenizer.eos_token_id
    stop_pool = [" the", "e t", "😀", "é", "o", "\n\n", "，", "ab", " and more text"]
    sequences = [tokenizer.encode(t) for t in TEXTS]
    sequences += [random_ids(rng, 30, len(tokenizer), partial_ids, special_ids)
                  for _ in range(20)]
    for trial in range(300):
        ids = list(rng.choice(sequences))
        if rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids) + 1), eos)
        params = dict(
            max_new_tokens=rng.randint(max(1, len(ids) - 3), len(ids) + 3),
            stop=rng.sample(stop_pool, rng.randint(0, 3)),
            stop_token_ids=rng.sample(ids, 1) if rng.random() < 0.2 else [],
            include_stop_sequence=rng.random() < 0.5,
            ignore_eos=rng.random() < 0.2,
            skip_special_tokens=rng.random() < 0.8,
        )
        params["min_new_tokens"] = rng.randint(0, min(4, params["max_new_tokens"]))
        whole = run(make_state(tokenizer, **params), [ids])
        cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(0, len(ids) - 1)))
        chunks = [ids[i:j] for i, j in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
        split = run(make_state(tokenizer, **params), chunks)
        assert split == whole, (trial, params)
        skip = params["skip_special_tokens"]
        kept = whole.token_ids
        if whole.finish_reason is FinishReason.STOP_SEQUENCE:
            assert decode(tokenizer, kept, skip).startswith(whole.text)
            assert whole.text.endswith(whole.stop_sequence) is params["include_stop_sequence"]
        else:
            if whole.finish_reason is FinishReason.EOS or (
                    whole.finish_reason is FinishReason.STOP_TOKEN
                    and not params["include_stop_sequence"]):
                kept = kept[:-1]
            assert whole.text == decode(tokenizer, kept, skip), (trial, params)


def test_long_output_keeps_small_state(tokenizer):
    """Stop handling keeps a bounded tail, not the whole text."""
    ids = tokenizer.encode(" ".join(TEXTS) * 30)
    state = make_state(tokenizer, max_new_tokens=len(ids) + 1, stop=["never appears!"])
    text = "".join(state.append([t]).text for t in ids)
    assert len(state._tail) <= len("never appears!") - 1
    assert text + state.finish(FinishReason.ABORTED).text == decode(tokenizer, ids)
