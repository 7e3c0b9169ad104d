"""genserve.client.AsyncClient against the same in-process server (tiny random model)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from genserve.client import AsyncClient, AsyncStream, Client, GenserveError

Code = grpc.StatusCode
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def expected(address):
    """What the sync client gets (the model is greedy by default)."""
    with Client(address, timeout=60) as c:
        return c.generate(PROMPT, max_new_tokens=8)


async def test_generate_and_stream(address, expected):
    async with AsyncClient(address, timeout=60) as client:
        result = await client.generate(PROMPT, max_new_tokens=8)
        assert result.text == expected.text and result.usage == expected.usage
        stream = client.generate_stream(PROMPT, max_new_tokens=8)
        assert isinstance(stream, AsyncStream)
        chunks = [c async for c in stream]
        assert "".join(c.text for c in chunks) == expected.text == stream.text
        assert chunks[-1].usage == expected.usage and stream.finish_reason == "length"


async def test_concurrent_calls(address, expected):
    async with AsyncClient(address, timeout=60) as client:
        results = await asyncio.gather(*(client.generate(PROMPT, max_new_tokens=8)
                                         for _ in range(4)))
    assert {r.text for r in results} == {expected.text}


async def test_batch_tokenize_info_health(address, tokenizer):
    async with AsyncClient(address, timeout=60) as client:
        items = await client.generate_batch(["a, b, c,", ""], max_new_tokens=3)
        assert items[0].unwrap().usage.completion_tokens == 3
        assert items[1].error is not None and items[1].error.code == Code.INVALID_ARGUMENT
        t = await client.tokenize("Hello world")
        assert list(t.token_ids) == tokenizer("Hello world")["input_ids"]
        assert (await client.model_info()).max_model_len == 256
        assert await client.health() == "SERVING"
        await client.wait_until_serving(5)


async def test_errors(address):
    async with AsyncClient(address, timeout=60) as client:
        with pytest.raises(GenserveError) as e:
            await client.generate(PROMPT, top_p=1.5)
        assert e.value.code == Code.INVALID_ARGUMENT and "top_p" in e.value.details
        with pytest.raises(GenserveError) as e:
            async for _ in client.generate_stream(PROMPT, top_p=0):
                pass
        assert e.value.code == Code.INVALID_ARGUMENT
        with pytest.raises(GenserveError) as e:
            await client.generate(PROMPT, max_new_tokens=200, min_new_tokens=200,
                                  timeout=0.05)
        assert e.value.code == Code.DEADLINE_EXCEEDED


async def test_leaving_the_stream_cancels_it(address, server):
    async with AsyncClient(address, timeout=60) as client:
        stream = client.generate_stream(PROMPT, max_new_tokens=200, min_new_tokens=200,
                                        ignore_eos=True)
        async with stream:
            async for _chunk in stream:
                break
    end = time.monotonic() + 10
    while server.stats.num_requests and time.monotonic() < end:
        await asyncio.sleep(0.05)
    assert server.stats.num_requests == 0


async def test_tls(tls_server, tls_files):
    async with AsyncClient(tls_server.address, root_certificates=str(tls_files.ca),
                           timeout=30) as client:
        assert (await client.generate("Hello there", max_new_tokens=2)).usage \
            .completion_tokens == 2
