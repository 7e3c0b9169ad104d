"""The gRPC API over real localhost sockets, on the fake engine and on a tiny random model."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from service.server import MOVE_AWAY_MAX_S, GenServer, ServerConfig
from tests.service.conftest import MAX_MODEL_LEN, new_loop, start_server, stop_server, wait_until

Code = grpc.StatusCode


def req(prompt="Hello world", max_new=8, **kw) -> pb.GenerateRequest:
    stopping = kw.pop("stopping", pb.StoppingCriteria(max_new_tokens=max_new, ignore_eos=True))
    return pb.GenerateRequest(prompt=prompt, stopping=stopping, **kw)



def _kv_freed(server) -> bool:
    return wait_until(lambda: server.stats.kv_blocks_used == 0
                      and server.stats.num_requests == 0)


def test_generate_returns_text_tokens_usage(stub):
    resp = stub.Generate(req(request_id="abc", output=pb.OutputOptions(
        return_token_ids=True, return_prompt_token_ids=True)))
    assert resp.request_id == "abc"
    (c,) = resp.completions
    assert c.finish_reason == pb.FINISH_REASON_LENGTH
    assert len(c.token_ids) == 8 and c.text
    assert resp.usage.completion_tokens == 8
    assert resp.usage.prompt_tokens == len(resp.prompt_token_ids) > 0


def test_generate_n_returns_n_completions(stub):
    resp = stub.Generate(req(sampling=pb.SamplingParameters(n=3, temperature=1.0, seed=5)))
    assert [c.index for c in resp.completions] == [0, 1, 2]
    assert resp.usage.completion_tokens == 24


def test_batch_of_16_with_one_invalid_item(stub):
    items = [req(f"prompt number {i}", max_new=4 + i % 3) for i in range(16)]
    items[5] = req("bad", sampling=pb.SamplingParameters(top_p=1.5))
    resp = stub.GenerateBatch(pb.GenerateBatchRequest(requests=items))
    assert [r.index for r in resp.results] == list(range(16))
    for i, r in enumerate(resp.results):
        if i == 5:
            assert r.WhichOneof("outcome") == "error"
            assert r.error.code == Code.INVALID_ARGUMENT.value[0]
            assert "top_p" in r.error.message
        else:
            assert r.WhichOneof("outcome") == "response"
            assert len(r.response.completions[0].text) > 0
            unary = stub.Generate(items[i])
            assert r.response.completions[0].text == unary.completions[0].text


def test_batch_call_level_errors(stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.GenerateBatch(pb.GenerateBatchRequest())
    assert e.value.code() == Code.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        stub.GenerateBatch(pb.GenerateBatchRequest(requests=[req()] * 33))
    assert e.value.code() == Code.INVALID_ARGUMENT and "limit" in e.value.details()


def test_stream_deltas_concatenate_to_the_unary_text(stub):
    r = req("Once upon a time", max_new=20,
            sampling=pb.SamplingParameters(n=2, temperature=0.8, seed=3))
    unary = stub.Generate(r)
    texts, finished, usage = {0: "", 1: ""}, {}, None
    msgs = list(stub.GenerateStream(pb.GenerateStreamRequest(request=r)))
    for m in msgs:
        assert m.index not in finished, "delta after the completion's final message"
        texts[m.index] += m.text
        if m.finish_reason:
            finished[m.index] = m.finish_reason
        if m.HasField("usage"):
            usage = m.usage
    assert msgs[-1].HasField("usage") and usage.completion_tokens == 40
    assert finished == {0: pb.FINISH_REASON_LENGTH, 1: pb.FINISH_REASON_LENGTH}
    assert texts == {c.index: c.text for c in unary.completions}


def test_tokenize_and_model_info(stub, tokenizer):
    t = stub.Tokenize(pb.TokenizeRequest(text="Hello world", return_tokens=True))
    assert list(t.token_ids) == tokenizer("Hello world")["input_ids"]
    assert len(t.tokens) == len(t.token_ids)
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.max_model_len == 256 and info.vocab_size == len(tokenizer)
    assert tokenizer.eos_token_id in info.eos_token_ids
    assert info.max_new_tokens == 1024  # the default cap
    assert info.runner == "torch" and info.quantization == "float32"  # an HF directory


def test_sampled_requests_echo_a_seed_that_replays_them(stub):
    greedy = stub.Generate(req())
    assert not greedy.HasField("seed")
    sampled = req(sampling=pb.SamplingParameters(temperature=1.5))
    first = stub.Generate(sampled)
    assert first.HasField("seed")
    sampled.sampling.seed = first.seed
    again = stub.Generate(sampled)
    assert again.seed == first.seed
    assert again.completions[0].text == first.completions[0].text
    chunks = list(stub.GenerateStream(pb.GenerateStreamRequest(request=sampled)))
    assert chunks[0].seed == first.seed and not chunks[1].HasField("seed")
    assert "".join(c.text for c in chunks) == first.completions[0].text


def test_correlation_id_is_the_request_id_when_none_is_given(stub):
    meta = [("x-correlation-id", "corr-7")]
    assert stub.Generate(req(), metadata=meta).request_id == "corr-7"
    assert stub.Generate(req(request_id="mine"), metadata=meta).request_id == "mine"


def test_an_over_long_correlation_id_is_invalid_argument_like_request_id(stub):
    """It names the request in the answer and every log line: held to request_id's 256
    characters (it was echoed and logged whatever its length)."""
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(req(), metadata=[("x-correlation-id", "c" * 300)])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "x-correlation-id metadata is longer than 256" in e.value.details()
    assert stub.Generate(req(), metadata=[("x-correlation-id", "c" * 256)]).request_id == \
        "c" * 256


def test_chat_input_uses_the_chat_template(stub, tokenizer):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi!")],
                           add_generation_prompt=True)
    resp = stub.Generate(pb.GenerateRequest(
        chat=chat, stopping=pb.StoppingCriteria(max_new_tokens=3),
        output=pb.OutputOptions(return_prompt_token_ids=True)))
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}],
                                             add_generation_prompt=True, tokenize=True)
    assert list(resp.prompt_token_ids) == list(expected["input_ids"])


def test_health_serving_and_reflection(grpc_server):
    with grpc.insecure_channel(grpc_server.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "genserve.v1.GenerationService"):
            r = health.Check(health_pb2.HealthCheckRequest(service=name))
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(refl.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
        assert {"genserve.v1.GenerationService", "grpc.health.v1.Health"} <= names
        # what grpcurl asks next: the descriptors of a service, to build requests
        resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="genserve.v1.GenerationService")])))
        assert resp.file_descriptor_response.file_descriptor_proto


STOP4 = pb.StoppingCriteria(max_new_tokens=4)
INVALID = [
    (pb.GenerateRequest(), "input"),
    (pb.GenerateRequest(prompt=""), "prompt"),
    (pb.GenerateRequest(prompt_token_ids=pb.TokenIds()), "prompt_token_ids"),
    (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 10**6])), "prompt_token_ids"),
    (pb.GenerateRequest(chat=pb.ChatMessages()), "chat.messages"),
    (pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="robot")])),
     "role"),
    (req("x " * 300), "max_model_len"),
    (req(stopping=pb.StoppingCriteria(max_new_tokens=1000)), "max_new_tokens"),
    (req(stopping=pb.StoppingCriteria(max_new_tokens=0)), "max_new_tokens"),
    (req(sampling=pb.SamplingParameters(temperature=float("nan"))), "temperature"),
    (req(sampling=pb.SamplingParameters(temperature=-1)), "temperature"),
    (req(sampling=pb.SamplingParameters(top_p=0)), "top_p"),
    (req(sampling=pb.SamplingParameters(top_p=1.01)), "top_p"),
    (req(sampling=pb.SamplingParameters(min_p=1.5)), "min_p"),
    (req(sampling=pb.SamplingParameters(typical_p=0)), "typical_p"),
    (req(sampling=pb.SamplingParameters(repetition_penalty=0)), "repetition_penalty"),
    (req(sampling=pb.SamplingParameters(presence_penalty=2.5)), "presence_penalty"),
    (req(sampling=pb.SamplingParameters(frequency_penalty=-3)), "frequency_penalty"),
    (req(sampling=pb.SamplingParameters(n=0)), "sampling.n"),
    (req(sampling=pb.SamplingParameters(n=99)), "sampling.n"),
    (req(sampling=pb.SamplingParameters(seed=2**64 - 1)), "seed"),
    (req(output=pb.OutputOptions(top_logprobs=500)), "top_logprobs"),
    (req(stopping=pb.StoppingCriteria(max_new_tokens=4, stop_sequences=[""])), "stop_sequences"),
    (req(stopping=pb.StoppingCriteria(max_new_tokens=4, stop_sequences=["a"] * 17)),
     "stop_sequences"),
    (req(stopping=pb.StoppingCriteria(max_new_tokens=4, stop_token_ids=[10**6])),
     "stop_token_ids"),
    (req(stopping=pb.StoppingCriteria(max_new_tokens=4, min_new_tokens=9)), "min_new_tokens"),
    (req(request_id="x" * 300), "request_id"),
    (req(stopping=pb.StoppingCriteria(max_new_tokens=2000)), "--max-new-tokens"),
    (req(structured_output=pb.StructuredOutput(regex=""), stopping=STOP4),
     "structured_output.regex"),
    (req(structured_output=pb.StructuredOutput(regex="([a-"), stopping=STOP4),
     "structured_output.regex"),
    (req(structured_output=pb.StructuredOutput(choice=pb.ChoiceList()), stopping=STOP4),
     "structured_output.choice"),
    (req(structured_output=pb.StructuredOutput(regex="[a-z]+")), "stopping.ignore_eos"),
    (req(speculative=pb.SpeculativeOptions(enabled=True)), "speculative"),
    (req(processors=[pb.ProcessorRef(name="nope")]), "processors[0]"),
]


@pytest.mark.parametrize("bad,field", INVALID, ids=[f for _, f in INVALID])
def test_bad_input_is_invalid_argument_naming_the_field(stub, bad, field):
    for call in (lambda: stub.Generate(bad),
                 lambda: list(stub.GenerateStream(pb.GenerateStreamRequest(request=bad)))):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == Code.INVALID_ARGUMENT, e.value.details()
        assert field in e.value.details()


def test_grammar_errors_carry_no_backend_log_prefix(stub):
    for so in (pb.StructuredOutput(regex="([a-"),
               pb.StructuredOutput(grammar='root ::= "a" | ('),
               pb.StructuredOutput(json_schema='{"type": "string", "minLength": "x"}')):
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(req(structured_output=so, stopping=STOP4))
        assert e.value.code() == Code.INVALID_ARGUMENT
        details = e.value.details()
        assert ".cc:" not in details and not re.search(r"\[\d\d:\d\d:\d\d\]", details)
        assert "\n" not in details and details.startswith("structured_output.")


def test_truncate_input_tokens_keeps_the_last_tokens(stub):
    resp = stub.Generate(req("x " * 300, truncate_input_tokens=50,
                             output=pb.OutputOptions(return_prompt_token_ids=True)))
    assert len(resp.prompt_token_ids) == 50


def _long(max_new=240) -> pb.GenerateRequest:
    return req("Tell me a long story", stopping=pb.StoppingCriteria(
        max_new_tokens=max_new, min_new_tokens=max_new))


def test_deadline_exceeded_aborts_and_frees_kv(grpc_server, stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(_long(), timeout=0.3)
    assert e.value.code() == Code.DEADLINE_EXCEEDED
    assert _kv_freed(grpc_server)


def test_cancelling_a_stream_aborts_and_frees_kv(grpc_server, stub):
    call = stub.GenerateStream(pb.GenerateStreamRequest(request=_long()))
    next(call)
    assert grpc_server.stats.kv_blocks_used > 0
    call.cancel()
    assert _kv_freed(grpc_server)


def test_stream_deadline_exceeded_aborts_and_frees_kv(grpc_server, stub):
    with pytest.raises(grpc.RpcError) as e:
        for _ in stub.GenerateStream(pb.GenerateStreamRequest(request=_long()), timeout=0.3):
            pass
    assert e.value.code() == Code.DEADLINE_EXCEEDED
    assert _kv_freed(grpc_server)


def test_batch_deadline_aborts_every_item(grpc_server, stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.GenerateBatch(pb.GenerateBatchRequest(requests=[_long()] * 4), timeout=0.3)
    assert e.value.code() == Code.DEADLINE_EXCEEDED
    assert _kv_freed(grpc_server)


def test_cancelling_a_unary_call_aborts_and_frees_kv(grpc_server, stub):
    call = stub.Generate.future(_long())
    assert wait_until(lambda: grpc_server.stats.kv_blocks_used > 0)
    call.cancel()
    assert _kv_freed(grpc_server)


def test_request_ids_are_echoed_and_may_repeat(stub):
    items = [req(request_id="same"), req(request_id="same"), req()]
    resp = stub.GenerateBatch(pb.GenerateBatchRequest(requests=items))
    ids = [r.response.request_id for r in resp.results]
    assert ids[:2] == ["same", "same"] and ids[2] and ids[2] != "same"
    calls = [stub.Generate.future(req(request_id="twin")) for _ in range(2)]
    assert [c.result(30).request_id for c in calls] == ["twin", "twin"]


def test_unset_max_new_tokens_is_clipped_to_the_room_left(stub):
    r = req("Hello world", stopping=pb.StoppingCriteria(ignore_eos=True),
            output=pb.OutputOptions(return_prompt_token_ids=True))
    resp = stub.Generate(r)  # the server default (256) exceeds the room left
    assert resp.usage.completion_tokens == MAX_MODEL_LEN - len(resp.prompt_token_ids)
    assert resp.completions[0].finish_reason == pb.FINISH_REASON_LENGTH


def test_stop_sequence_is_reported(stub):
    free = stub.Generate(req("Once upon a time", max_new=24)).completions[0].text
    stop = free[len(free) // 2:len(free) // 2 + 2]
    r = req("Once upon a time", stopping=pb.StoppingCriteria(
        max_new_tokens=24, ignore_eos=True, stop_sequences=[stop]))
    c = stub.Generate(r).completions[0]
    assert c.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE and c.stop_sequence == stop
    assert c.text == free[:free.index(stop)]


def test_logprobs_are_returned_per_token(stub):
    c = stub.Generate(req(output=pb.OutputOptions(
        logprobs=True, top_logprobs=3, return_token_ids=True))).completions[0]
    assert [lp.token_id for lp in c.logprobs] == list(c.token_ids)
    assert all(len(lp.top) == 3 and lp.logprob <= 0 for lp in c.logprobs)


def test_speculative_disabled_is_accepted(stub):
    r = req(speculative=pb.SpeculativeOptions(enabled=False))
    assert stub.Generate(r).usage.completion_tokens == 8


def test_time_limit_finishes_with_time_limit(stub):
    r = _long()
    r.stopping.time_limit_ms = 100
    resp = stub.Generate(r)
    assert resp.completions[0].finish_reason == pb.FINISH_REASON_TIME_LIMIT


def test_queue_full_is_resource_exhausted(make_engine):
    # A 1000-token first request (not 240): under load a short one could finish before
    # the second is seen waiting.
    running, _ = start_server(make_engine(max_num_seqs=1, max_waiting=1, max_model_len=1024),
                              structured=None)
    try:
        with grpc.insecure_channel(running.address) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            first = stub.Generate.future(_long(1000))
            assert wait_until(lambda: running.stats.num_running == 1)
            second = stub.Generate.future(_long())
            assert wait_until(lambda: running.stats.num_waiting == 1)
            with pytest.raises(grpc.RpcError) as e:
                stub.Generate(_long())
            assert e.value.code() == Code.RESOURCE_EXHAUSTED
            batch = stub.GenerateBatch(pb.GenerateBatchRequest(requests=[_long()]))
            assert batch.results[0].error.code == Code.RESOURCE_EXHAUSTED.value[0]
            first.cancel()
            second.cancel()
            assert wait_until(lambda: running.stats.num_requests == 0)
    finally:
        stop_server(running)


def test_drain_finishes_in_flight_work_and_refuses_new_calls(make_engine):
    running, _ = start_server(make_engine(), structured=None, health_port=0)
    health_address = f"127.0.0.1:{running.server.health_port}"
    with grpc.insecure_channel(running.address) as ch, \
            grpc.insecure_channel(health_address) as health_ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        health = health_pb2_grpc.HealthStub(health_ch)
        in_flight = stub.Generate.future(_long(120))
        assert wait_until(lambda: running.stats.num_running == 1)
        drained = asyncio.run_coroutine_threadsafe(running.server.drain(), running.loop)
        assert wait_until(lambda: running.server.state.draining)
        for name in ("", "genserve.v1.GenerationService", "fmaas.GenerationService"):
            assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING
        # Until new calls stop coming (at most MOVE_AWAY_MAX_S) they are served; then the
        # GOAWAY, and the main port refuses. This stub does not watch health and sends back
        # to back, so one call may meet the documented race of the GOAWAY's instant (gRPC's
        # stop cancels a call its core has not dispatched: CANCELLED); never more than one.
        assert stub.Generate(req()).completions[0].text is not None
        refused_by = time.monotonic() + MOVE_AWAY_MAX_S + 5
        cancelled = 0
        while True:
            try:
                stub.Generate(req(), timeout=10)
            except grpc.RpcError as e:
                if e.code() == Code.CANCELLED and not cancelled:
                    cancelled += 1
                    continue
                assert e.code() == Code.UNAVAILABLE
                break
            assert time.monotonic() < refused_by
        resp = in_flight.result(60)
        assert resp.completions[0].finish_reason == pb.FINISH_REASON_LENGTH
        assert resp.usage.completion_tokens == 120
        drained.result(60)
    running.loop.call_soon_threadsafe(running.loop.stop)
    running.thread.join(10)


def test_drain_ends_what_outlives_the_grace_period_as_aborted(make_engine):
    """Cut at the end of the grace, a stream and a unary call still end normally, with what
    was generated and finish reason ABORTED (not an error clients read as nothing ran)."""
    running, _ = start_server(make_engine(), drain_grace_s=0.6, structured=None)
    with grpc.insecure_channel(running.address) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        call = stub.GenerateStream(pb.GenerateStreamRequest(request=_long()))
        first = next(call)
        unary = stub.Generate.future(_long())
        assert wait_until(lambda: running.stats.num_requests == 2)
        start = time.monotonic()
        running.call(running.server.drain)
        assert time.monotonic() - start < 5
        rest = list(call)
        assert rest[-1].finish_reason == pb.FINISH_REASON_ABORTED
        assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) < 240
        resp = unary.result(10)
        assert resp.completions[0].finish_reason == pb.FINISH_REASON_ABORTED
    running.loop.call_soon_threadsafe(running.loop.stop)
    running.thread.join(10)


def test_health_is_not_serving_until_warm_up_ran(make_engine):
    release = threading.Event()

    class SlowWarmUp(GenServer):
        async def warm_up(self):
            await asyncio.to_thread(release.wait, 30)
            await super().warm_up()

    loop, thread = new_loop()
    engine = make_engine()

    async def make():  # grpc.aio objects belong to the loop they are created on
        return SlowWarmUp(ServerConfig(host="127.0.0.1", port=0, structured=None,
                                       compile_decode_step=False), engine)

    server = asyncio.run_coroutine_threadsafe(make(), loop).result(10)
    started = asyncio.run_coroutine_threadsafe(server.start(), loop)
    assert wait_until(lambda: server.port != 0)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "genserve.v1.GenerationService"):
            assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.GenerationServiceStub(ch).Generate(req())
        assert e.value.code() == Code.UNAVAILABLE
        release.set()
        started.result(30)
        assert health.Check(health_pb2.HealthCheckRequest()).status == \
            health_pb2.HealthCheckResponse.SERVING
        assert pb_grpc.GenerationServiceStub(ch).Generate(req()).usage.completion_tokens == 8
    asyncio.run_coroutine_threadsafe(server.drain(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
