"""Processor plugins over gRPC: per-sequence state, failure isolation, built-ins, bad args."""

from __future__ import annotations

import json

import grpc
import pytest

from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from tests.service.conftest import start_server, stop_server
from tests.service.plugin_fixtures import RecorderPlugin

PLUGINS = ["tests.service.plugin_fixtures:RecorderPlugin",
           "tests.service.plugin_fixtures:FailPlugin"]


@pytest.fixture(scope="module")
def server(make_engine):
    running, _ = start_server(make_engine(), processor_plugins=PLUGINS, structured=None)
    yield running
    stop_server(running)


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as ch:
        yield pb_grpc.GenerationServiceStub(ch)


def item(prompt: str, max_new=6, *processors: tuple[str, dict], **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=prompt, stopping=pb.StoppingCriteria(max_new_tokens=max_new,
                                                    min_new_tokens=max_new),
        processors=[pb.ProcessorRef(name=n, args_json=json.dumps(a)) for n, a in processors],
        output=pb.OutputOptions(return_token_ids=True, return_prompt_token_ids=True), **kw)


def test_batch_of_16_sharing_a_stateful_processor_gives_each_its_own(stub):
    plugin = RecorderPlugin.instance
    before = len(plugin.records)
    items = [item(f"Sequence number {i} says", 6, ("recorder", {})) for i in range(16)]
    resp = stub.GenerateBatch(pb.GenerateBatchRequest(requests=items))
    records = {r.prompt: r for r in plugin.records[before:]}
    assert len(records) == 16
    for r in resp.results:
        out = list(r.response.completions[0].token_ids)
        rec = records[tuple(r.response.prompt_token_ids)]
        assert rec.seen == [out[:i] for i in range(len(out))]
    assert plugin.created == plugin.released


def test_n_samples_each_get_their_own_processor(stub):
    plugin = RecorderPlugin.instance
    before = plugin.created
    stub.Generate(item("Many samples", 4, ("recorder", {}),
                       sampling=pb.SamplingParameters(n=4, temperature=1.0, seed=1)))
    assert plugin.created - before == 4
    assert plugin.created == plugin.released


def test_a_failing_processor_fails_only_its_item_with_internal(server, stub):
    items = [item(f"healthy {i}", 8) for i in range(7)]
    items.insert(3, item("doomed", 8, ("fail_on_nth", {"n": 3})))
    resp = stub.GenerateBatch(pb.GenerateBatchRequest(requests=items))
    for i, r in enumerate(resp.results):
        if i == 3:
            assert r.error.code == grpc.StatusCode.INTERNAL.value[0]
            assert "plugin exploded on call 3" in r.error.message
        else:
            assert len(r.response.completions[0].token_ids) == 8
            alone = stub.Generate(items[i])
            assert alone.completions[0].token_ids == r.response.completions[0].token_ids
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(item("doomed", 8, ("fail_on_nth", {"n": 2})))
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "plugin exploded" in e.value.details()
    assert server.stats.kv_blocks_used == 0
    assert stub.Generate(item("still serving", 3)).completions[0].token_ids


def test_banned_phrases_never_appear(stub, tokenizer):
    free = stub.Generate(item("The meaning of life is", 12))
    words = [w for w in free.completions[0].text.split() if w.isalpha()] or \
        [tokenizer.decode(free.completions[0].token_ids[:1]).strip()]
    banned = words[:3]
    resp = stub.Generate(item("The meaning of life is", 12,
                              ("banned_phrases", {"phrases": banned})))
    out = list(resp.completions[0].token_ids)
    assert out != list(free.completions[0].token_ids)
    for phrase in banned:
        for variant in (phrase, " " + phrase):
            ids = tokenizer(variant, add_special_tokens=False)["input_ids"]
            assert not any(out[i:i + len(ids)] == ids for i in range(len(out)))


def test_no_repeat_window_holds_over_the_window(stub):
    window = 5
    resp = stub.Generate(item("Repeat repeat repeat repeat", 30,
                              ("no_repeat_window", {"window": window}),
                              sampling=pb.SamplingParameters(repetition_penalty=0.3)))
    out = list(resp.completions[0].token_ids)
    assert len(out) == 30
    for i in range(len(out)):
        assert out[i] not in out[max(0, i - window):i]


@pytest.mark.parametrize("ref,needle", [
    (pb.ProcessorRef(name="nope"), "unknown processor"),
    (pb.ProcessorRef(name="no_repeat_window", args_json="{bad json"), "args_json"),
    (pb.ProcessorRef(name="no_repeat_window", args_json="[1]"), "JSON object"),
    (pb.ProcessorRef(name="no_repeat_window", args_json='{"window": 0}'), "window"),
    (pb.ProcessorRef(name="no_repeat_window", args_json='{"size": 3}'), "unknown argument"),
    (pb.ProcessorRef(name="banned_phrases", args_json='{"phrases": []}'), "phrases"),
    (pb.ProcessorRef(name="banned_phrases", args_json='{"phrases": [""]}'), "phrases"),
])
def test_bad_processor_refs_are_invalid_argument(stub, ref, needle):
    req = pb.GenerateRequest(prompt="hi", processors=[ref])
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in e.value.details()
