"""End to end on the embedded default model (SmolLM2-135M): greedy equals HF ``generate``."""

from __future__ import annotations

import grpc
import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from engine.runners.torch.packed_linear import stock_transformers
from engine.sampling_params import SamplingParams
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from tests.engine.test_engine import run_to_completion
from tests.service.conftest import RunningServer, stop_server

PROMPTS = [
    "The capital of France is",
    "Here is a Python function that reverses a string:\n",
    "List three colours:",
    "Q: What is 12 + 30?\nA:",
    "Once upon a time",
    "The most important thing about machine learning is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "Translate to French: Good morning, how are you?",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def engine(real_engine) -> LLMEngine:
    return real_engine


@pytest.fixture(scope="module")
def prompt_ids(engine):
    return [engine.tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_reference(engine, prompt_ids):
    """HF's own generate on the same weights with its stock SDPA attention and linears."""
    eos = engine.info.eos_token_ids
    refs = []
    with stock_transformers(engine.runner.model) as model, torch.inference_mode():
        for ids in prompt_ids:
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW,
                                 do_sample=False)[0, len(ids):].tolist()
            for i, t in enumerate(out):  # HF pads after EOS; we stop at it
                if t in eos:
                    out = out[:i + 1]
                    break
            refs.append(out)
    return refs


def test_greedy_equals_hf_generate_one_at_a_time(engine, prompt_ids, hf_reference):
    for i, ids in enumerate(prompt_ids):
        res = run_to_completion(engine, {0: [(f"a{i}", ids,
                                              SamplingParams(max_new_tokens=MAX_NEW))]})
        assert res[f"a{i}"][0].token_ids == hf_reference[i], PROMPTS[i]


def test_greedy_equals_hf_generate_with_continuous_batching(engine, prompt_ids, hf_reference):
    arrivals = {2 * i: [(f"b{i}", ids, SamplingParams(max_new_tokens=MAX_NEW))]
                for i, ids in enumerate(prompt_ids)}
    res = run_to_completion(engine, arrivals)
    for i in range(len(prompt_ids)):
        assert res[f"b{i}"][0].token_ids == hf_reference[i], PROMPTS[i]
        text = engine.tokenizer.decode(hf_reference[i], skip_special_tokens=True)
        assert res[f"b{i}"][0].text == text


@pytest.fixture(scope="module")
def real_server(engine):
    # Reuse the loaded weights: a second engine would load the GGUF again (~20 s).
    import asyncio

    from service.server import GenServer, ServerConfig
    from tests.service.conftest import new_loop

    loop, thread = new_loop()

    async def boot():
        server = GenServer(ServerConfig(host="127.0.0.1", port=0, compile_decode_step=False),
                           AsyncEngine(engine))
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(boot(), loop).result(120)
    running = RunningServer(f"127.0.0.1:{server.port}", server, loop)
    yield running
    stop_server(running, thread)


def test_grpc_generate_batch_and_stream_match_hf(real_server, engine, hf_reference):
    with grpc.insecure_channel(real_server.address) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        reqs = [pb.GenerateRequest(prompt=p, stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW),
                                   output=pb.OutputOptions(return_token_ids=True))
                for p in PROMPTS]
        batch = stub.GenerateBatch(pb.GenerateBatchRequest(requests=reqs), timeout=300)
        for i, r in enumerate(batch.results):
            assert list(r.response.completions[0].token_ids) == hf_reference[i], PROMPTS[i]
        streamed = "".join(m.text for m in stub.GenerateStream(
            pb.GenerateStreamRequest(request=reqs[0]), timeout=120))
        assert streamed == batch.results[0].response.completions[0].text


def test_default_model_is_found_inside_its_package():
    from engine.loading.model_loader import default_model_path, resolve_model

    path = default_model_path()
    assert path.endswith(".gguf")
    assert resolve_model("default").gguf_file == path.rsplit("/", 1)[1]
