"""parse_request on its own: defaults, clipping, truncation, ids (no server, no engine)."""

from __future__ import annotations

import pytest

from engine.config import ModelInfo
from genserve.v1 import generation_pb2 as pb
from service.validation import InvalidArgument, ServiceLimits, parse_request

LIMITS = ServiceLimits(default_max_new_tokens=32, max_n=4)


@pytest.fixture(scope="module")
def info(tokenizer) -> ModelInfo:
    return ModelInfo("test", max_model_len=128, vocab_size=len(tokenizer),
                     eos_token_ids=[tokenizer.eos_token_id])


def parse(tokenizer, info, **fields):
    return parse_request(pb.GenerateRequest(**fields), tokenizer, info, LIMITS)


def test_defaults_are_greedy_with_the_server_default_length(tokenizer, info):
    p = parse(tokenizer, info, prompt="Hello world")
    assert p.prompt_token_ids == tokenizer("Hello world")["input_ids"]
    assert p.params.temperature == 0.0
    assert p.params.n == 1 and p.params.top_p == 1.0 and p.params.repetition_penalty == 1.0
    assert p.params.max_new_tokens == 32 and p.params.time_limit_s is None
    assert p.params.logits_processors == []


def test_the_default_length_is_clipped_to_the_room_left(tokenizer, info):
    p = parse(tokenizer, info, prompt_token_ids=pb.TokenIds(ids=[1] * 120))
    assert p.params.max_new_tokens == 8


def test_min_new_tokens_past_a_defaulted_maximum_says_where_the_maximum_came_from(
        tokenizer, info):
    """It said "min_new_tokens (10) must be <= max_new_tokens (8)" of a field never sent."""
    with pytest.raises(InvalidArgument) as e:
        parse(tokenizer, info, prompt_token_ids=pb.TokenIds(ids=[1] * 120),
              stopping=pb.StoppingCriteria(min_new_tokens=10))
    assert "min_new_tokens (10) is more than the 8 tokens max_new_tokens defaults to" in \
        str(e.value) and "a 120-token prompt, 8" in str(e.value)


def test_fields_map_onto_sampling_params(tokenizer, info):
    p = parse(tokenizer, info, prompt="hi",
              sampling=pb.SamplingParameters(temperature=0.5, top_k=7, top_p=0.5, seed=3, n=2,
                                             presence_penalty=0.5),
              stopping=pb.StoppingCriteria(max_new_tokens=9, min_new_tokens=2,
                                           stop_sequences=["\n"], stop_token_ids=[5],
                                           ignore_eos=True, time_limit_ms=1500),
              output=pb.OutputOptions(logprobs=True, top_logprobs=2))
    sp = p.params
    assert (sp.temperature, sp.top_k, sp.top_p, sp.seed, sp.n) == (0.5, 7, 0.5, 3, 2)
    assert (sp.max_new_tokens, sp.min_new_tokens, sp.stop, sp.stop_token_ids) == \
        (9, 2, ["\n"], [5])
    assert sp.ignore_eos and sp.time_limit_s == 1.5 and sp.presence_penalty == 0.5
    assert sp.logprobs and sp.top_logprobs == 2


def test_truncation_keeps_the_last_tokens(tokenizer, info):
    ids = list(range(10, 210))
    p = parse(tokenizer, info, prompt_token_ids=pb.TokenIds(ids=ids), truncate_input_tokens=50)
    assert p.prompt_token_ids == ids[-50:]
    with pytest.raises(InvalidArgument, match="truncate_input_tokens"):
        parse(tokenizer, info, prompt_token_ids=pb.TokenIds(ids=ids))


def test_max_new_tokens_past_the_context_names_the_field(tokenizer, info):
    with pytest.raises(InvalidArgument, match=r"stopping\.max_new_tokens"):
        parse(tokenizer, info, prompt_token_ids=pb.TokenIds(ids=[1] * 100),
              stopping=pb.StoppingCriteria(max_new_tokens=29))
    p = parse(tokenizer, info, prompt_token_ids=pb.TokenIds(ids=[1] * 100),
              stopping=pb.StoppingCriteria(max_new_tokens=28))
    assert p.params.max_new_tokens == 28


def test_request_ids_echo_the_client_and_stay_unique_in_the_engine(tokenizer, info):
    a = parse(tokenizer, info, prompt="hi", request_id="mine")
    b = parse(tokenizer, info, prompt="hi", request_id="mine")
    assert a.request_id == b.request_id == "mine"
    assert a.engine_request_id != b.engine_request_id
    assert a.engine_request_id.startswith("mine")
    c = parse(tokenizer, info, prompt="hi")
    assert c.request_id and c.engine_request_id == c.request_id
    with pytest.raises(InvalidArgument, match="request_id"):
        parse(tokenizer, info, prompt="hi", request_id="bad\nid")


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_floats_are_rejected(tokenizer, info, value):
    for name in ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty"):
        with pytest.raises(InvalidArgument, match=rf"^sampling\.{name}"):
            parse(tokenizer, info, prompt="hi",
                  sampling=pb.SamplingParameters(**{name: value}))


def test_a_chat_the_template_rejects_is_invalid_argument(tokenizer, info):
    class Strict:
        chat_template = "x"

        def apply_chat_template(self, *a, **kw):
            raise ValueError("conversation roles must alternate")

    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")] * 2)
    with pytest.raises(InvalidArgument, match="chat.messages.*alternate"):
        parse_request(pb.GenerateRequest(chat=chat), Strict(), info, LIMITS)
