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
