"""The TGIS API (fmaas.GenerationService) over real gRPC, with stubs generated from the
upstream proto, on a tiny random model, checked against genserve.v1 on the same server."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from fmaas import generation_pb2 as tgis
from fmaas import generation_pb2_grpc as tgis_grpc
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from service.tgis_params import LengthPenalty
from service.validation import ServiceLimits
from tests.service.conftest import start_server, stop_server

Code = grpc.StatusCode
MAX_MODEL_LEN = 128
CAP = 64  # --max-new-tokens
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(tiny_model_dir, structured_outputs):
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_model_dir),
                                                  max_model_len=MAX_MODEL_LEN))
    running, _ = start_server(engine, ServiceLimits(default_max_new_tokens=16,
                                                    max_new_tokens=CAP, max_batch_size=8),
                              structured_outputs=structured_outputs)
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def fm(channel):
    return tgis_grpc.GenerationServiceStub(channel)


@pytest.fixture(scope="module")
def native(channel):
    return pb_grpc.GenerationServiceStub(channel)


def params(max_new=8, **kw) -> tgis.Parameters:
    stopping = kw.pop("stopping", tgis.StoppingCriteria(max_new_tokens=max_new))
    return tgis.Parameters(stopping=stopping, **kw)


def generate(fm, texts, p: tgis.Parameters, **kw) -> list[tgis.GenerationResponse]:
    req = tgis.BatchedGenerationRequest(
        requests=[tgis.GenerationRequest(text=t) for t in texts], params=p, **kw)
    return list(fm.Generate(req, timeout=60).responses)


def stream(fm, text, p: tgis.Parameters) -> list[tgis.GenerationResponse]:
    req = tgis.SingleGenerationRequest(request=tgis.GenerationRequest(text=text), params=p)
    return list(fm.GenerateStream(req, timeout=60))


def native_text(native, prompt, max_new, **stopping) -> pb.Completion:
    resp = native.Generate(pb.GenerateRequest(
        prompt=prompt, stopping=pb.StoppingCriteria(max_new_tokens=max_new, **stopping),
        output=pb.OutputOptions(return_token_ids=True)), timeout=60)
    return resp.completions[0]


def test_greedy_batch_matches_native_in_order(fm, native):
    texts = [PROMPT, "Hello there", "1, 2, 3,"]
    responses = generate(fm, texts, params(8, stopping=tgis.StoppingCriteria(
        max_new_tokens=8, min_new_tokens=8)))
    for text, r in zip(texts, responses, strict=True):
        c = native_text(native, text, 8, min_new_tokens=8)
        assert r.text == c.text
        assert r.generated_token_count == 8 and r.stop_reason == tgis.MAX_TOKENS
        assert r.input_token_count == len(native.Tokenize(pb.TokenizeRequest(text=text)).token_ids)
        assert r.seed == 0  # greedy: no seed


def test_input_text_prepends_the_prompt(fm):
    (plain,) = generate(fm, [PROMPT], params(4))
    (with_input,) = generate(fm, [PROMPT], params(4, response=tgis.ResponseOptions(
        input_text=True)))
    assert with_input.text == PROMPT + plain.text


def test_stream_sends_input_details_then_one_message_per_delta(fm):
    p = params(6, stopping=tgis.StoppingCriteria(max_new_tokens=6, min_new_tokens=6),
               response=tgis.ResponseOptions(input_text=True, generated_tokens=True,
                                             input_tokens=True))
    msgs = stream(fm, PROMPT, p)
    head, deltas = msgs[0], msgs[1:]
    (unary,) = generate(fm, [PROMPT], params(6, stopping=tgis.StoppingCriteria(
        max_new_tokens=6, min_new_tokens=6)))
    assert head.input_token_count == unary.input_token_count
    assert head.text == PROMPT and head.generated_token_count == 0
    assert len(head.input_tokens) == head.input_token_count
    # one message a step's token, except that a client behind the engine gets what piled
    # up as one message (engine/async_engine.py): counts rise by each message's tokens
    counts = [m.generated_token_count for m in deltas]
    assert counts[-1] == 6 and counts == sorted(set(counts))
    assert [len(m.tokens) for m in deltas] == [b - a for a, b in zip([0, *counts], counts,
                                                                     strict=False)]
    assert all(m.stop_reason == tgis.NOT_FINISHED for m in deltas[:-1])
    assert deltas[-1].stop_reason == tgis.MAX_TOKENS
    assert "".join(m.text for m in deltas) == unary.text


def test_token_info_matches_native_logprobs(fm, native):
    p = params(5, stopping=tgis.StoppingCriteria(max_new_tokens=5, min_new_tokens=5),
               response=tgis.ResponseOptions(generated_tokens=True, input_tokens=True,
                                             token_logprobs=True, token_ranks=True,
                                             top_n_tokens=3))
    (r,) = generate(fm, [PROMPT], p)
    resp = native.Generate(pb.GenerateRequest(
        prompt=PROMPT, stopping=pb.StoppingCriteria(max_new_tokens=5, min_new_tokens=5),
        output=pb.OutputOptions(logprobs=True, top_logprobs=3, prompt_logprobs=True)),
        timeout=60)
    ours = resp.completions[0].logprobs
    assert [t.text for t in r.tokens] == [lp.text for lp in ours]
    for info, lp in zip(r.tokens, ours, strict=True):
        assert info.logprob == pytest.approx(lp.logprob)
        assert info.rank == lp.rank == 1  # greedy
        assert [t.text for t in info.top_tokens] == [t.text for t in lp.top]
        assert [t.logprob for t in info.top_tokens] == pytest.approx([t.logprob for t in lp.top])
    # input tokens: the first has text only, the rest carry the prompt logprobs
    assert len(r.input_tokens) == len(resp.prompt_logprobs) + 1
    assert r.input_tokens[0].logprob == 0 and r.input_tokens[0].rank == 0
    for info, lp in zip(r.input_tokens[1:], resp.prompt_logprobs, strict=True):
        assert info.text == lp.text and info.rank == lp.rank >= 1
        assert info.logprob == pytest.approx(lp.logprob)
        assert len(info.top_tokens) == 3


def test_token_detail_without_logprobs_is_text_only(fm):
    (r,) = generate(fm, [PROMPT], params(3, response=tgis.ResponseOptions(
        generated_tokens=True, token_ranks=True)))
    assert len(r.tokens) == r.generated_token_count
    assert all(t.logprob == 0 and t.rank >= 1 and not t.top_tokens for t in r.tokens)


def test_token_limit_when_the_context_cuts_the_output(fm, tokenizer):
    long = "word " * 120
    n = len(tokenizer(long)["input_ids"])
    assert MAX_MODEL_LEN - n < CAP
    (r,) = generate(fm, [long], params(0, stopping=tgis.StoppingCriteria(
        min_new_tokens=1)))  # 0 = the cap (64), more than the room left
    assert r.stop_reason == tgis.TOKEN_LIMIT
    assert r.generated_token_count == MAX_MODEL_LEN - n
    (asked,) = generate(fm, [PROMPT], params(0, stopping=tgis.StoppingCriteria(
        min_new_tokens=CAP)))
    assert asked.stop_reason == tgis.MAX_TOKENS and asked.generated_token_count == CAP


def test_stop_sequence_reason_and_include_flag(fm, native):
    free = native_text(native, PROMPT, 24, min_new_tokens=24).text
    stop = free[len(free) // 2:len(free) // 2 + 2]
    stopping = dict(max_new_tokens=24, min_new_tokens=1, stop_sequences=[stop])
    (default,) = generate(fm, [PROMPT], params(stopping=tgis.StoppingCriteria(**stopping)))
    assert default.stop_reason == tgis.STOP_SEQUENCE and default.stop_sequence == stop
    assert default.text == free[:free.index(stop) + len(stop)]  # server default: included
    (excluded,) = generate(fm, [PROMPT], params(stopping=tgis.StoppingCriteria(
        include_stop_sequence=False, **stopping)))
    assert excluded.text == free[:free.index(stop)]


def test_eos_reason_names_the_eos_token(fm, tokenizer):
    # guided choice ends in EOS right after the choice
    (r,) = generate(fm, [PROMPT], params(16, decoding=tgis.DecodingParameters(
        choice=tgis.DecodingParameters.StringChoices(choices=["yes", "no"]))))
    assert r.text in ("yes", "no")
    assert r.stop_reason == tgis.EOS_TOKEN and r.stop_sequence == tokenizer.eos_token


def test_time_limit(fm):
    (r,) = generate(fm, [PROMPT], params(stopping=tgis.StoppingCriteria(
        max_new_tokens=CAP, min_new_tokens=CAP, time_limit_millis=1)))
    assert r.stop_reason == tgis.TIME_LIMIT and r.generated_token_count < CAP


def test_length_penalty_ends_the_output_early(fm):
    stopping = tgis.StoppingCriteria(max_new_tokens=32)
    (free,) = generate(fm, [PROMPT], params(stopping=stopping))
    (r,) = generate(fm, [PROMPT], params(stopping=stopping, decoding=tgis.DecodingParameters(
        length_penalty=tgis.DecodingParameters.LengthPenalty(start_index=2,
                                                              decay_factor=10.0))))
    assert r.stop_reason == tgis.EOS_TOKEN and r.generated_token_count <= 6
    assert free.generated_token_count > r.generated_token_count


def test_length_penalty_boosts_eos_exponentially_after_start_index():
    proc = LengthPenalty(start_index=2, decay_factor=2.0, eos_token_ids=[0])
    logits = torch.tensor([-3.0, 1.0])
    assert torch.equal(proc([], [5, 6], logits), logits)  # not past start_index yet
    assert proc([], [5, 6, 7], logits).tolist() == [-3.0 + 3.0 * (2 - 1), 1.0]
    assert proc([], [5, 6, 7, 8], logits).tolist() == [-3.0 + 3.0 * (4 - 1), 1.0]


def test_length_penalty_saturates_instead_of_overflowing():
    """decay 10 (TGIS's maximum) past 308 tokens overflowed Python's float: the processor
    raised OverflowError and the request ended with ERROR mid-output. Now EOS's growth
    stops at e**80: finite and decisive."""
    proc = LengthPenalty(start_index=0, decay_factor=10.0, eos_token_ids=[0])
    out = proc([], [5] * 400, torch.tensor([-3.0, 20.0, 0.0]))
    assert torch.isfinite(out).all() and out.argmax() == 0 and out[0] > 1e30
    zero = proc([], [5] * 400, torch.tensor([0.0, 1.0]))  # |0| * growth: no boost, as TGIS
    assert zero.tolist() == [0.0, 1.0]


def test_sampling_echoes_a_seed_that_replays_the_call(fm):
    p = params(8, method=tgis.SAMPLE, sampling=tgis.SamplingParameters(temperature=1.5))
    (first,) = generate(fm, [PROMPT], p)
    assert first.seed > 0
    p.sampling.seed = first.seed
    (again,) = generate(fm, [PROMPT], p)
    assert again.text == first.text and again.seed == first.seed


def test_greedy_ignores_sampling_fields(fm):
    (greedy,) = generate(fm, [PROMPT], params(6))
    (r,) = generate(fm, [PROMPT], params(6, sampling=tgis.SamplingParameters(
        temperature=0.01, top_p=7.0, seed=3)))  # would be invalid when sampling
    assert r.text == greedy.text and r.seed == 0


def test_sample_with_temperature_zero_is_greedy(fm):
    (greedy,) = generate(fm, [PROMPT], params(6))
    (r,) = generate(fm, [PROMPT], params(6, method=tgis.SAMPLE,
                                         sampling=tgis.SamplingParameters(temperature=0)))
    assert r.text == greedy.text


def test_guided_json_schema_output_validates(fm):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    (r,) = generate(fm, [PROMPT], params(64, decoding=tgis.DecodingParameters(
        json_schema=json.dumps(schema))))
    assert r.stop_reason == tgis.EOS_TOKEN
    jsonschema.validate(json.loads(r.text), schema)
    (j,) = generate(fm, [PROMPT], params(64, decoding=tgis.DecodingParameters(
        format=tgis.DecodingParameters.JSON)))
    if j.stop_reason == tgis.EOS_TOKEN:
        json.loads(j.text)
    (rx,) = generate(fm, [PROMPT], params(16, decoding=tgis.DecodingParameters(
        regex="[0-9]{3}")))
    assert len(rx.text) == 3 and rx.text.isdigit()


def test_tokenize_counts_offsets_and_truncation_match_generate(fm, tokenizer):
    texts = [PROMPT, "Café au lait, s'il vous plaît"]
    resp = fm.Tokenize(tgis.BatchedTokenizeRequest(
        requests=[tgis.TokenizeRequest(text=t) for t in texts], return_tokens=True,
        return_offsets=True), timeout=30)
    for text, r in zip(texts, resp.responses, strict=True):
        ids = tokenizer(text)["input_ids"]
        assert r.token_count == len(ids) == len(r.tokens) == len(r.offsets)
        assert r.tokens == tokenizer.convert_ids_to_tokens(ids)
        assert r.offsets[0].start == 0 and r.offsets[-1].end == len(text)
        (g,) = generate(fm, [text], params(1))
        assert g.input_token_count == r.token_count
    trunc = fm.Tokenize(tgis.BatchedTokenizeRequest(
        requests=[tgis.TokenizeRequest(text=texts[1])], return_tokens=True,
        return_offsets=True, truncate_input_tokens=3), timeout=30).responses[0]
    full = resp.responses[1]
    assert trunc.token_count == 3
    assert list(trunc.tokens) == list(full.tokens[-3:])
    assert [(o.start, o.end) for o in trunc.offsets] == [(o.start, o.end)
                                                        for o in full.offsets[-3:]]
    (g,) = generate(fm, [texts[1]], params(1, truncate_input_tokens=3))
    assert g.input_token_count == 3


def test_model_info(fm):
    info = fm.ModelInfo(tgis.ModelInfoRequest(model_id="anything"), timeout=30)
    assert info.model_kind == tgis.ModelInfoResponse.DECODER_ONLY
    assert info.max_sequence_length == MAX_MODEL_LEN and info.max_new_tokens == CAP


def test_model_id_is_ignored(fm):
    (a,) = generate(fm, [PROMPT], params(4), model_id="some-other-model")
    (b,) = generate(fm, [PROMPT], params(4))
    assert a.text == b.text


def test_correlation_id_names_the_request(native):
    resp = native.Generate(pb.GenerateRequest(prompt=PROMPT, stopping=pb.StoppingCriteria(
        max_new_tokens=2)), metadata=[("x-correlation-id", "corr-42")], timeout=30)
    assert resp.request_id == "corr-42"


def test_health_and_reflection_name_both_services(server, channel):
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "genserve.v1.GenerationService", "fmaas.GenerationService"):
        status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING, name
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    (answer,) = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")]), timeout=10)
    names = {s.name for s in answer.list_services_response.service}
    assert {"genserve.v1.GenerationService", "fmaas.GenerationService"} <= names


BAD = [
    (params(stopping=tgis.StoppingCriteria(max_new_tokens=CAP + 1)), "max_new_tokens must be <="),
    (params(stopping=tgis.StoppingCriteria(max_new_tokens=4, min_new_tokens=5)),
     "min_new_tokens must be <= max_new_tokens"),
    (params(stopping=tgis.StoppingCriteria(max_new_tokens=4, stop_sequences=["a"] * 7)),
     "at most 6 non-empty stop sequences"),
    (params(stopping=tgis.StoppingCriteria(max_new_tokens=4, stop_sequences=[""])),
     "at most 6 non-empty stop sequences"),
    (params(stopping=tgis.StoppingCriteria(max_new_tokens=4, stop_sequences=["x" * 241])),
     "each not more than 240"),
    (params(response=tgis.ResponseOptions(generated_tokens=True, top_n_tokens=11)),
     "top_n_tokens (11) must be <= 10"),
    (params(response=tgis.ResponseOptions(token_logprobs=True)),
     "must request input and/or generated tokens"),
    (params(method=tgis.SAMPLE, sampling=tgis.SamplingParameters(temperature=0.01)),
     "temperature must be >= 0.05"),
    (params(method=tgis.SAMPLE, sampling=tgis.SamplingParameters(top_p=1.5)),
     "top_p must be > 0.0 and <= 1.0"),
    (params(method=tgis.SAMPLE, sampling=tgis.SamplingParameters(typical_p=1.5)),
     "typical_p must be"),
    (params(decoding=tgis.DecodingParameters(repetition_penalty=2.5)),
     "repetition_penalty must be > 0.0 and <= 2.0"),
    (params(decoding=tgis.DecodingParameters(length_penalty=tgis.DecodingParameters.
                                             LengthPenalty(start_index=1, decay_factor=0.5))),
     "length_penalty.decay_factor must be >= 1.0 and <= 10.0"),
    (params(decoding=tgis.DecodingParameters(json_schema="{not json")), "json_schema"),
    (params(decoding=tgis.DecodingParameters(regex=" ")), "regex must not be empty"),
    (params(stopping=tgis.StoppingCriteria(max_new_tokens=4, min_new_tokens=CAP - 1)),
     "min_new_tokens must be <= max_new_tokens"),
]


@pytest.mark.parametrize(("p", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_parameters_are_invalid_argument(fm, p, message):
    with pytest.raises(grpc.RpcError) as e:
        generate(fm, [PROMPT], p)
    assert e.value.code() == Code.INVALID_ARGUMENT
    assert message in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stream(fm, PROMPT, p)
    assert e.value.code() == Code.INVALID_ARGUMENT


def test_bad_requests_are_invalid_argument(fm):
    cases = [
        (tgis.BatchedGenerationRequest(requests=[tgis.GenerationRequest(text=PROMPT)],
                                       adapter_id="my-lora", params=params(4)),
         "adapter_id: adapter 'my-lora': adapters are not enabled on this server"),
        (tgis.BatchedGenerationRequest(requests=[tgis.GenerationRequest(text=PROMPT)],
                                       prefix_id="my-prompt", params=params(4)),
         "prefix_id: prompt-tuning prefixes are not supported"),
        (tgis.BatchedGenerationRequest(params=params(4)), "requests must not be empty"),
        (tgis.BatchedGenerationRequest(requests=[tgis.GenerationRequest(text="")] * 1,
                                       params=params(4)), "prompt is empty"),
        (tgis.BatchedGenerationRequest(
            requests=[tgis.GenerationRequest(text=PROMPT),
                      tgis.GenerationRequest(text="word " * 200)], params=params(4)),
         "requests[1]: input tokens"),
        (tgis.BatchedGenerationRequest(
            requests=[tgis.GenerationRequest(text="word " * 100)],
            params=params(stopping=tgis.StoppingCriteria(max_new_tokens=60,
                                                         min_new_tokens=60))),
         "plus min_new_tokens (60) must be <= 128"),
        (tgis.BatchedGenerationRequest(requests=[tgis.GenerationRequest(text=PROMPT)] * 9,
                                       params=params(4)), "the limit is 8"),
    ]
    for request, message in cases:
        with pytest.raises(grpc.RpcError) as e:
            fm.Generate(request, timeout=30)
        assert e.value.code() == Code.INVALID_ARGUMENT, message
        assert message in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        fm.Tokenize(tgis.BatchedTokenizeRequest(adapter_id="x"), timeout=30)
    assert e.value.code() == Code.INVALID_ARGUMENT


def test_disabled_prompt_logprobs(tiny_model_dir, tokenizer):
    """--disable-prompt-logprobs: refused on the native API; TGIS input tokens are text only."""
    from tests.service.fake_engine import FakeEngine

    engine = FakeEngine(tokenizer, EngineConfig(model=str(tiny_model_dir)))
    running, _ = start_server(engine, ServiceLimits(prompt_logprobs=False), structured=None)
    try:
        with grpc.insecure_channel(running.address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.GenerationServiceStub(ch).Generate(pb.GenerateRequest(
                    prompt=PROMPT, output=pb.OutputOptions(prompt_logprobs=True)), timeout=10)
            assert e.value.code() == Code.INVALID_ARGUMENT
            assert "--disable-prompt-logprobs" in e.value.details()
            (r,) = generate(tgis_grpc.GenerationServiceStub(ch), [PROMPT], params(
                2, response=tgis.ResponseOptions(input_tokens=True, token_logprobs=True)))
            assert [t.text for t in r.input_tokens] == tokenizer.convert_ids_to_tokens(
                tokenizer(PROMPT)["input_ids"])
            assert all(t.logprob == 0 for t in r.input_tokens)
    finally:
        stop_server(running)


def test_no_fmaas_serves_only_the_native_api(tiny_model_dir, tokenizer):
    from tests.service.fake_engine import FakeEngine

    engine = FakeEngine(tokenizer, EngineConfig(model=str(tiny_model_dir)))
    running, _ = start_server(engine, fmaas=False, structured=None)
    try:
        with grpc.insecure_channel(running.address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                tgis_grpc.GenerationServiceStub(ch).ModelInfo(tgis.ModelInfoRequest(),
                                                              timeout=10)
            assert e.value.code() == Code.UNIMPLEMENTED
            health = health_pb2_grpc.HealthStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                health.Check(health_pb2.HealthCheckRequest(service="fmaas.GenerationService"),
                             timeout=10)
            assert e.value.code() == Code.NOT_FOUND
    finally:
        stop_server(running)


def test_guided_output_failing_its_schema_check_stops_with_error(server, fm, monkeypatch):
    """A leniently served schema whose output fails the check: stop reason ERROR, the
    text kept (TGIS has no error field), unary and streamed alike."""
    import dataclasses

    import engine.llm_engine

    schema = json.dumps({"enum": ["yes", "no"]})
    p = params(16, decoding=tgis.DecodingParameters(json_schema=schema))
    (r,) = generate(fm, [PROMPT], p)
    assert r.stop_reason == tgis.EOS_TOKEN
    real_bind = engine.llm_engine.bind

    def failing_check(entry):  # every checked factory's sequences fail their check, so
        bound = real_bind(entry)  # whichever cached or fresh grammar serves the request
        if bound.check is None:
            return bound
        return dataclasses.replace(bound, check=lambda text: "forced failure")

    monkeypatch.setattr(engine.llm_engine, "bind", failing_check)
    (r,) = generate(fm, [PROMPT], p)
    assert r.stop_reason == tgis.ERROR and r.text in ('"yes"', '"no"')
    assert stream(fm, PROMPT, p)[-1].stop_reason == tgis.ERROR
