"""Speculative decoding over gRPC (real engine, tiny model drafting for itself)."""

from __future__ import annotations

import grpc
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from specdecode.config import SpeculativeConfig
from specdecode.worker import speculator_for
from tests.service.conftest import start_server, stop_server

PROMPT = "a b a b a b a b a b a b"


@pytest.fixture(scope="module")
def spec_stub(tiny_model_dir):
    spec = SpeculativeConfig(method="draft", draft_model=str(tiny_model_dir), num_spec_tokens=3)
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_model_dir), max_model_len=256),
                                     speculator_for(spec))
    running, _ = start_server(engine, structured=None)
    with grpc.insecure_channel(running.address) as channel:
        yield pb_grpc.GenerationServiceStub(channel)
    stop_server(running)


def req(enabled: bool | None = None, **kw) -> pb.GenerateRequest:
    r = pb.GenerateRequest(prompt=PROMPT, stopping=pb.StoppingCriteria(
        max_new_tokens=24, ignore_eos=True), **kw)
    if enabled is not None:
        r.speculative.enabled = enabled
    return r


def test_model_info_reports_the_speculative_config(spec_stub):
    info = spec_stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.speculative.method, info.speculative.k) == ("draft", 3)


def test_greedy_text_is_the_same_with_speculation_on_and_off_and_usage_counts_it(spec_stub):
    on = spec_stub.Generate(req())
    off = spec_stub.Generate(req(enabled=False))
    assert on.completions[0].token_ids == off.completions[0].token_ids
    assert on.completions[0].text == off.completions[0].text
    assert on.usage.spec_proposed_tokens > 0
    assert on.usage.spec_accepted_tokens == on.usage.spec_proposed_tokens  # its own draft
    assert off.usage.spec_proposed_tokens == 0


def test_stream_delivers_every_speculated_token_in_order_with_logprobs(spec_stub):
    r = req(output=pb.OutputOptions(logprobs=True, return_token_ids=True))
    unary = spec_stub.Generate(r)
    msgs = list(spec_stub.GenerateStream(pb.GenerateStreamRequest(request=r)))
    ids = [t for m in msgs for t in m.token_ids]
    assert ids == list(unary.completions[0].token_ids)
    assert "".join(m.text for m in msgs) == unary.completions[0].text
    assert [lp.token_id for m in msgs for lp in m.logprobs] == ids
    assert msgs[-1].usage.spec_proposed_tokens > 0
