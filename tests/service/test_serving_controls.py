"""Server-wide controls: --served-model-name, --seed."""

from __future__ import annotations

import grpc

from engine.config import EngineConfig
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from service.validation import sampling_seed, seed_sampling
from tests.service.conftest import start_server, stop_server
from tests.service.fake_engine import FakeEngine


def test_served_model_name_is_what_clients_see(tiny_model_dir, tokenizer):
    engine = FakeEngine(tokenizer, EngineConfig(model=str(tiny_model_dir)))
    running, _ = start_server(engine, structured=None, served_model_name="team-llm")
    try:
        with grpc.insecure_channel(running.address) as ch:
            info = pb_grpc.GenerationServiceStub(ch).GetModelInfo(pb.GetModelInfoRequest(),
                                                                  timeout=10)
        assert info.model_id == "team-llm"
    finally:
        stop_server(running)


def test_seed_makes_the_picked_seeds_replayable():
    seed_sampling(5)
    first = [sampling_seed(0.7, None) for _ in range(3)]
    seed_sampling(5)
    assert [sampling_seed(0.7, None) for _ in range(3)] == first
    assert len(set(first)) == 3
    assert sampling_seed(0.7, 42) == 42 and sampling_seed(0.0, None) is None
    seed_sampling(6)
    assert sampling_seed(0.7, None) != first[0]


def test_stream_interval_groups_a_streams_tokens_into_fewer_messages(tiny_model_dir):
    from engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_model_dir), max_model_len=256,
                                                  stream_interval=5))
    running, _ = start_server(engine, structured=None)
    try:
        with grpc.insecure_channel(running.address) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                     stopping=pb.StoppingCriteria(max_new_tokens=21,
                                                                  min_new_tokens=21),
                                     output=pb.OutputOptions(return_token_ids=True))
            msgs = [m for m in stub.GenerateStream(pb.GenerateStreamRequest(request=req),
                                                   timeout=60) if m.token_ids]
            whole = stub.Generate(req, timeout=60)
    finally:
        stop_server(running)
    sizes = [len(m.token_ids) for m in msgs]
    assert sizes[0] == 1 and all(n >= 5 for n in sizes[1:-1]), sizes
    assert sum(sizes) == 21 and len(msgs) <= 5
    assert [t for m in msgs for t in m.token_ids] == list(whole.completions[0].token_ids)
    assert "".join(m.text for m in msgs) == whole.completions[0].text
