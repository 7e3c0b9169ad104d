"""The blocking client."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any, Unpack

import grpc
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


class Stream:
    """The chunks of one ``generate_stream`` call, as they arrive.

    Iterate it for :class:`StreamChunk` text deltas; ``text``, ``texts``, ``usage`` and
    ``finish_reason`` gather what has passed. Leaving a ``with`` block, or ``cancel()``,
    cancels the call (the server aborts the generation at once). A failure, before or
    between chunks, raises :class:`GenserveError`.
    """

    def __init__(self, call: Any, timeout: float | None) -> None:
        self._call = call
        self._timeout = timeout
        self._state = _StreamState()

    def __iter__(self) -> Iterator[StreamChunk]:
        return self

    def __next__(self) -> StreamChunk:
        try:
            msg = next(self._call)
        except grpc.RpcError as e:
            raise GenserveError.from_rpc(e, self._timeout) from e
        chunk = chunk_from_pb(msg)
        self._state.add(chunk)
        return chunk

    def cancel(self) -> None:
        self._call.cancel()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.cancel()  # a no-op once the stream has ended

    @property
    def request_id(self) -> str:
        return self._state.request_id

    @property
    def text(self) -> str:
        """Completion 0's text so far."""
        return self._state.text

    @property
    def texts(self) -> dict[int, str]:
        """Each completion's text so far, by index."""
        return self._state.texts

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._state.finish_reasons.get(0)

    @property
    def usage(self) -> Usage | None:
        """Set once the last chunk has arrived."""
        return self._state.usage


class Client:
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
        self.channel = (grpc.insecure_channel(target, options=options_) if credentials is None
                        else grpc.secure_channel(target, credentials, options=options_))
        self._stub = pb_grpc.GenerationServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    # ---- lifecycle ----------------------------------------------------------------

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        t = self._timeout(timeout)
        try:
            return method(request, timeout=t, metadata=self.metadata or None,
                          wait_for_ready=self.wait_for_ready)
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
        if isinstance(prompts, str | pb.GenerateRequest):
            raise TypeError("generate_batch takes a sequence of prompts")
        if "request_id" in options:
            raise TypeError("request_id is per item: pass GenerateRequest items to set it")
        request = pb.GenerateBatchRequest(requests=[
            build_request(p, None if isinstance(p, pb.GenerateRequest) else options)
            for p in prompts])
        return batch_from_pb(self._unary(self._stub.GenerateBatch, request, timeout))

    def generate_stream(self, prompt: Prompt | pb.GenerateRequest, *,
                        timeout: float | None = None,
                        **options: Unpack[GenerateOptions]) -> Stream:
        """Stream one prompt's completion(s) as text deltas; ``timeout`` bounds the whole
        stream."""
        request = pb.GenerateStreamRequest(request=build_request(prompt, options))
        t = self._timeout(timeout)
        call = self._stub.GenerateStream(request, timeout=t, metadata=self.metadata or None,
                                         wait_for_ready=self.wait_for_ready)
        return Stream(call, t)

    # ---- the rest ---------------------------------------------------------------------

    def tokenize(self, text: str, *, return_tokens: bool = False,
                 timeout: float | None = None) -> Tokenized:
        resp = self._unary(self._stub.Tokenize, pb.TokenizeRequest(
            text=text, return_tokens=return_tokens), timeout)
        return Tokenized(tuple(resp.token_ids), tuple(resp.tokens))

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return model_info_from_pb(self._unary(self._stub.GetModelInfo,
                                              pb.GetModelInfoRequest(), timeout))

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The server's health status name: ``SERVING``, ``NOT_SERVING`` (loading the model
        or draining)... ``service``: "" (the server) or ``genserve.v1.GenerationService``."""
        resp = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service),
                           timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))

    def wait_until_serving(self, timeout: float = 120.0, *, service: str = SERVICE_NAME,
                           poll_s: float = 0.25) -> None:
        """Block until health says SERVING (the model loaded and warmed up); raise
        GenserveError(DEADLINE_EXCEEDED) after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        last = "no answer"
        while True:
            try:
                last = self.health(service, timeout=max(0.1, min(5.0, end - time.monotonic())))
                if last == "SERVING":
                    return
            except GenserveError as e:
                last = e.describe()
            if time.monotonic() >= end:
                raise GenserveError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"not SERVING after {timeout:g}s (last: {last})")
            time.sleep(poll_s)
