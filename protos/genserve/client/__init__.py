"""Python client library for genserve: :class:`Client` (blocking) and :class:`AsyncClient`
(asyncio), typed wrappers over the generated ``genserve.v1`` stubs.

    from genserve.client import Client, GenserveError

    with Client("localhost:50051") as client:
        result = client.generate("The capital of France is", max_new_tokens=16)
        print(result.text, result.finish_reason, result.usage.completion_tokens)
        for chunk in client.generate_stream("Once upon a time", max_new_tokens=32):
            print(chunk.text, end="", flush=True)

Failed calls raise :class:`GenserveError` (``.code``, a ``grpc.StatusCode``, and
``.details``); a ``generate_batch`` item's own error is in its :class:`BatchItem`.
"""

from genserve.client._async import AsyncClient, AsyncStream
from genserve.client._core import (
    DEFAULT_TARGET,
    DEFAULT_TIMEOUT,
    BatchItem,
    ChannelSettings,
    Completion,
    FinishReason,
    GenerateOptions,
    GenerateResult,
    GenserveError,
    ModelInfo,
    Prompt,
    StreamChunk,
    Tokenized,
    TokenLogprob,
    Usage,
    build_request,
)
from genserve.client._sync import Client, Stream

__all__ = [
    "DEFAULT_TARGET",
    "DEFAULT_TIMEOUT",
    "AsyncClient",
    "AsyncStream",
    "BatchItem",
    "ChannelSettings",
    "Client",
    "Completion",
    "FinishReason",
    "GenerateOptions",
    "GenerateResult",
    "GenserveError",
    "ModelInfo",
    "Prompt",
    "Stream",
    "StreamChunk",
    "TokenLogprob",
    "Tokenized",
    "Usage",
    "build_request",
]
