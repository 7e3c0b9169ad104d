"""GenerationService: maps proto <-> engine types and status codes; no engine logic here."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import grpc

from engine.async_engine import AsyncEngine
from engine.config import EngineDeadError, QueueFullError, RequestError
from engine.output_collector import OutputCollector
from engine.outputs import (
    Completion,
    CompletionDelta,
    FinishReason,
    RequestOutput,
    RequestTimes,
    TokenLogprob,
    Usage,
)
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from service.logs import request_id_var
from service.metrics import FINISHED_REASON, Metrics
from service.processor_plugins import PluginRegistry
from service.validation import (
    InvalidArgument,
    ParsedRequest,
    ServiceLimits,
    check_input_chars,
    check_request_id,
    parse_request,
)
from structured.manager import StructuredOutputs

if TYPE_CHECKING:  # opentelemetry is imported only when tracing is on
    from service.tracing import RequestTracer

log = logging.getLogger(__name__)
T = TypeVar("T")

FINISH: dict[FinishReason | None, pb.FinishReason] = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.STOP_TOKEN: pb.FINISH_REASON_STOP_TOKEN,
    FinishReason.TIME_LIMIT: pb.FINISH_REASON_TIME_LIMIT,
    FinishReason.ABORTED: pb.FINISH_REASON_ABORTED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}


# RPC names as metrics and logs label them (the TGIS API's under "fmaas/")
GENERATION_RPCS = frozenset({"Generate", "GenerateBatch", "GenerateStream", "fmaas/Generate",
                             "fmaas/GenerateStream"})
BATCH_RPCS = frozenset({"GenerateBatch", "fmaas/Generate"})


class RequestFailed(Exception):
    """A request that cannot be answered normally, with the gRPC status to answer."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# The request field an engine limit is about (``RequestError.limit``).
_ENGINE_LIMIT_FIELDS = {"prompt": "input", "vocabulary": "prompt_token_ids.ids",
                        "context": "input", "kv_cache": "stopping.max_new_tokens",
                        "adapter": "adapter_id"}


def status_of(exc: BaseException) -> RequestFailed:
    if isinstance(exc, RequestFailed):
        return exc
    if isinstance(exc, RequestError):  # the engine's own checks, named in engine terms
        return RequestFailed(grpc.StatusCode.INVALID_ARGUMENT,
                             f"{_ENGINE_LIMIT_FIELDS.get(exc.limit, 'input')}: {exc}")
    if isinstance(exc, ValueError):  # InvalidArgument
        return RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, QueueFullError):
        return RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, EngineDeadError):
        return RequestFailed(grpc.StatusCode.UNAVAILABLE, str(exc))
    log.exception("unexpected error", exc_info=exc)
    return RequestFailed(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


def spec_failure(parsed: ParsedRequest, c: CompletionDelta) -> RequestFailed | None:
    """INVALID_ARGUMENT for an output the engine ended because the request's own spec could
    not be enforced (a backend's limit met mid-output), naming the field in this API's
    terms; None for any other ending."""
    if c.finish_reason is not FinishReason.ERROR or c.invalid_field is None:
        return None
    field = c.invalid_field  # "": the request as a whole (its message says why)
    return RequestFailed(grpc.StatusCode.INVALID_ARGUMENT,
                         f"{parsed.structured_prefix}{field}: {c.error}" if field
                         else c.error or "the request cannot be served")


@dataclass
class Call:
    """One RPC being answered: what its metrics and its finished-request log line need."""

    rpc: str
    correlation_id: str = ""  # x-correlation-id metadata: the request id in logs
    arrival: float = field(default_factory=time.perf_counter)
    code: grpc.StatusCode = grpc.StatusCode.OK
    request_ids: list[str] = field(default_factory=list)
    usage: dict[str, Usage] = field(default_factory=dict)  # per engine request, latest
    item_codes: list[grpc.StatusCode] = field(default_factory=list)  # GenerateBatch
    trace: dict[str, str] | None = None  # the caller's traceparent headers, when tracing
    inputs: int = 1  # generation inputs the call carries (a batch's item count)

    def totals(self) -> tuple[int, int]:
        return (sum(u.prompt_tokens for u in self.usage.values()),
                sum(u.completion_tokens for u in self.usage.values()))


@dataclass
class ServerState:
    """Shared between servicer and server. ``draining``: SIGTERM came, GOAWAY is sent, and
    calls gRPC still hands over (accepted before its GOAWAY, dispatched late on a busy
    loop) are served; ``closing``: the drain is ending, so a call now is refused
    UNAVAILABLE (retried elsewhere) rather than cut mid-way."""

    draining: bool = False
    closing: bool = False
    in_flight: int = 0
    last_call_at: float = 0.0  # time.monotonic() of the newest generation call's start


@dataclass
class TokenClock:
    """TTFT and per-token metrics of one sequence group from when its steps' tokens came:
    arrival -> first token, then each later step's ``tokens`` share its interval."""

    metrics: Metrics
    arrival: float
    last: float | None = None  # when the previous token(s) came

    def tick(self, now: float, tokens: int) -> None:
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            per_token = (now - self.last) / tokens
            for _ in range(tokens):
                self.metrics.tpot.observe(per_token)
        self.last = now


class TokenTexts:
    """Vocabulary pieces of token ids (what logprobs name tokens by), one tokenizer call
    per batch of ids."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, ids: list[int]) -> list[str]:
        return [t or "" for t in self.tokenizer.convert_ids_to_tokens(ids)] if ids else []


def _logprobs_pb(items: list[TokenLogprob], texts: TokenTexts) -> list[pb.TokenLogprob]:
    if not items:
        return []
    top_texts = iter(texts([t for lp in items for t, _ in lp.top]))
    out = []
    for lp, text in zip(items, texts([lp.token_id for lp in items]), strict=True):
        out.append(pb.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob, text=text, rank=lp.rank,
            top=[pb.TopLogprob(token_id=t, logprob=v, text=next(top_texts))
                 for t, v in lp.top]))
    return out


def _usage_pb(u: Usage) -> pb.Usage:
    return pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                    spec_proposed_tokens=u.spec_proposed_tokens,
                    spec_accepted_tokens=u.spec_accepted_tokens,
                    cached_prompt_tokens=u.cached_prompt_tokens)


def _completion_pb(c: Completion, want_ids: bool, texts: TokenTexts) -> pb.Completion:
    return pb.Completion(
        index=c.index, text=c.text, token_ids=c.token_ids if want_ids else [],
        finish_reason=FINISH[c.finish_reason],
        stop_sequence=c.stop_sequence or "", logprobs=_logprobs_pb(c.logprobs, texts),
        error=c.error or "")


# Inputs longer than this are parsed and tokenised in a worker thread, so a big request
# never stalls the event loop (health checks, streams); shorter ones are cheaper in place.
OFF_LOOP_CHARS = 4096


def input_chars(req: pb.GenerateRequest) -> int:
    return len(req.prompt) + sum(len(m.content) for m in req.chat.messages)


async def off_loop_if(big: bool, fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.to_thread(fn, *args) if big else fn(*args)


# A C++ backend's log prefix: "[02:03:16] /project/cpp/regex_converter.cc:83: "
_NATIVE_PREFIX = re.compile(r"\[\d{2}:\d{2}:\d{2}\] \S+?\.(?:cc|cpp|cxx|h|hpp):\d+: ")


def clean_backend_message(message: str) -> str:
    """A grammar backend's error without its timestamp and C++ source path (they say
    nothing to a client and leak the build's file layout)."""
    return re.sub(r"\s*\n\s*", " ", _NATIVE_PREFIX.sub("", message)).strip()


def correlation_id(context) -> str:
    """The caller's ``x-correlation-id`` metadata (TGIS clients send one), or ''."""
    for key, value in context.invocation_metadata() or ():
        if key == "x-correlation-id" and isinstance(value, str):
            return value
    return ""


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, engine: AsyncEngine | None, limits: ServiceLimits,
                 state: ServerState, metrics: Metrics | None = None) -> None:
        self.engine = engine  # None while the model loads: calls get UNAVAILABLE
        self.limits = limits
        self.state = state
        self.metrics = metrics or Metrics()
        self.registry: PluginRegistry | None = None
        self.structured: StructuredOutputs | None = None
        self.served_model_name: str | None = None  # --served-model-name
        self.tracer: RequestTracer | None = None  # --otlp-traces-endpoint; None = off

    # ---- helpers --------------------------------------------------------------------

    @property
    def _live(self) -> AsyncEngine:
        """The engine, once ready (``_check_open`` turned every call away before that)."""
        assert self.engine is not None
        return self.engine

    @property
    def texts(self) -> TokenTexts:
        return TokenTexts(self._live.tokenizer)

    async def _parse(self, req: pb.GenerateRequest, call: Call) -> ParsedRequest:
        """The request in engine terms; a full queue refuses it first, before any of the
        work (tokenizing, later compiling its grammar) it would cost."""
        if req.request_id or call.correlation_id:  # in the log even for an invalid request
            request_id_var.set(req.request_id or call.correlation_id)
        self._live.check_queue()
        parsed = await off_loop_if(input_chars(req) > OFF_LOOP_CHARS, parse_request, req,
                                   self._live.tokenizer, self._live.info, self.limits,
                                   self.registry, call.correlation_id)
        self._live.check_adapter(parsed.adapter_id)  # before compiling a grammar for it
        self.started(parsed.request_id, call)
        return parsed

    @staticmethod
    def started(request_id: str, call: Call) -> None:
        request_id_var.set(request_id)
        call.request_ids.append(request_id)

    def _check_open(self) -> None:
        if self.state.closing:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        if self.engine is None:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "the model is still loading")

    @asynccontextmanager
    async def _call(self, rpc: str, context, generation: bool = True) -> AsyncIterator[Call]:
        """Answer one RPC: status code on failure, metrics and one log line at the end.

        An exception from the body becomes the call's status (``status_of``); a cancelled
        call is CANCELLED, or DEADLINE_EXCEEDED when the client's deadline passed.
        ``generation`` calls count as in flight (the drain waits for them).
        """
        given = correlation_id(context)
        try:  # it names the request in logs and answers, so it is held to request_id's rules
            check_request_id(given, "x-correlation-id metadata")
            bad_id = None
        except InvalidArgument as e:
            given, bad_id = "", e
        call = Call(rpc, correlation_id=given)
        if self.tracer is not None and generation:
            call.trace = self.tracer.carrier(context.invocation_metadata())
        token = request_id_var.set(call.correlation_id or None)
        counted = False
        try:
            if bad_id is not None:
                raise bad_id
            self._check_open()
            if generation:
                self.state.in_flight += 1
                self.state.last_call_at = time.monotonic()
                counted = True
            yield call
        except asyncio.CancelledError:
            call.code = _cancelled_code(context)
            raise
        except GeneratorExit:  # a streaming call closed by the framework
            call.code = _cancelled_code(context)
            raise
        except Exception as e:
            failed = status_of(e)
            call.code = failed.code
            await context.abort(failed.code, failed.message)
        finally:
            if counted:
                self.state.in_flight -= 1
            try:
                self._finished(call)
            finally:
                with suppress(ValueError):  # a stream finalized in another context
                    request_id_var.reset(token)

    def _finished(self, call: Call) -> None:
        duration = time.perf_counter() - call.arrival
        prompt, completion = call.totals()
        m = self.metrics
        m.requests.labels(call.rpc, call.code.name).inc()
        m.request_duration.labels(call.rpc).observe(duration)
        m.prompt_tokens.inc(prompt)
        m.generation_tokens.inc(completion)
        for code in call.item_codes:
            m.batch_items.labels(code.name).inc()
        m.observe_call(call.rpc, call.code.name, call.inputs, duration,
                       [c.name for c in call.item_codes])
        extra: dict = {"rpc": call.rpc, "code": call.code.name,
                       "duration_ms": round(duration * 1000, 3)}
        if call.rpc in GENERATION_RPCS:
            extra.update(prompt_tokens=prompt, completion_tokens=completion)
        if call.rpc in BATCH_RPCS:
            extra.update(items=len(call.item_codes), request_ids=call.request_ids)
        elif call.request_ids:
            extra["request_id"] = call.request_ids[0]
        tokens = (f" prompt_tokens={prompt} completion_tokens={completion}"
                  if "prompt_tokens" in extra else "")
        log.info("%s %s in %.1f ms%s", call.rpc, call.code.name, duration * 1000, tokens,
                 extra=extra)

    async def _attach_grammar(self, parsed: ParsedRequest) -> None:
        """Compile (off the engine thread, cached) and append the grammar's factory."""
        if parsed.structured is None:
            return
        if self.structured is None:
            raise InvalidArgument(f"{parsed.structured_prefix.rstrip('.') or 'guided'}: "
                                  "structured output is disabled on this server")
        try:
            factory = await self.structured.factory(parsed.structured,
                                                    parsed.structured_prefix)
        except ValueError as e:  # InvalidArgument: the backends' reasons, made readable
            raise InvalidArgument(clean_backend_message(str(e))) from None
        parsed.params.logits_processors.append(factory)
        parsed.grammar = factory

    async def complete(self, parsed: ParsedRequest, call: Call) -> OutputCollector:
        """A unary request: merged on the engine thread, this coroutine woken once."""
        await self._attach_grammar(parsed)
        key = parsed.engine_request_id
        collector = OutputCollector(key, parsed.params.n,
                                    Usage(prompt_tokens=len(parsed.prompt_token_ids)))
        try:
            await self._live.complete(key, parsed.prompt_token_ids, parsed.params, collector,
                                      adapter_id=parsed.adapter_id)
        finally:  # cancelled too: count the tokens made before the abort
            call.usage[key] = collector.usage
        clock = TokenClock(self.metrics, call.arrival)
        for when, tokens in collector.token_times:
            clock.tick(when, tokens)
        if collector.finished:
            reasons = [c.finish_reason for c in collector.completions() if c.finish_reason]
            self.metrics.observe_request(collector.times, collector.usage, reasons,
                                         parsed.params.max_new_tokens)
            self._trace(parsed, call, collector.usage, collector.times, reasons)
        return collector

    def _trace(self, parsed: ParsedRequest, call: Call, usage: Usage,
               times: RequestTimes | None, reasons: list[FinishReason]) -> None:
        """A finished request's span, when tracing is on."""
        if self.tracer is None or call.trace is None:
            return
        try:
            self.tracer.record(call.trace, parsed.request_id, self.metrics.model_name,
                               parsed.params, usage, times,
                               [FINISHED_REASON[r] for r in reasons])
        except Exception:  # tracing is auxiliary: never fail the answer for it
            log.exception("could not record the request's trace span")

    async def _generate(self, parsed: ParsedRequest, call: Call) -> pb.GenerateResponse:
        collector = await self.complete(parsed, call)
        completions = collector.completions()
        for c in completions:
            if (invalid := spec_failure(parsed, c)) is not None:
                raise invalid
        # an output that failed its structured-output check is an answer, not a failure
        errors = [c.error for c in completions
                  if c.finish_reason is FinishReason.ERROR and not c.rejected]
        if errors:
            raise RequestFailed(grpc.StatusCode.INTERNAL, errors[0] or "generation failed")
        texts = self.texts
        return pb.GenerateResponse(
            request_id=parsed.request_id,
            completions=[_completion_pb(c, parsed.output.return_token_ids, texts)
                         for c in completions],
            usage=_usage_pb(collector.usage),
            prompt_token_ids=(parsed.prompt_token_ids
                              if parsed.output.return_prompt_token_ids else []),
            prompt_logprobs=_logprobs_pb(collector.prompt_logprobs or [], texts),
            seed=parsed.seed,
            structured_backend=parsed.grammar.backend if parsed.grammar else "",
        )

    async def stream(self, parsed: ParsedRequest,
                      call: Call) -> AsyncGenerator[RequestOutput, None]:
        """The engine's output stream, timed (TTFT, per-token) and its usage kept in
        ``call``; closing it (aclosing) aborts the request at once."""
        key = parsed.engine_request_id
        call.usage[key] = Usage(prompt_tokens=len(parsed.prompt_token_ids))
        clock = TokenClock(self.metrics, call.arrival)
        engine_stream = cast(AsyncGenerator[RequestOutput, None], self._live.generate(
            key, parsed.prompt_token_ids, parsed.params, adapter_id=parsed.adapter_id))
        reasons: list[FinishReason] = []
        async with aclosing(engine_stream) as stream:
            async for out in stream:
                call.usage[key] = out.usage
                step = max((len(d.token_ids) for d in out.deltas), default=0)
                if step:
                    clock.tick(time.perf_counter(), step)
                reasons.extend(d.finish_reason for d in out.deltas if d.finish_reason)
                if out.finished:
                    self.metrics.observe_request(out.times, out.usage, reasons,
                                                 parsed.params.max_new_tokens)
                    self._trace(parsed, call, out.usage, out.times, reasons)
                yield out

    # ---- RPCs -----------------------------------------------------------------------

    async def Generate(self, request, context):
        async with self._call("Generate", context) as call:
            return await self._generate(await self._parse(request, call), call)

    async def GenerateBatch(self, request, context):
        async with self._call("GenerateBatch", context) as call:
            items = request.requests
            call.inputs = len(items)
            if not items:
                raise InvalidArgument("requests must not be empty")
            if len(items) > self.limits.max_batch_size:
                raise InvalidArgument(f"requests has {len(items)} items; the limit is "
                                      f"{self.limits.max_batch_size}")

            async def one(req: pb.GenerateRequest) -> pb.GenerateResponse:
                # each item runs in its own task, so its request id stays its own
                return await self._generate(await self._parse(req, call), call)

            outcomes = await asyncio.gather(*(one(r) for r in items), return_exceptions=True)
            results = []
            for i, o in enumerate(outcomes):
                if isinstance(o, asyncio.CancelledError):
                    raise o
                if isinstance(o, BaseException):
                    failed = status_of(o)
                    call.item_codes.append(failed.code)
                    results.append(pb.BatchResult(index=i, error=pb.Error(
                        code=failed.code.value[0], message=failed.message)))
                else:
                    call.item_codes.append(grpc.StatusCode.OK)
                    results.append(pb.BatchResult(index=i, response=o))
            return pb.GenerateBatchResponse(results=results)

    async def GenerateStream(self, request, context):
        async with self._call("GenerateStream", context) as call:
            parsed = await self._parse(request.request, call)
            await self._attach_grammar(parsed)
            failed: RequestFailed | None = None
            texts = self.texts
            first = True
            async with aclosing(self.stream(parsed, call)) as stream:
                async for out in stream:
                    for d in out.deltas:  # a failure: its status once the ERROR finish is sent
                        if failed is None and d.finish_reason is FinishReason.ERROR \
                                and not d.rejected:
                            failed = spec_failure(parsed, d) or RequestFailed(
                                grpc.StatusCode.INTERNAL, d.error or "generation failed")
                    msgs = [self._delta_pb(parsed, d, texts) for d in out.deltas]
                    if first and (parsed.seed is not None or out.prompt_logprobs):
                        if not msgs:
                            msgs.append(pb.GenerateStreamResponse(
                                request_id=parsed.request_id))
                        if parsed.seed is not None:
                            msgs[0].seed = parsed.seed
                        msgs[0].prompt_logprobs.extend(
                            _logprobs_pb(out.prompt_logprobs or [], texts))
                    first = False
                    if out.finished:
                        if not msgs:
                            msgs.append(pb.GenerateStreamResponse(
                                request_id=parsed.request_id))
                        msgs[-1].usage.CopyFrom(_usage_pb(out.usage))
                    for m in msgs:
                        yield m
            if failed is not None:
                raise failed

    @staticmethod
    def _delta_pb(parsed: ParsedRequest, d: CompletionDelta,
                  texts: TokenTexts) -> pb.GenerateStreamResponse:
        """One message per delta, per token: only the fields a plain token sets (half the
        cost of naming every field); the rest only when there is something in them."""
        msg = pb.GenerateStreamResponse(request_id=parsed.request_id, index=d.index,
                                        text=d.text, token_ids=d.token_ids)
        if d.logprobs:
            msg.logprobs.extend(_logprobs_pb(d.logprobs, texts))
        if d.finish_reason is not None:
            msg.finish_reason = FINISH[d.finish_reason]
            msg.stop_sequence = d.stop_sequence or ""
            msg.error = d.error or ""
        return msg

    async def Tokenize(self, request, context):
        async with self._call("Tokenize", context, generation=False):
            tokenizer = self._live.tokenizer
            check_input_chars(len(request.text), "text", self.limits)
            ids = (await off_loop_if(len(request.text) > OFF_LOOP_CHARS, tokenizer,
                                     request.text))["input_ids"] if request.text else []
            tokens = tokenizer.convert_ids_to_tokens(ids) if request.return_tokens else []
            return pb.TokenizeResponse(token_ids=ids, tokens=tokens)

    def _backend_info(self, kinds: dict[str, list[str]]) -> list[pb.StructuredBackendInfo]:
        stats = self.structured.stats.backends if self.structured else {}
        out = []
        for name, k in kinds.items():
            s = stats.get(name)
            out.append(pb.StructuredBackendInfo(name=name, kinds=k) if s is None else
                       pb.StructuredBackendInfo(
                           name=name, kinds=k, requests=s.requests, compiles=s.compiles,
                           compile_failures=s.failures,
                           compile_seconds_total=s.compile_seconds,
                           compile_seconds_max=s.max_compile_seconds))
        return out

    async def GetModelInfo(self, request, context):
        async with self._call("GetModelInfo", context, generation=False):
            info = self._live.info
            stats = self._live.stats()
            kinds = self.structured.kinds() if self.structured else {}
            return pb.GetModelInfoResponse(
                model_id=self.served_model_name or info.model_id,
                max_model_len=info.max_model_len,
                vocab_size=info.vocab_size, eos_token_ids=info.eos_token_ids,
                structured_backends=list(kinds),
                speculative=pb.SpeculativeInfo(method=info.spec_method, k=info.spec_k),
                runner=info.runner, quantization=info.quantization,
                structured_backend_info=self._backend_info(kinds),
                max_new_tokens=self.limits.max_new_tokens,
                prefix_cache=pb.PrefixCacheInfo(
                    enabled=info.prefix_caching, queries=stats.prefix_cache_queries,
                    hits=stats.prefix_cache_hits, cached_blocks=stats.prefix_cache_blocks),
                adapters=[pb.LoadedAdapter(
                    adapter_id=a.adapter_id, rank=a.rank, target_modules=a.target_modules,
                    load_seconds=a.load_seconds, active_requests=a.active_requests)
                    for a in self._live.adapter_status()],
                max_loras=info.max_loras)


def _cancelled_code(context) -> grpc.StatusCode:
    """CANCELLED, or DEADLINE_EXCEEDED when the client's deadline is what ended the call."""
    try:
        remaining = context.time_remaining()
    except Exception:
        remaining = None
    if remaining is not None and remaining <= 0.05:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED
