"""LoRA adapters over gRPC: ``GenerateRequest.adapter_id`` and TGIS ``adapter_id`` run the
named adapter (greedy tokens equal transformers with the LoRA merged), batches mix
adapters, GetModelInfo lists the resident ones, every bad adapter is INVALID_ARGUMENT
naming the id and the reason while the server goes on serving everyone else, and a request
for another adapter while every slot is held waits for one (RESOURCE_EXHAUSTED only when
the wait runs out)."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from fmaas import generation_pb2 as tgis
from fmaas import generation_pb2_grpc as tgis_grpc
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from service.validation import ServiceLimits
from tests.lora_adapters import (
    gguf_lora_of,
    hf_greedy,
    merged_model,
    tiny_llama_base,
    write_gguf_lora,
)
from tests.service.conftest import start_server, stop_server, wait_until

NEW = 6
PROMPT_IDS = [1, 2, 3, 40, 50, 60, 70]
TEXT = "The quick brown fox"
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def cache(tmp_path_factory, lora_cache):
    """a1, a2, and broken adapters: corrupt weights, a rank over the limit, not LoRA."""
    root = tmp_path_factory.mktemp("service-adapters") / "cache"
    shutil.copytree(lora_cache, root)
    shutil.copytree(root / "a1", root / "corrupt")
    (root / "corrupt" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    for name, change in (("rank64", {"r": 64}), ("ia3", {"peft_type": "IA3"})):
        shutil.copytree(root / "a1", root / name)
        cfg = json.loads((root / name / "adapter_config.json").read_text())
        (root / name / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
    write_gguf_lora(root / "gguf-qwen2" / "ggml-lora-f32.gguf",
                    {"blk.0.attn_q.weight.lora_a": np.ones((4, 64), np.float32),
                     "blk.0.attn_q.weight.lora_b": np.ones((64, 4), np.float32)}, arch="qwen2")
    gguf_lora_of(root, "a1", tiny_llama_base(), root / "a1-gguf" / "ggml-lora-f16.gguf",
                 np.float16)
    return root


BAD = [("nope", "unknown adapter"), ("../a1", "not a valid adapter id"),
       ("corrupt", "not a readable safetensors file"),
       ("rank64", "rank 64 exceeds the server's limit 16 (--max-lora-rank)"),
       ("ia3", "unsupported PEFT type 'IA3'"),
       ("gguf-qwen2", "ggml-lora-f32.gguf is an adapter of a qwen2 model, not of this llama "
                      "model (general.architecture)")]


@pytest.fixture(scope="module")
def server(tiny_model_dir, cache, structured_outputs):
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_model_dir), max_model_len=128, adapter_cache=str(cache), max_loras=2,
        enforce_eager=True))
    running, _ = start_server(engine, ServiceLimits(max_batch_size=8),
                              structured_outputs=structured_outputs)
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def references(tiny_model_dir, lora_cache) -> dict[str, list[int]]:
    return {a: hf_greedy(merged_model(tiny_model_dir, lora_cache / a if a else None),
                         PROMPT_IDS, NEW) for a in ("", "a1", "a2")}


def native_request(adapter_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT_IDS),
                              adapter_id=adapter_id,
                              stopping=pb.StoppingCriteria(max_new_tokens=NEW,
                                                           min_new_tokens=NEW),
                              output=pb.OutputOptions(return_token_ids=True))


def tgis_params() -> tgis.Parameters:
    return tgis.Parameters(stopping=tgis.StoppingCriteria(max_new_tokens=NEW,
                                                          min_new_tokens=NEW))


def test_native_adapter_id_runs_the_adapter_alone_and_in_a_mixed_batch(channel, references):
    stub = pb_grpc.GenerationServiceStub(channel)
    for a, ref in references.items():
        assert list(stub.Generate(native_request(a), timeout=60).completions[0].token_ids) == ref
    batch = stub.GenerateBatch(pb.GenerateBatchRequest(requests=[
        native_request(a) for a in ("a2", "nope", "", "a1")]), timeout=60)
    got = [list(r.response.completions[0].token_ids) if r.HasField("response") else
           (r.error.code, r.error.message) for r in batch.results]
    assert got == [references["a2"], (Code.INVALID_ARGUMENT.value[0], "adapter_id: adapter "
                   "'nope': unknown adapter (no directory 'nope' in the adapter cache)"),
                   references[""], references["a1"]]


def test_a_gguf_lora_file_runs_on_the_torch_runner_as_its_peft_files_do(channel, references):
    """a1 converted to an f16 GGUF LoRA file (convert_lora_to_gguf.py's default), read back
    into PEFT's layout: the same greedy tokens as a1's PEFT files."""
    stub = pb_grpc.GenerationServiceStub(channel)
    resp = stub.Generate(native_request("a1-gguf"), timeout=60)
    assert list(resp.completions[0].token_ids) == references["a1"]


def test_tgis_adapter_id_generate_and_stream(channel):
    fm = tgis_grpc.GenerationServiceStub(channel)
    native = pb_grpc.GenerationServiceStub(channel)

    def native_text(a: str) -> str:
        req = pb.GenerateRequest(prompt=TEXT, adapter_id=a, stopping=pb.StoppingCriteria(
            max_new_tokens=NEW, min_new_tokens=NEW))
        return native.Generate(req, timeout=60).completions[0].text

    texts = {a: native_text(a) for a in ("", "a1", "a2")}
    assert len(set(texts.values())) == 3
    got = fm.Generate(tgis.BatchedGenerationRequest(
        adapter_id="a2", params=tgis_params(),
        requests=[tgis.GenerationRequest(text=TEXT)] * 2), timeout=60)
    assert [r.text for r in got.responses] == [texts["a2"]] * 2
    streamed = fm.GenerateStream(tgis.SingleGenerationRequest(
        adapter_id="a1", params=tgis_params(), request=tgis.GenerationRequest(text=TEXT)),
        timeout=60)
    assert "".join(m.text for m in streamed) == texts["a1"]


def test_structured_output_with_an_adapter(channel):
    stub = pb_grpc.GenerationServiceStub(channel)
    choices = ["red", "green", "blue"]
    for a in ("a1", "a2"):
        resp = stub.Generate(pb.GenerateRequest(
            prompt=TEXT, adapter_id=a, stopping=pb.StoppingCriteria(max_new_tokens=8),
            structured_output=pb.StructuredOutput(choice=pb.ChoiceList(choices=choices))),
            timeout=60)
        assert resp.completions[0].text in choices


@pytest.mark.parametrize(("adapter_id", "reason"), BAD, ids=[r for _, r in BAD])
def test_a_bad_adapter_is_invalid_argument_and_the_server_keeps_serving(
        channel, references, adapter_id, reason):
    native = pb_grpc.GenerationServiceStub(channel)
    fm = tgis_grpc.GenerationServiceStub(channel)
    calls = [lambda: native.Generate(native_request(adapter_id), timeout=60),
             lambda: list(native.GenerateStream(pb.GenerateStreamRequest(
                 request=native_request(adapter_id)), timeout=60)),
             lambda: fm.Generate(tgis.BatchedGenerationRequest(
                 adapter_id=adapter_id, params=tgis_params(),
                 requests=[tgis.GenerationRequest(text=TEXT)]), timeout=60)]
    for call in calls:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == Code.INVALID_ARGUMENT
        assert e.value.details().startswith(f"adapter_id: adapter {adapter_id!r}: ")
        assert reason in e.value.details()
    ok = native.Generate(native_request("a1"), timeout=60)
    assert list(ok.completions[0].token_ids) == references["a1"]


def test_model_info_lists_resident_adapters(channel):
    stub = pb_grpc.GenerationServiceStub(channel)
    stub.Generate(native_request("a1"), timeout=60)
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.max_loras == 2
    a1 = next(a for a in info.adapters if a.adapter_id == "a1")
    assert (a1.rank, list(a1.target_modules), a1.active_requests) == (
        4, ["down_proj", "q_proj", "v_proj"], 0)
    assert a1.load_seconds > 0
    assert len(info.adapters) <= 2 and not {"nope", "corrupt"} & {
        a.adapter_id for a in info.adapters}


@pytest.fixture(scope="module")
def one_slot(tiny_model_dir, cache):
    """A server with one adapter slot (--max-loras 1)."""
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_model_dir), max_model_len=128, adapter_cache=str(cache), max_loras=1,
        enforce_eager=True))
    running, _ = start_server(engine, ServiceLimits(max_batch_size=8), structured=None)
    yield running
    stop_server(running)


@pytest.fixture
def one_slot_stub(one_slot):
    with grpc.insecure_channel(one_slot.address) as ch:
        yield pb_grpc.GenerationServiceStub(ch)


def waiting_gauge(running) -> float | None:
    return running.server.metrics.registry.get_sample_value(
        "genserve_adapter_waiting_requests")


def hold_slot(running, adapter_id: str):
    """A lease on ``adapter_id`` taken as a running request's: its slot stays held."""
    engine = running.server.engine
    return running.call(lambda: engine.lease_adapter(adapter_id))


def test_with_one_slot_a_request_for_another_adapter_waits_for_it_and_is_served(
        one_slot, one_slot_stub, references):
    held = hold_slot(one_slot, "a1")  # as if a long a1 request were running
    stub = one_slot_stub
    with ThreadPoolExecutor(2) as pool:
        a2 = pool.submit(stub.Generate, native_request("a2"), timeout=60)
        a1 = pool.submit(stub.Generate, native_request("a1"), timeout=60)
        assert list(a1.result(60).completions[0].token_ids) == references["a1"]
        assert wait_until(lambda: waiting_gauge(one_slot) == 1)
        assert not a2.done()  # not RESOURCE_EXHAUSTED: in line for the slot
        held.release()
        assert list(a2.result(60).completions[0].token_ids) == references["a2"]
    assert waiting_gauge(one_slot) == 0


def test_a_wait_for_a_slot_ends_in_resource_exhausted_or_at_the_client_deadline(
        one_slot, one_slot_stub, references):
    stub = one_slot_stub
    held = hold_slot(one_slot, "a1")
    registry = one_slot.server.engine.engine.adapters
    registry.wait_s = 0.3
    try:
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(native_request("a2"), timeout=60)
        assert e.value.code() == Code.RESOURCE_EXHAUSTED
        assert "adapter 'a2'" in e.value.details()
        assert "0.3 s (--max-lora-wait-s)" in e.value.details()
        registry.wait_s = 60
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(native_request("a2"), timeout=0.5)
        assert e.value.code() == Code.DEADLINE_EXCEEDED
        assert wait_until(lambda: waiting_gauge(one_slot) == 0)  # the wait ended with it
    finally:
        held.release()
        registry.wait_s = 60
    # nothing is left holding the slot: a2 gets it
    assert list(stub.Generate(native_request("a2"), timeout=60).completions[0].token_ids) \
        == references["a2"]
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert [(a.adapter_id, a.active_requests) for a in info.adapters] == [("a2", 0)]
