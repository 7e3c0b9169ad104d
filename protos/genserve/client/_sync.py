"""The blocking client."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any, Unpack

import grpc

from genserve.client._core import (
    SERVICE_NAME,
    BatchItem,
    GenerateOptions,
    GenerateResult,
    GenserveError,
    ModelInfo,
    Prompt,
    ServingWait,
    StreamChunk,
    Tokenized,
    _ClientBase,
    _StreamBase,
    batch_from_pb,
    batch_request,
    build_request,
    health_name,
    health_request,
    model_info_from_pb,
    result_from_pb,
    tokenized_from_pb,
)
from genserve.v1 import generation_pb2 as pb


class Stream(_StreamBase):
    """The chunks of one ``generate_stream`` call, as they arrive.

    Iterate it for :class:`StreamChunk` text deltas; ``text``, ``texts``, ``usage`` and
    ``finish_reason`` gather what has passed. Leaving a ``with`` block, or ``cancel()``,
    cancels the call (the server aborts the generation at once). A failure, before or
    between chunks, raises :class:`GenserveError`.
    """

    def __iter__(self) -> Iterator[StreamChunk]:
        return self

    def __next__(self) -> StreamChunk:
        try:
            return self._received(next(self._call))
        except grpc.RpcError as e:
            raise GenserveError.from_rpc(e, self._timeout) from e

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.cancel()  # a no-op once the stream has ended


class Client(_ClientBase):
    """A blocking genserve client over one gRPC channel (thread-safe).

    ``target``: ``host:port``, or a name such as
    ``dns:///genserve-headless.NS.svc.cluster.local:50051`` (a headless Service resolves
    to every ready pod; ``round_robin``, the default ``load_balancing``, connects to each
    and spreads calls over them per request; ``pick_first`` keeps one connection).
    ``timeout``: default deadline of each call in seconds (of a whole stream), None =
    none; every method takes ``timeout=`` too. TLS: ``tls=True`` (system roots) or
    ``root_certificates``; mTLS adds ``certificate_chain`` and ``private_key``; each is
    PEM bytes or a file path; ``server_name`` overrides the name checked against the
    server's certificate. ``max_attempts`` > 1 retries calls answered UNAVAILABLE
    (nothing ran: a replica draining or not ready), another replica first with
    ``round_robin``. ``wait_for_ready``: wait (within the deadline) for a connection
    instead of failing UNAVAILABLE at once. ``metadata``: sent with every call.
    """

    _grpc = grpc
    channel: grpc.Channel

    # ---- lifecycle ----------------------------------------------------------------

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        t = self._timeout(timeout)
        try:
            return method(request, **self._call_options(t))
        except grpc.RpcError as e:
            raise GenserveError.from_rpc(e, t) from e

    # ---- generation -----------------------------------------------------------------

    def generate(self, prompt: Prompt | pb.GenerateRequest, *, timeout: float | None = None,
                 **options: Unpack[GenerateOptions]) -> GenerateResult:
        """One prompt (text, token ids or chat messages); ``n`` completions."""
        return result_from_pb(self._unary(self._stub.Generate, build_request(prompt, options),
                                          timeout))

    def generate_batch(self, prompts: Sequence[Prompt | pb.GenerateRequest], *,
                       timeout: float | None = None,
                       **options: Unpack[GenerateOptions]) -> list[BatchItem]:
        """Many prompts in one call, run concurrently; one :class:`BatchItem` per prompt in
        order, each a result or that item's own error. ``options`` apply to every prompt
        that is not a ready ``GenerateRequest``; a ``request_id`` option is not allowed."""
        return batch_from_pb(self._unary(self._stub.GenerateBatch,
                                         batch_request(prompts, options), timeout))

    def generate_stream(self, prompt: Prompt | pb.GenerateRequest, *,
                        timeout: float | None = None,
                        **options: Unpack[GenerateOptions]) -> Stream:
        """Stream one prompt's completion(s) as text deltas; ``timeout`` bounds the whole
        stream."""
        return Stream(*self._start_stream(prompt, timeout, options))

    # ---- the rest ---------------------------------------------------------------------

    def tokenize(self, text: str, *, return_tokens: bool = False,
                 timeout: float | None = None) -> Tokenized:
        return tokenized_from_pb(self._unary(self._stub.Tokenize, pb.TokenizeRequest(
            text=text, return_tokens=return_tokens), timeout))

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return model_info_from_pb(self._unary(self._stub.GetModelInfo,
                                              pb.GetModelInfoRequest(), timeout))

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The server's health status name: ``SERVING``, ``NOT_SERVING`` (loading the model
        or draining)... ``service``: "" (the server) or ``genserve.v1.GenerationService``."""
        return health_name(self._unary(self._health.Check, health_request(service), timeout))

    def wait_until_serving(self, timeout: float = 120.0, *, service: str = SERVICE_NAME,
                           poll_s: float = 0.25) -> None:
        """Block until health says SERVING (the model loaded and warmed up); raise
        GenserveError(DEADLINE_EXCEEDED) after ``timeout`` seconds."""
        wait = ServingWait(timeout)
        while not wait.done(self._health_or_error(service, wait.check_timeout())):
            time.sleep(poll_s)

    def _health_or_error(self, service: str, timeout: float) -> str | GenserveError:
        try:
            return self.health(service, timeout=timeout)
        except GenserveError as e:
            return e
