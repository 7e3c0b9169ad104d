"""``fmaas.GenerationService``: the TGIS gRPC API on the same engine as ``genserve.v1``.

Only the mapping lives here (TGIS parameters in, TGIS responses out); admission, metrics,
logs, status codes, grammar attachment and the engine calls are the native servicer's,
so both APIs behave the same under load, cancellation and drain.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import aclosing

from engine.outputs import Completion, FinishReason, TokenLogprob
from fmaas import generation_pb2 as tgis
from fmaas import generation_pb2_grpc as tgis_grpc
from genserve.v1 import generation_pb2 as pb
from service.servicer import (
    OFF_LOOP_CHARS,
    Call,
    GenerationServicer,
    TokenTexts,
    off_loop_if,
)
from service.tgis_params import (
    TGIS_STRUCTURED_PREFIX,
    TgisOptions,
    TgisRequest,
    build_request,
    check_adapters,
    tokenize_prompt,
    validate_params,
)
from service.validation import (
    InvalidArgument,
    ParsedRequest,
    check_input_chars,
    new_request_id,
)

SERVICE_NAME = tgis.DESCRIPTOR.services_by_name["GenerationService"].full_name

_STOP: dict[FinishReason | None, tgis.StopReason] = {
    None: tgis.NOT_FINISHED,
    FinishReason.EOS: tgis.EOS_TOKEN,
    FinishReason.STOP_TOKEN: tgis.EOS_TOKEN,
    FinishReason.STOP_SEQUENCE: tgis.STOP_SEQUENCE,
    FinishReason.TIME_LIMIT: tgis.TIME_LIMIT,
    FinishReason.ABORTED: tgis.CANCELLED,
    FinishReason.ERROR: tgis.ERROR,
}


class TokenInfos:
    """``TokenInfo`` messages as a request's ``ResponseOptions`` ask for them."""

    def __init__(self, options: tgis.ResponseOptions, texts: TokenTexts) -> None:
        self.options = options
        self.texts = texts

    def __call__(self, ids: Sequence[int], logprobs: Sequence[TokenLogprob | None]
                 ) -> list[tgis.TokenInfo]:
        """One per id; ``logprobs[i]`` None = no detail for it (the first prompt token)."""
        o = self.options
        top_texts = iter(self.texts([t for lp in logprobs if lp for t, _ in lp.top]))
        infos = []
        for text, lp in zip(self.texts(list(ids)), logprobs, strict=True):
            info = tgis.TokenInfo(text=text)
            if lp is not None:
                if o.token_logprobs:
                    info.logprob = lp.logprob
                if o.token_ranks:
                    info.rank = lp.rank
                for _, value in lp.top[:o.top_n_tokens]:
                    top = info.top_tokens.add(text=next(top_texts))
                    if o.token_logprobs:
                        top.logprob = value
            infos.append(info)
        return infos


class FmaasServicer(tgis_grpc.GenerationServiceServicer):
    def __init__(self, native: GenerationServicer, options: TgisOptions | None = None) -> None:
        self.native = native
        self.options = options or TgisOptions()

    # ---- helpers --------------------------------------------------------------------

    async def _requests(self, params: tgis.Parameters, texts: list[str], call: Call,
                        adapter_id: str = "") -> list[tuple[TgisRequest, ParsedRequest]]:
        """Every prompt checked before any runs: one bad prompt fails the call, as in TGIS;
        a full queue refuses the call first (``GenerationServicer._parse``)."""
        engine = self.native._live
        engine.check_queue()
        limits = self.native.limits
        validate_params(params, limits)
        engine.check_adapter(adapter_id)
        out = []
        for i, text in enumerate(texts):
            try:
                check_input_chars(len(text), "text", limits)
                r = await off_loop_if(len(text) > OFF_LOOP_CHARS, build_request, params, text,
                                      engine.tokenizer, engine.info, limits, self.options)
            except InvalidArgument as e:
                raise InvalidArgument(f"requests[{i}]: {e}" if len(texts) > 1 else str(e)) \
                    from None
            base = call.correlation_id or ""
            rid, engine_id = new_request_id(f"{base}-{i}" if base and len(texts) > 1 else base)
            self.native.started(rid, call)
            out.append((r, ParsedRequest(rid, engine_id, r.prompt_token_ids, r.params,
                                         pb.OutputOptions(), r.structured,
                                         structured_prefix=TGIS_STRUCTURED_PREFIX,
                                         adapter_id=adapter_id)))
        return out

    def _input_details(self, r: TgisRequest, parsed: ParsedRequest,
                       options: tgis.ResponseOptions, infos: TokenInfos,
                       prompt_logprobs: list[TokenLogprob] | None,
                       response: tgis.GenerationResponse) -> None:
        """Input token count, seed, input tokens and the prompt text (``input_text``)."""
        response.input_token_count = len(r.prompt_token_ids)
        if parsed.seed is not None:
            response.seed = parsed.seed
        if options.input_tokens:
            lps: list[TokenLogprob | None] = [None] * len(r.prompt_token_ids)
            if prompt_logprobs:
                lps[1:1 + len(prompt_logprobs)] = prompt_logprobs
            response.input_tokens.extend(infos(r.prompt_token_ids, lps))
        if options.input_text:
            response.text = r.text + response.text

    def _stop(self, r: TgisRequest, reason: FinishReason | None, stop_sequence: str | None,
              last_token: int | None) -> tuple[tgis.StopReason, str]:
        if reason is FinishReason.LENGTH:
            return (tgis.TOKEN_LIMIT if r.token_limited else tgis.MAX_TOKENS), ""
        if reason in (FinishReason.EOS, FinishReason.STOP_TOKEN):
            eos = (self.native.texts([last_token])[0] if last_token is not None
                   else self.native._live.tokenizer.eos_token or "")
            return _STOP[reason], eos
        return _STOP[reason], stop_sequence or ""

    def _response(self, r: TgisRequest, parsed: ParsedRequest, c: Completion,
                  options: tgis.ResponseOptions, infos: TokenInfos,
                  prompt_logprobs: list[TokenLogprob] | None) -> tgis.GenerationResponse:
        stop, sequence = self._stop(r, c.finish_reason, c.stop_sequence,
                                    c.token_ids[-1] if c.token_ids else None)
        response = tgis.GenerationResponse(
            generated_token_count=len(c.token_ids), text=c.text, stop_reason=stop,
            stop_sequence=sequence)
        if options.generated_tokens:
            response.tokens.extend(infos(c.token_ids, c.logprobs or [None] * len(c.token_ids)))
        self._input_details(r, parsed, options, infos, prompt_logprobs, response)
        return response

    # ---- RPCs -----------------------------------------------------------------------

    async def Generate(self, request, context):
        async with self.native._call("fmaas/Generate", context) as call:
            call.inputs = len(request.requests)
            check_adapters(request)
            if not request.requests:
                raise InvalidArgument("requests must not be empty")
            limit = self.native.limits.max_batch_size
            if len(request.requests) > limit:
                raise InvalidArgument(f"requests has {len(request.requests)} items; the limit "
                                      f"is {limit}")
            work = await self._requests(request.params, [q.text for q in request.requests],
                                        call, request.adapter_id)
            options = request.params.response
            infos = TokenInfos(options, self.native.texts)

            async def one(r: TgisRequest, parsed: ParsedRequest) -> tgis.GenerationResponse:
                collector = await self.native.complete(parsed, call)
                completion = collector.completions()[0]
                return self._response(r, parsed, completion, options, infos,
                                      collector.prompt_logprobs)

            try:  # in order; the first failure cancels the rest and fails the call
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(one(r, p)) for r, p in work]
            except BaseExceptionGroup as eg:
                raise eg.exceptions[0] from None
            return tgis.BatchedGenerationResponse(responses=[t.result() for t in tasks])

    async def GenerateStream(self, request, context):
        async with self.native._call("fmaas/GenerateStream", context) as call:
            check_adapters(request)
            ((r, parsed),) = await self._requests(request.params, [request.request.text], call,
                                                  request.adapter_id)
            await self.native._attach_grammar(parsed)
            options = request.params.response
            infos = TokenInfos(options, self.native.texts)
            generated = 0
            first = True
            async with aclosing(self.native.stream(parsed, call)) as stream:
                async for out in stream:
                    if first:  # input details, once the prompt (and its logprobs) is done
                        head = tgis.GenerationResponse()
                        self._input_details(r, parsed, options, infos, out.prompt_logprobs, head)
                        yield head
                        first = False
                    for d in out.deltas:
                        generated += len(d.token_ids)
                        if not d.token_ids and not d.text and d.finish_reason is None:
                            continue
                        stop, sequence = self._stop(r, d.finish_reason, d.stop_sequence,
                                                    d.token_ids[-1] if d.token_ids else None)
                        msg = tgis.GenerationResponse(
                            text=d.text, generated_token_count=generated, stop_reason=stop,
                            stop_sequence=sequence)
                        if options.generated_tokens and d.token_ids:
                            msg.tokens.extend(infos(d.token_ids,
                                                    d.logprobs or [None] * len(d.token_ids)))
                        yield msg

    async def Tokenize(self, request, context):
        async with self.native._call("fmaas/Tokenize", context, generation=False):
            check_adapters(request)
            self.native._live.check_adapter(request.adapter_id)  # adapters share the tokenizer
            tokenizer = self.native._live.tokenizer
            texts = self.native.texts
            responses = []
            for i, req in enumerate(request.requests):
                check_input_chars(len(req.text), f"requests[{i}].text", self.native.limits)
                ids = await off_loop_if(len(req.text) > OFF_LOOP_CHARS, tokenize_prompt,
                                        req.text, tokenizer, request.truncate_input_tokens)
                response = tgis.TokenizeResponse(token_count=len(ids))
                if request.return_tokens:
                    response.tokens.extend(texts(ids))
                if request.return_offsets and ids:
                    response.offsets.extend(await off_loop_if(
                        len(req.text) > OFF_LOOP_CHARS, _offsets, tokenizer, req.text,
                        len(ids)))
                responses.append(response)
            return tgis.BatchedTokenizeResponse(responses=responses)

    async def ModelInfo(self, request, context):
        async with self.native._call("fmaas/ModelInfo", context, generation=False):
            return tgis.ModelInfoResponse(
                model_kind=tgis.ModelInfoResponse.DECODER_ONLY,
                max_sequence_length=self.native._live.info.max_model_len,
                max_new_tokens=self.native.limits.max_new_tokens)


def _offsets(tokenizer, text: str, count: int) -> list[tgis.TokenizeResponse.Offset]:
    """Character offsets of the last ``count`` tokens (those a truncation keeps)."""
    try:
        spans = tokenizer(text, return_offsets_mapping=True)["offset_mapping"]
    except NotImplementedError:
        raise InvalidArgument("return_offsets: the served model's tokenizer cannot report "
                              "offsets (it is not a fast tokenizer)") from None
    return [tgis.TokenizeResponse.Offset(start=a, end=b) for a, b in spans[-count:]]
