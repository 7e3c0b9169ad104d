"""OpenTelemetry tracing of generation requests (``--otlp-traces-endpoint``, vLLM's flag).

One ``llm_request`` span per engine request (a GenerateBatch item, each TGIS input),
recorded when the request finishes, as a child of the caller's W3C ``traceparent``
gRPC metadata. Like vLLM, the span is built after the fact with explicit start and end
times (the request's arrival and finish in the engine), so nothing runs per token and
nothing at all runs when tracing is off: the servicer then holds no ``RequestTracer``
and never reads the metadata. Attribute names are vLLM's ``SpanAttributes``.

The engine never imports this module: it only hands back ``RequestTimes``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.outputs import RequestTimes, Usage
from engine.sampling_params import SamplingParams

SPAN_NAME = "llm_request"  # vLLM's
# The W3C trace-context headers the propagator reads (gRPC metadata keys are lower case).
TRACE_HEADERS = ("traceparent", "tracestate")

# vLLM's SpanAttributes (vllm/tracing.py) that we can fill.
REQUEST_ID = "gen_ai.request.id"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"  # vLLM's words: stop, length...
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_N = "gen_ai.request.n"
USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
LATENCY_E2E = "gen_ai.latency.e2e"
LATENCY_PREFILL = "gen_ai.latency.time_in_model_prefill"
LATENCY_DECODE = "gen_ai.latency.time_in_model_decode"
LATENCY_INFERENCE = "gen_ai.latency.time_in_model_inference"

_propagator = TraceContextTextMapPropagator()


def _between(a: float | None, b: float | None) -> float | None:
    return b - a if a is not None and b is not None else None


class RequestTracer:
    """Records finished requests as spans on its own ``TracerProvider`` (never the
    global one, so several servers, and tests, can share a process)."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("genserve")

    @classmethod
    def otlp(cls, endpoint: str) -> RequestTracer:
        """Spans batched and exported over OTLP/gRPC to ``endpoint`` (``http://`` =
        plaintext; the usual ``OTEL_EXPORTER_OTLP_*`` variables still apply)."""
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider = TracerProvider(resource=Resource.create({"service.name": "genserve"}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        return cls(provider)

    @staticmethod
    def carrier(metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
        """The trace-context headers of a call's invocation metadata."""
        return {k: v for k, v in metadata or () if k in TRACE_HEADERS and isinstance(v, str)}

    def record(self, carrier: Mapping[str, str], request_id: str, model: str,
               params: SamplingParams, usage: Usage, times: RequestTimes | None,
               finish_reasons: Sequence[str] = ()) -> None:
        """One span from the request's arrival in the engine to its finish, parented by
        ``carrier`` (a new trace when it holds no valid ``traceparent``)."""
        t = times
        now_mono, now_ns = time.monotonic(), time.time_ns()

        def wall_ns(mono: float | None) -> int | None:  # RequestTimes are monotonic
            return None if mono is None else now_ns - int((now_mono - mono) * 1e9)

        p = params
        attrs: dict[str, str | int | float | Sequence[str]] = {
            REQUEST_ID: request_id, RESPONSE_MODEL: model,
            REQUEST_MAX_TOKENS: p.max_new_tokens, REQUEST_TEMPERATURE: p.temperature,
            REQUEST_TOP_P: p.top_p, REQUEST_N: p.n, USAGE_NUM_SEQUENCES: p.n,
            USAGE_PROMPT_TOKENS: usage.prompt_tokens,
            USAGE_COMPLETION_TOKENS: usage.completion_tokens,
            RESPONSE_FINISH_REASONS: list(finish_reasons)}
        if t is not None:
            for name, value in (
                    (LATENCY_TIME_IN_QUEUE, _between(t.arrival, t.first_scheduled)),
                    (LATENCY_TIME_TO_FIRST_TOKEN, _between(t.arrival, t.first_token)),
                    (LATENCY_E2E, _between(t.arrival, t.finished)),
                    (LATENCY_PREFILL, _between(t.first_scheduled, t.first_token)),
                    (LATENCY_DECODE, _between(t.first_token, t.finished)),
                    (LATENCY_INFERENCE, _between(t.first_scheduled, t.finished))):
                if value is not None:
                    attrs[name] = value
        span = self.tracer.start_span(
            SPAN_NAME, context=_propagator.extract(carrier), kind=SpanKind.SERVER,
            attributes=attrs, start_time=wall_ns(t.arrival) if t else None)
        span.end(end_time=wall_ns(t.finished) if t else None)

    def shutdown(self, timeout_s: float = 3.0) -> bool:
        """Flush what is batched and stop the exporter, waiting at most ``timeout_s``: an
        unreachable collector (the exporter retries for ~10 s) must not hold a drain.
        True when the flush finished in time."""
        done = threading.Thread(target=self.provider.shutdown, name="genserve-otlp-flush",
                                daemon=True)
        done.start()
        done.join(timeout_s)
        return not done.is_alive()
