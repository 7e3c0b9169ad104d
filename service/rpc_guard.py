"""Every RPC of every service (ours, TGIS's, health, reflection) passes through here.

Two jobs that must see each call before and after its handler:

- **Undecodable requests are INVALID_ARGUMENT.** grpcio decodes a request with the stub's
  ``FromString`` before any handler runs, and a failure there (invalid UTF-8 in a string
  field, truncated or garbage bytes) would answer UNKNOWN. The deserializer is wrapped so
  the failure reaches the handler's wrapper, which answers INVALID_ARGUMENT naming the
  field where it can find it.
- **Standard gRPC server metrics** (``grpc_server_started_total``,
  ``grpc_server_handled_total``, ``grpc_server_handling_seconds``,
  ``grpc_server_msg_received_total``, ``grpc_server_msg_sent_total``), the names
  go-grpc-prometheus and py-grpc-prometheus use, so existing gRPC dashboards work.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from service.metrics import Metrics

_STRING = FieldDescriptor.TYPE_STRING
_MESSAGE = FieldDescriptor.TYPE_MESSAGE


@dataclass
class Undecodable:
    """What a wrapped deserializer returns instead of raising."""

    message: str


def _varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def find_bad_field(desc: Descriptor, data: bytes, prefix: str = "", depth: int = 0) -> str | None:
    """The first field of ``data`` (a serialized ``desc``) that cannot be decoded: a string
    that is not UTF-8, or where the bytes end early; None when none is found."""
    i = 0
    try:
        while i < len(data):
            key, i = _varint(data, i)
            number, wire = key >> 3, key & 7
            field = desc.fields_by_number.get(number)
            name = prefix + (field.name if field is not None else f"field {number}")
            if wire == 0:
                _, i = _varint(data, i)
            elif wire in (1, 5):
                i += 8 if wire == 1 else 4
            elif wire == 2:
                size, i = _varint(data, i)
                chunk = data[i:i + size]
                i += size
                if i > len(data):
                    return f"{name}: the message ends inside this field (truncated)"
                if field is None:
                    continue
                if field.type == _STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError as e:
                        return f"{name}: not valid UTF-8 (byte {e.start})"
                elif field.type == _MESSAGE and depth < 32:
                    bad = find_bad_field(field.message_type, chunk, name + ".", depth + 1)
                    if bad:
                        return bad
            else:
                return f"{name}: unsupported wire type {wire}"
            if i > len(data):
                return f"{name}: the message ends inside this field (truncated)"
    except ValueError:
        return f"{prefix or 'the request'}: truncated or malformed bytes"
    return None


def safe_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None
    message_class = getattr(deserialize, "__self__", None)
    desc: Descriptor | None = getattr(message_class, "DESCRIPTOR", None)

    def decode(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError, and whatever else a parser may raise
            what = desc.full_name if desc is not None else "request"
            field = find_bad_field(desc, data) if desc is not None else None
            detail = field or f"{type(e).__name__}: {e}"
            return Undecodable(f"the request is not a valid {what} message: {detail}")

    return decode


async def _reject(request: Any, context) -> None:
    if isinstance(request, Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


async def _checked(requests: AsyncIterator[Any], context) -> AsyncIterator[Any]:
    async for request in requests:
        await _reject(request, context)
        yield request


def _code_name(context, default: str) -> str:
    code = context.code()
    if code is None:
        return default
    if isinstance(code, grpc.StatusCode):
        return code.name
    return next((c.name for c in grpc.StatusCode if c.value[0] == code), default)


_TYPES = {(False, False): "unary", (False, True): "server_stream",
          (True, False): "client_stream", (True, True): "bidi_stream"}


class RpcGuard(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        labels = (_TYPES[(handler.request_streaming, handler.response_streaming)], service,
                  method)
        m = self.metrics

        async def accepted(request, context):
            """The request (or request stream) counted and checked, before the handler."""
            m.grpc_started.labels(*labels).inc()
            if handler.request_streaming:
                return _counted(_checked(request, context), m, labels)
            m.grpc_received.labels(*labels).inc()
            await _reject(request, context)
            return request

        @contextlib.contextmanager
        def observed(context) -> Iterator[None]:
            """Handled count (by final code) and latency of the call it wraps."""
            start, failure = time.perf_counter(), None
            try:
                yield
            except BaseException as e:
                failure = e
                raise
            finally:
                default = "OK" if failure is None else _failure_code(failure)
                m.grpc_handled.labels(*labels, _code_name(context, default)).inc()
                m.grpc_handling.labels(*labels).observe(time.perf_counter() - start)

        async def unary_out(request, context):
            with observed(context):
                behavior = handler.unary_unary or handler.stream_unary
                response = await behavior(await accepted(request, context), context)
                m.grpc_sent.labels(*labels).inc()
                return response

        async def stream_out(request, context):
            with observed(context):
                behavior = handler.unary_stream or handler.stream_stream
                async for response in behavior(await accepted(request, context), context):
                    m.grpc_sent.labels(*labels).inc()
                    yield response

        async def stream_written(request, context):
            """A streaming handler that writes with ``context.write`` (health's Watch)."""
            with observed(context):
                behavior = handler.unary_stream or handler.stream_stream
                await behavior(await accepted(request, context), context)

        wrapped: Callable = unary_out
        if handler.response_streaming:
            behavior = handler.unary_stream or handler.stream_stream
            wrapped = stream_out if inspect.isasyncgenfunction(behavior) else stream_written
        return handler._replace(
            request_deserializer=safe_deserializer(handler.request_deserializer),
            unary_unary=wrapped if handler.unary_unary else None,
            unary_stream=wrapped if handler.unary_stream else None,
            stream_unary=wrapped if handler.stream_unary else None,
            stream_stream=wrapped if handler.stream_stream else None)


async def _counted(requests: AsyncIterator[Any], m: Metrics, labels) -> AsyncIterator[Any]:
    async for request in requests:
        m.grpc_received.labels(*labels).inc()
        yield request


def _failure_code(e: BaseException) -> str:
    """The code an exception out of a handler ends its call with when the context has
    none set (an abort sets one)."""
    if isinstance(e, asyncio.CancelledError | GeneratorExit):
        return "CANCELLED"
    return "UNKNOWN"
