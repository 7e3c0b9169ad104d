"""GenerationService: maps proto <-> engine types and status codes; no engine logic here."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from dataclasses import dataclass

import grpc

from engine.async_engine import AsyncEngine
from engine.config import EngineDeadError, QueueFullError
from engine.outputs import Completion, CompletionDelta, FinishReason, TokenLogprob, Usage
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc
from service.processor_plugins import PluginRegistry
from service.validation import InvalidArgument, ParsedRequest, ServiceLimits, parse_request
from structured.manager import StructuredOutputs

log = logging.getLogger(__name__)

FINISH: dict[FinishReason | None, int] = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.STOP_TOKEN: pb.FINISH_REASON_STOP_TOKEN,
    FinishReason.TIME_LIMIT: pb.FINISH_REASON_TIME_LIMIT,
    FinishReason.ABORTED: pb.FINISH_REASON_ABORTED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}


class RequestFailed(Exception):
    """A request that cannot be answered normally, with the gRPC status to answer."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def status_of(exc: BaseException) -> RequestFailed:
    if isinstance(exc, RequestFailed):
        return exc
    if isinstance(exc, ValueError):  # InvalidArgument and the engine's own checks
        return RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, QueueFullError):
        return RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, EngineDeadError):
        return RequestFailed(grpc.StatusCode.UNAVAILABLE, str(exc))
    log.exception("unexpected error", exc_info=exc)
    return RequestFailed(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


@dataclass
class ServerState:
    """Shared between servicer and server: draining refuses new work."""

    draining: bool = False
    in_flight: int = 0


def _logprobs_pb(items: list[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
            for lp in items]


def _usage_pb(u: Usage) -> pb.Usage:
    return pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                    spec_proposed_tokens=u.spec_proposed_tokens,
                    spec_accepted_tokens=u.spec_accepted_tokens)


def _completion_pb(c: Completion, want_ids: bool) -> pb.Completion:
    return pb.Completion(
        index=c.index, text=c.text, token_ids=c.token_ids if want_ids else [],
        finish_reason=FINISH[c.finish_reason],
        stop_sequence=c.stop_sequence or "", logprobs=_logprobs_pb(c.logprobs),
        error=c.error or "")


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, engine: AsyncEngine | None, limits: ServiceLimits,
                 state: ServerState) -> None:
        self.engine = engine  # None while the model loads: calls get UNAVAILABLE
        self.limits = limits
        self.state = state
        self.registry: PluginRegistry | None = None
        self.structured: StructuredOutputs | None = None

    # ---- helpers --------------------------------------------------------------------

    @property
    def _live(self) -> AsyncEngine:
        """The engine, once ready (``_check_open`` turned every call away before that)."""
        assert self.engine is not None
        return self.engine

    def _parse(self, req: pb.GenerateRequest) -> ParsedRequest:
        return parse_request(req, self._live.tokenizer, self._live.info, self.limits,
                             self.registry)

    async def _check_open(self, context) -> None:
        if self.state.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")

    async def _attach_grammar(self, parsed: ParsedRequest) -> None:
        """Compile (off the engine thread, cached) and append the grammar's factory."""
        if parsed.structured is None:
            return
        if self.structured is None:
            raise InvalidArgument("structured_output: structured output is disabled on this "
                                  "server")
        factory = await self.structured.factory(parsed.structured)
        parsed.params.logits_processors.append(factory)

    async def _generate(self, parsed: ParsedRequest) -> pb.GenerateResponse:
        await self._attach_grammar(parsed)
        completions = [Completion(i) for i in range(parsed.params.n)]
        usage = Usage(prompt_tokens=len(parsed.prompt_token_ids))
        async with aclosing(self._stream(parsed)) as stream:
            async for out in stream:
                for d in out.deltas:
                    completions[d.index].add(d)
                usage = out.usage
        errors = [c.error for c in completions if c.finish_reason is FinishReason.ERROR]
        if errors:
            raise RequestFailed(grpc.StatusCode.INTERNAL, errors[0] or "generation failed")
        return pb.GenerateResponse(
            request_id=parsed.request_id,
            completions=[_completion_pb(c, parsed.output.return_token_ids)
                         for c in completions],
            usage=_usage_pb(usage),
            prompt_token_ids=(parsed.prompt_token_ids
                              if parsed.output.return_prompt_token_ids else []),
        )

    def _stream(self, parsed: ParsedRequest):
        """The engine's output stream; closing it (aclosing) aborts the request at once."""
        return self._live.generate(parsed.engine_request_id, parsed.prompt_token_ids,
                                   parsed.params)

    async def _answer(self, context, coro):
        self.state.in_flight += 1
        try:
            return await coro
        except asyncio.CancelledError:
            raise
        except Exception as e:
            failed = status_of(e)
            await context.abort(failed.code, failed.message)
        finally:
            self.state.in_flight -= 1

    # ---- RPCs -----------------------------------------------------------------------

    async def Generate(self, request, context):
        await self._check_open(context)

        async def run():
            return await self._generate(self._parse(request))

        return await self._answer(context, run())

    async def GenerateBatch(self, request, context):
        await self._check_open(context)
        items = request.requests
        if not items:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "requests must not be empty")
        if len(items) > self.limits.max_batch_size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"requests has {len(items)} items; the limit is "
                                f"{self.limits.max_batch_size}")

        async def one(req: pb.GenerateRequest) -> pb.GenerateResponse:
            return await self._generate(self._parse(req))

        async def run():
            outcomes = await asyncio.gather(*(one(r) for r in items), return_exceptions=True)
            results = []
            for i, o in enumerate(outcomes):
                if isinstance(o, asyncio.CancelledError):
                    raise o
                if isinstance(o, BaseException):
                    failed = status_of(o)
                    results.append(pb.BatchResult(index=i, error=pb.Error(
                        code=failed.code.value[0], message=failed.message)))
                else:
                    results.append(pb.BatchResult(index=i, response=o))
            return pb.GenerateBatchResponse(results=results)

        return await self._answer(context, run())

    async def GenerateStream(self, request, context):
        await self._check_open(context)
        self.state.in_flight += 1
        try:
            try:
                parsed = self._parse(request.request)
                await self._attach_grammar(parsed)
                error: str | None = None
                async with aclosing(self._stream(parsed)) as stream:
                    async for out in stream:
                        msgs = [self._delta_pb(parsed, d) for d in out.deltas]
                        for d in out.deltas:
                            if d.finish_reason is FinishReason.ERROR:
                                error = error or d.error
                        if out.finished:
                            if not msgs:
                                msgs.append(pb.GenerateStreamResponse(
                                    request_id=parsed.request_id))
                            msgs[-1].usage.CopyFrom(_usage_pb(out.usage))
                        for m in msgs:
                            yield m
                if error is not None:
                    raise RequestFailed(grpc.StatusCode.INTERNAL, error)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                failed = status_of(e)
                await context.abort(failed.code, failed.message)
        finally:
            self.state.in_flight -= 1

    @staticmethod
    def _delta_pb(parsed: ParsedRequest, d: CompletionDelta) -> pb.GenerateStreamResponse:
        return pb.GenerateStreamResponse(
            request_id=parsed.request_id, index=d.index, text=d.text, token_ids=d.token_ids,
            finish_reason=FINISH[d.finish_reason],
            stop_sequence=d.stop_sequence or "", logprobs=_logprobs_pb(d.logprobs),
            error=d.error or "")

    async def Tokenize(self, request, context):
        await self._check_open(context)
        ids = self.engine.tokenizer(request.text)["input_ids"] if request.text else []
        tokens = self.engine.tokenizer.convert_ids_to_tokens(ids) if request.return_tokens else []
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def GetModelInfo(self, request, context):
        await self._check_open(context)
        info = self.engine.info
        kinds = self.structured.kinds() if self.structured else {}
        return pb.GetModelInfoResponse(
            model_id=info.model_id, max_model_len=info.max_model_len,
            vocab_size=info.vocab_size, eos_token_ids=info.eos_token_ids,
            structured_backends=list(kinds), speculative=pb.SpeculativeInfo(method="", k=0),
            structured_backend_info=[pb.StructuredBackendInfo(name=n, kinds=k)
                                     for n, k in kinds.items()])
