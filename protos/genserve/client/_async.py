"""The asyncio client (grpc.aio)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Unpack

import grpc
import grpc.aio

from genserve.client import _core as core
from genserve.v1 import generation_pb2 as pb


class AsyncStream(core._StreamBase):
    """The chunks of one ``generate_stream`` call: ``async for chunk in stream``.

    Like :class:`genserve.client.Stream`: ``text``/``texts``/``usage``/``finish_reason``
    gather what has passed; leaving an ``async with`` block, or ``cancel()``, cancels the
    call; failures raise :class:`GenserveError`.
    """

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> core.StreamChunk:
        try:
            msg = await self._call.read()
        except grpc.RpcError as e:
            raise core.GenserveError.from_rpc(e, self._timeout) from e
        if msg is grpc.aio.EOF:
            raise StopAsyncIteration
        return self._received(msg)

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self.cancel()


class AsyncClient(core._ClientBase):
    """An asyncio genserve client over one ``grpc.aio`` channel.

    Same arguments and methods as :class:`genserve.client.Client`, as coroutines
    (``generate_stream`` returns an :class:`AsyncStream` to ``async for`` over). Create it
    inside the event loop that uses it (grpc.aio channels belong to one loop);
    ``async with AsyncClient(...)`` or ``await client.close()``.
    """

    _grpc = grpc.aio
    channel: grpc.aio.Channel

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        t = self._timeout(timeout)
        try:
            return await method(request, **self._call_options(t))
        except grpc.RpcError as e:
            raise core.GenserveError.from_rpc(e, t) from e

    async def generate(self, prompt: core.Prompt | pb.GenerateRequest, *,
                       timeout: float | None = None,
                       **options: Unpack[core.GenerateOptions]) -> core.GenerateResult:
        """See :meth:`genserve.client.Client.generate`."""
        return core.result_from_pb(await self._unary(self._stub.Generate,
                                                core.build_request(prompt, options), timeout))

    async def generate_batch(self, prompts: Sequence[core.Prompt | pb.GenerateRequest], *,
                             timeout: float | None = None,
                             **options: Unpack[core.GenerateOptions]) -> list[core.BatchItem]:
        """See :meth:`genserve.client.Client.generate_batch`."""
        return core.batch_from_pb(await self._unary(self._stub.GenerateBatch,
                                               core.batch_request(prompts, options), timeout))

    def generate_stream(self, prompt: core.Prompt | pb.GenerateRequest, *,
                        timeout: float | None = None,
                        **options: Unpack[core.GenerateOptions]) -> AsyncStream:
        """See :meth:`genserve.client.Client.generate_stream`; ``async for`` the result."""
        return AsyncStream(*self._start_stream(prompt, timeout, options))

    async def tokenize(self, text: str, *, return_tokens: bool = False,
                       timeout: float | None = None) -> core.Tokenized:
        return core.tokenized_from_pb(await self._unary(self._stub.Tokenize, pb.TokenizeRequest(
            text=text, return_tokens=return_tokens), timeout))

    async def model_info(self, *, timeout: float | None = None) -> core.ModelInfo:
        return core.model_info_from_pb(await self._unary(self._stub.GetModelInfo,
                                                    pb.GetModelInfoRequest(), timeout))

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """See :meth:`genserve.client.Client.health`."""
        return core.health_name(await self._unary(self._health.Check, core.health_request(service),
                                             timeout))

    async def wait_until_serving(self, timeout: float = 120.0, *, service: str = core.SERVICE_NAME,
                                 poll_s: float = 0.25) -> None:
        """See :meth:`genserve.client.Client.wait_until_serving`."""
        wait = core.ServingWait(timeout)
        while not wait.done(await self._health_or_error(service, wait.check_timeout())):
            await asyncio.sleep(poll_s)

    async def _health_or_error(self, service: str, timeout: float) -> str | core.GenserveError:
        try:
            return await self.health(service, timeout=timeout)
        except core.GenserveError as e:
            return e
