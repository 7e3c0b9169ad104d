"""The asyncio client (grpc.aio)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Unpack

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from genserve.client._core import (
    DEFAULT_TARGET,
    DEFAULT_TIMEOUT,
    MAX_MESSAGE_BYTES,
    SERVICE_NAME,
    BatchItem,
    ChannelSettings,
    FinishReason,
    GenerateOptions,
    GenerateResult,
    GenserveError,
    LoadBalancing,
    ModelInfo,
    PemSource,
    Prompt,
    StreamChunk,
    Tokenized,
    Usage,
    _StreamState,
    batch_from_pb,
    build_request,
    chunk_from_pb,
    model_info_from_pb,
    result_from_pb,
)
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc


class AsyncStream:
    """The chunks of one ``generate_stream`` call: ``async for chunk in stream``.

    Like :class:`genserve.client.Stream`: ``text``/``texts``/``usage``/``finish_reason``
    gather what has passed; leaving an ``async with`` block, or ``cancel()``, cancels the
    call; failures raise :class:`GenserveError`.
    """

    def __init__(self, call: Any, timeout: float | None) -> None:
        self._call = call
        self._timeout = timeout
        self._state = _StreamState()

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> StreamChunk:
        try:
            msg = await self._call.read()
        except grpc.RpcError as e:
            raise GenserveError.from_rpc(e, self._timeout) from e
        if msg is grpc.aio.EOF:
            raise StopAsyncIteration
        chunk = chunk_from_pb(msg)
        self._state.add(chunk)
        return chunk

    def cancel(self) -> None:
        self._call.cancel()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self.cancel()

    @property
    def request_id(self) -> str:
        return self._state.request_id

    @property
    def text(self) -> str:
        return self._state.text

    @property
    def texts(self) -> dict[int, str]:
        return self._state.texts

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._state.finish_reasons.get(0)

    @property
    def usage(self) -> Usage | None:
        return self._state.usage


class AsyncClient:
    """An asyncio genserve client over one ``grpc.aio`` channel.

    Same arguments and methods as :class:`genserve.client.Client`, as coroutines
    (``generate_stream`` returns an :class:`AsyncStream` to ``async for`` over). Create it
    inside the event loop that uses it (grpc.aio channels belong to one loop);
    ``async with AsyncClient(...)`` or ``await client.close()``.
    """

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = DEFAULT_TIMEOUT,
                 tls: bool = False, root_certificates: PemSource | None = None,
                 certificate_chain: PemSource | None = None,
                 private_key: PemSource | None = None, server_name: str | None = None,
                 load_balancing: LoadBalancing | None = "round_robin", max_attempts: int = 1,
                 wait_for_ready: bool = False,
                 metadata: Sequence[tuple[str, str]] = (),
                 max_message_bytes: int = MAX_MESSAGE_BYTES,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        self.settings = ChannelSettings(
            target=target, tls=tls, root_certificates=root_certificates,
            certificate_chain=certificate_chain, private_key=private_key,
            server_name=server_name, load_balancing=load_balancing,
            max_attempts=max_attempts, max_message_bytes=max_message_bytes, options=options)
        self.timeout = timeout
        self.wait_for_ready = wait_for_ready
        self.metadata = tuple(metadata)
        credentials = self.settings.credentials()
        options_ = self.settings.channel_options()
        self.channel = (
            grpc.aio.insecure_channel(target, options=options_) if credentials is None
            else grpc.aio.secure_channel(target, credentials, options=options_))
        self._stub = pb_grpc.GenerationServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        t = self._timeout(timeout)
        try:
            return await method(request, timeout=t, metadata=self.metadata or None,
                                wait_for_ready=self.wait_for_ready)
        except grpc.RpcError as e:
            raise GenserveError.from_rpc(e, t) from e

    async def generate(self, prompt: Prompt | pb.GenerateRequest, *,
                       timeout: float | None = None,
                       **options: Unpack[GenerateOptions]) -> GenerateResult:
        """See :meth:`genserve.client.Client.generate`."""
        return result_from_pb(await self._unary(self._stub.Generate,
                                                build_request(prompt, options), timeout))

    async def generate_batch(self, prompts: Sequence[Prompt | pb.GenerateRequest], *,
                             timeout: float | None = None,
                             **options: Unpack[GenerateOptions]) -> list[BatchItem]:
        """See :meth:`genserve.client.Client.generate_batch`."""
        if isinstance(prompts, str | pb.GenerateRequest):
            raise TypeError("generate_batch takes a sequence of prompts")
        if "request_id" in options:
            raise TypeError("request_id is per item: pass GenerateRequest items to set it")
        request = pb.GenerateBatchRequest(requests=[
            build_request(p, None if isinstance(p, pb.GenerateRequest) else options)
            for p in prompts])
        return batch_from_pb(await self._unary(self._stub.GenerateBatch, request, timeout))

    def generate_stream(self, prompt: Prompt | pb.GenerateRequest, *,
                        timeout: float | None = None,
                        **options: Unpack[GenerateOptions]) -> AsyncStream:
        """See :meth:`genserve.client.Client.generate_stream`; ``async for`` the result."""
        request = pb.GenerateStreamRequest(request=build_request(prompt, options))
        t = self._timeout(timeout)
        call = self._stub.GenerateStream(request, timeout=t, metadata=self.metadata or None,
                                         wait_for_ready=self.wait_for_ready)
        return AsyncStream(call, t)

    async def tokenize(self, text: str, *, return_tokens: bool = False,
                       timeout: float | None = None) -> Tokenized:
        resp = await self._unary(self._stub.Tokenize, pb.TokenizeRequest(
            text=text, return_tokens=return_tokens), timeout)
        return Tokenized(tuple(resp.token_ids), tuple(resp.tokens))

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return model_info_from_pb(await self._unary(self._stub.GetModelInfo,
                                                    pb.GetModelInfoRequest(), timeout))

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """See :meth:`genserve.client.Client.health`."""
        resp = await self._unary(self._health.Check,
                                 health_pb2.HealthCheckRequest(service=service), timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))

    async def wait_until_serving(self, timeout: float = 120.0, *, service: str = SERVICE_NAME,
                                 poll_s: float = 0.25) -> None:
        """See :meth:`genserve.client.Client.wait_until_serving`."""
        end = time.monotonic() + timeout
        last = "no answer"
        while True:
            try:
                last = await self.health(
                    service, timeout=max(0.1, min(5.0, end - time.monotonic())))
                if last == "SERVING":
                    return
            except GenserveError as e:
                last = e.describe()
            if time.monotonic() >= end:
                raise GenserveError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"not SERVING after {timeout:g}s (last: {last})")
            await asyncio.sleep(poll_s)
