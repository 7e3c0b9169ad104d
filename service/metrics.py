"""Prometheus metrics: one ``CollectorRegistry`` per server, served over HTTP.

Request, token and latency metrics are observed by the servicer as calls run; engine
gauges (queue depth, running sequences, KV-cache usage) and the speculative-decoding
counters are read from ``EngineStats`` at scrape time by a custom collector, from the
HTTP server's thread: ``stats()`` only reads plain ints and ``len()`` of containers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
    start_http_server,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    UnknownMetricFamily,
)
from prometheus_client.registry import Collector

from engine.outputs import EngineStats, FinishReason, RequestTimes, Usage

log = logging.getLogger(__name__)

RPCS = ("Generate", "GenerateBatch", "GenerateStream", "Tokenize", "GetModelInfo")

# Seconds: CPU decode steps run ~10-100 ms, a cold prefill or a queued request much longer.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                    160.0, 320.0)
# Request lengths in tokens (vLLM's 1-2-5 series).
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 2048, 4096, 8192)
# vLLM's finished_reason values: our finish reasons as its dashboards count them.
FINISHED_REASON = {FinishReason.EOS: "stop", FinishReason.STOP_SEQUENCE: "stop",
                   FinishReason.STOP_TOKEN: "stop", FinishReason.LENGTH: "length",
                   FinishReason.ABORTED: "abort", FinishReason.TIME_LIMIT: "time_limit",
                   FinishReason.ERROR: "error"}
COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)
# vLLM's request-stage latencies: (name, help, from, to), from and to naming RequestTimes
# fields; a finished request observes each stage whose two times it has (a request that
# never got a token has no prefill or decode time).
_STAGES = (
    ("genserve_e2e_request_latency_seconds", "arrival in the engine to the last token",
     "arrival", "finished"),
    ("genserve_request_queue_time_seconds", "time waiting before the first scheduled step",
     "arrival", "first_scheduled"),
    ("genserve_request_prefill_time_seconds", "first scheduled step to the first token",
     "first_scheduled", "first_token"),
    ("genserve_request_decode_time_seconds", "first token to the last",
     "first_token", "finished"),
    ("genserve_request_inference_time_seconds",
     "first scheduled step to the last token (prefill + decode)", "first_scheduled", "finished"),
)


# TGIS's names (IBM text-generation-inference's router, re-emitted by vllm-tgis-adapter
# "for TGIS opsviz"), beside ours, so TGIS dashboards and alerts keep working.
TGIS_DURATION_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
                         10.0, 20.0, 50.0)
# TGIS's stop_reason names (its StopReason enum) for our finish reasons.
TGIS_STOP_REASON = {FinishReason.EOS: "EOS_TOKEN", FinishReason.STOP_TOKEN: "EOS_TOKEN",
                    FinishReason.STOP_SEQUENCE: "STOP_SEQUENCE",
                    FinishReason.LENGTH: "MAX_TOKENS", FinishReason.TIME_LIMIT: "TIME_LIMIT",
                    FinishReason.ABORTED: "CANCELLED", FinishReason.ERROR: "ERROR"}
# TGIS's err label (vllm-tgis-adapter's FailureReasonLabel) for a failed call's code.
TGIS_FAILURE = {"INVALID_ARGUMENT": "validation", "CANCELLED": "cancelled",
                "DEADLINE_EXCEEDED": "timeout", "RESOURCE_EXHAUSTED": "conc_limit",
                "INTERNAL": "generate"}
# TGIS's kind label of tgi_request_count by RPC.
TGIS_KIND = {"Generate": "single", "GenerateBatch": "batch", "GenerateStream": "stream",
             "fmaas/Generate": "batch", "fmaas/GenerateStream": "stream"}


class EngineCollector(Collector):
    """Gauges and counters computed from ``EngineStats`` (and the server's state) per scrape."""

    def __init__(self, stats: Callable[[], EngineStats | None],
                 in_flight: Callable[[], int], model_name: Callable[[], str]) -> None:
        self._stats = stats
        self._in_flight = in_flight
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("genserve_in_flight_requests",
                                "generation calls being answered (Generate, GenerateBatch, "
                                "GenerateStream)", value=self._in_flight())
        try:
            s = self._stats()
        except Exception:  # a scrape must never fail because the engine is mid-change
            log.debug("engine stats unavailable", exc_info=True)
            return
        if s is None:  # the model is still loading
            return
        for kind, name, doc, read in _ENGINE_METRICS:
            yield kind(name, doc, value=read(s))
        model = self._model_name()
        for name, doc, value in (
                ("genserve_num_requests_running", "requests in the running batch (vLLM's "
                 "num_requests_running)", s.num_requests_running),
                ("genserve_num_requests_waiting", "requests waiting to be scheduled (vLLM's "
                 "num_requests_waiting)", s.num_requests_waiting)):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            yield family
        yield GaugeMetricFamily("tgi_queue_size", "TGIS: requests waiting in the queue",
                                value=s.num_requests_waiting)
        yield GaugeMetricFamily("tgi_batch_current_size", "TGIS: requests in the running "
                                "batch", value=s.num_requests_running)


class BareCounters(Collector):
    """TGIS's counters under their bare names too (``tgi_request_success`` beside
    ``tgi_request_success_total``): TGIS's Rust exporter wrote them without the suffix,
    later TGIS writes both, and dashboards and autoscalers query the bare name, which
    prometheus_client never writes for a counter. Untyped, the type Prometheus gives a
    name it has no TYPE line for."""

    def __init__(self, counters: list[Counter]) -> None:
        self._counters = counters

    def collect(self) -> Iterator[Metric]:
        for counter in self._counters:
            for family in counter.collect():
                bare = UnknownMetricFamily(family.name, family.documentation,
                                           labels=list(counter._labelnames))
                for sample in family.samples:
                    if sample.name == family.name + "_total":
                        bare.add_metric([sample.labels[k] for k in counter._labelnames],
                                        sample.value)
                yield bare


def _acceptance(s: EngineStats) -> float:
    return s.spec.accepted / s.spec.proposed if s.spec.proposed else 0.0


_G, _C = GaugeMetricFamily, CounterMetricFamily
# What the collector reads from EngineStats at each scrape: (family, name, help, value).
_ENGINE_METRICS: list[tuple[Callable[..., Metric], str, str, Callable[[EngineStats], float]]] = [
    (_G, "genserve_waiting_sequences", "sequences waiting to be scheduled (the queue depth; "
     "a request with n samples counts n)", lambda s: s.num_waiting),
    (_G, "genserve_running_sequences", "sequences running in the engine's batch",
     lambda s: s.num_running),
    (_G, "genserve_engine_requests", "requests in the engine (waiting or running)",
     lambda s: s.num_requests),
    (_G, "genserve_adapter_waiting_requests", "requests waiting in line for a LoRA adapter "
     "slot (every --max-loras slot held by running requests)",
     lambda s: s.num_adapter_waiting),
    (_G, "genserve_kv_cache_usage_ratio", "fraction of KV-cache blocks in use (0..1)",
     lambda s: s.kv_usage),
    (_G, "genserve_kv_cache_blocks", "KV-cache blocks in total", lambda s: s.kv_blocks_total),
    (_G, "genserve_kv_cache_blocks_used", "KV-cache blocks in use", lambda s: s.kv_blocks_used),
    (_C, "genserve_prefix_cache_queries", "prompt tokens looked up in the prefix cache "
     "(vLLM's prefix_cache_queries)", lambda s: s.prefix_cache_queries),
    (_C, "genserve_prefix_cache_hits", "prompt tokens found in the prefix cache (vLLM's "
     "prefix_cache_hits)", lambda s: s.prefix_cache_hits),
    (_G, "genserve_prefix_cache_blocks", "KV blocks the prefix cache can find now",
     lambda s: s.prefix_cache_blocks),
    (_G, "genserve_prefix_cache_host_bytes", "host memory holding the KV of cached blocks "
     "no request is using (llama.cpp runner, --prefix-cache-host-memory)",
     lambda s: s.prefix_cache_host_bytes),
    (_C, "genserve_preemptions", "sequences preempted (recomputed later) for lack of KV "
     "blocks", lambda s: s.num_preemptions),
    (_C, "genserve_spec_steps", "engine steps that speculated (one verification pass each)",
     lambda s: s.spec.steps),
    (_C, "genserve_spec_proposed_tokens", "draft tokens proposed by speculative decoding",
     lambda s: s.spec.proposed),
    (_C, "genserve_spec_accepted_tokens", "proposed tokens the target model accepted",
     lambda s: s.spec.accepted),
    (_C, "genserve_spec_emitted_tokens", "tokens emitted by speculating steps (accepted + "
     "one bonus per sequence)", lambda s: s.spec.emitted),
    (_G, "genserve_spec_acceptance_rate", "accepted / proposed speculative tokens since start "
     "(0 before any proposal)", _acceptance),
]


class Metrics:
    """A server's metrics, in a registry of its own (several servers can share a process),
    with the process, platform and Python GC collectors registered in it too."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)
        self.model_name = ""  # set once the model is known (--served-model-name or its id)
        # vLLM's request metrics, under our prefix, with its shapes and a model_name label
        m = ["model_name"]
        self.request_success = Counter(
            "genserve_request_success", "finished sequences by finished_reason (stop, "
            "length, abort, time_limit, error)", [*m, "finished_reason"], registry=r)
        self.stage_latency = [
            (start, end, Histogram(name, doc, m, buckets=DURATION_BUCKETS, registry=r))
            for name, doc, start, end in _STAGES]
        self.request_prompt_tokens = Histogram(
            "genserve_request_prompt_tokens", "prompt length of finished requests, tokens", m,
            buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(
            "genserve_request_generation_tokens", "tokens generated by finished requests "
            "(all their sequences)", m, buckets=TOKEN_BUCKETS, registry=r)
        self.iteration_tokens = Histogram(
            "genserve_iteration_tokens", "tokens computed per engine step (prefill chunks, "
            "decodes and speculative rows)", m, buckets=ITERATION_BUCKETS, registry=r)
        self.requests = Counter("genserve_requests", "RPCs answered, by RPC and gRPC status code",
                                ["rpc", "code"], registry=r)
        self.batch_items = Counter("genserve_batch_items",
                                   "GenerateBatch items answered, by their status code",
                                   ["code"], registry=r)
        self.prompt_tokens = Counter("genserve_prompt_tokens",
                                     "prompt tokens of generation requests the engine took",
                                     registry=r)
        self.generation_tokens = Counter("genserve_generation_tokens",
                                         "tokens generated (every completion of every request)",
                                         registry=r)
        self.request_duration = Histogram("genserve_request_duration_seconds",
                                          "time from a call's arrival to its answer, by RPC",
                                          ["rpc"], buckets=DURATION_BUCKETS, registry=r)
        self.ttft = Histogram("genserve_time_to_first_token_seconds",
                              "time from a request's arrival to its first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("genserve_time_per_output_token_seconds",
                              "time per generated token after the first, one observation per "
                              "token", buckets=TPOT_BUCKETS, registry=r)
        self.structured_compile = Histogram(
            "genserve_structured_compile_seconds",
            "structured-output grammar compile time, by backend (failed compiles included)",
            ["backend"], buckets=COMPILE_BUCKETS, registry=r)
        self.structured_requests = Counter(
            "genserve_structured_requests", "structured-output requests, by the backend that "
            "served them", ["backend"], registry=r)
        self.structured_cache_hits = Counter(
            "genserve_structured_cache_hits", "compiled-grammar cache hits, by backend",
            ["backend"], registry=r)
        self.structured_cache_misses = Counter(
            "genserve_structured_cache_misses",
            "compiled-grammar cache misses (each starts a compile), by backend", ["backend"],
            registry=r)
        # gRPC server metrics under the go-grpc-prometheus / py-grpc-prometheus names,
        # for every service (health and reflection too); observed by service.rpc_guard
        rpc_labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.grpc_started = Counter("grpc_server_started", "RPCs started on the server",
                                    rpc_labels, registry=r)
        self.grpc_handled = Counter("grpc_server_handled", "RPCs completed on the server, "
                                    "whatever their status", [*rpc_labels, "grpc_code"],
                                    registry=r)
        self.grpc_handling = Histogram("grpc_server_handling_seconds", "response latency of "
                                       "RPCs handled by the server", rpc_labels,
                                       buckets=DURATION_BUCKETS, registry=r)
        self.grpc_received = Counter("grpc_server_msg_received", "messages received by the "
                                     "server", rpc_labels, registry=r)
        self.grpc_sent = Counter("grpc_server_msg_sent", "messages sent by the server",
                                 rpc_labels, registry=r)
        self._add_tgis_metrics()
        for rpc in RPCS:  # visible (at 0) before the first call
            self.requests.labels(rpc, "OK")
            self.request_duration.labels(rpc)
        self._http: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def _add_tgis_metrics(self) -> None:
        """TGIS's request metrics, with its types; no model label (TGIS serves one)."""
        r = self.registry
        self.tgi_request_count = Counter(
            "tgi_request_count", "TGIS: generation calls received, by kind (single, batch, "
            "stream)", ["kind"], registry=r)
        self.tgi_request_input_count = Counter(
            "tgi_request_input_count", "TGIS: generation inputs received (a batch of n "
            "counts n)", registry=r)
        self.tgi_request_success = Counter(
            "tgi_request_success", "TGIS: generation requests answered, by the stop_reason "
            "of their (first) sequence", ["stop_reason"], registry=r)
        self.tgi_request_failure = Counter(
            "tgi_request_failure", "TGIS: failed generation calls and batch inputs, by err "
            "(validation, cancelled, timeout, conc_limit, generate, unknown)", ["err"],
            registry=r)
        hist = [
            ("tgi_request_input_length", "prompt length of finished requests, tokens",
             TOKEN_BUCKETS),
            ("tgi_request_max_new_tokens", "max_new_tokens of finished requests",
             TOKEN_BUCKETS),
            ("tgi_request_generated_tokens", "tokens generated by finished requests",
             TOKEN_BUCKETS),
            ("tgi_request_total_tokens", "prompt + generated tokens of finished requests",
             TOKEN_BUCKETS),
            ("tgi_request_duration", "generation call duration, arrival to answer, seconds",
             TGIS_DURATION_BUCKETS),
            ("tgi_request_queue_duration", "time a request waited before its first step, "
             "seconds", TGIS_DURATION_BUCKETS),
            ("tgi_request_inference_duration", "first scheduled step to the last token, "
             "seconds", TGIS_DURATION_BUCKETS),
            ("tgi_request_mean_time_per_token_duration", "inference duration / generated "
             "tokens, seconds", TGIS_DURATION_BUCKETS)]
        self.tgi = {name: Histogram(name, f"TGIS: {doc}", buckets=buckets, registry=r)
                    for name, doc, buckets in hist}
        self.tgi_batch_inference_duration = Histogram(
            "tgi_batch_inference_duration", "TGIS: duration of one engine step (one forward "
            "over the running batch), seconds, by method: prefill (the step computed prompt "
            "tokens) or next_token (decodes only)", ["method"], buckets=TGIS_DURATION_BUCKETS,
            registry=r)
        for method in ("prefill", "next_token"):
            self.tgi_batch_inference_duration.labels(method)
        for kind in ("single", "batch", "stream"):
            self.tgi_request_count.labels(kind)
        r.register(BareCounters([self.tgi_request_count, self.tgi_request_input_count,
                                 self.tgi_request_success, self.tgi_request_failure]))

    def observe_call(self, rpc: str, code: str, inputs: int, duration: float,
                     item_codes: list[str]) -> None:
        """TGIS's per-call metrics of a generation RPC (``rpc`` as the servicer names it);
        ``item_codes``: a batch's per-input codes."""
        kind = TGIS_KIND.get(rpc)
        if kind is None:
            return
        self.tgi_request_count.labels(kind).inc()
        self.tgi_request_input_count.inc(inputs)
        self.tgi["tgi_request_duration"].observe(duration)
        for failed in ([code] if code != "OK" else []) + [c for c in item_codes if c != "OK"]:
            self.tgi_request_failure.labels(TGIS_FAILURE.get(failed, "unknown")).inc()

    def add_engine_collector(self, stats: Callable[[], EngineStats | None],
                             in_flight: Callable[[], int]) -> None:
        self.registry.register(EngineCollector(stats, in_flight, lambda: self.model_name))

    def on_step(self, tokens: int, seconds: float, prefill: bool) -> None:
        """AsyncEngine.on_step: called on the engine thread after every step."""
        self.iteration_tokens.labels(self.model_name).observe(tokens)
        self.tgi_batch_inference_duration.labels(
            "prefill" if prefill else "next_token").observe(seconds)

    def observe_request(self, times: RequestTimes | None, usage: Usage,
                        finish_reasons: list[FinishReason],
                        max_new_tokens: int | None = None) -> None:
        """A finished request's stage latencies, lengths and its sequences' finish
        reasons."""
        model = self.model_name
        for reason in finish_reasons:
            self.request_success.labels(model, FINISHED_REASON[reason]).inc()
        self.request_prompt_tokens.labels(model).observe(usage.prompt_tokens)
        self.request_generation_tokens.labels(model).observe(usage.completion_tokens)
        self._observe_tgis(times, usage, finish_reasons, max_new_tokens)
        if times is None or times.finished is None:
            return
        for start, end, histogram in self.stage_latency:
            begun, ended = getattr(times, start), getattr(times, end)
            if begun is not None and ended is not None:
                histogram.labels(model).observe(ended - begun)

    def _observe_tgis(self, times: RequestTimes | None, usage: Usage,
                      finish_reasons: list[FinishReason], max_new_tokens: int | None) -> None:
        tgi = self.tgi
        if finish_reasons:
            self.tgi_request_success.labels(TGIS_STOP_REASON[finish_reasons[0]]).inc()
        tgi["tgi_request_input_length"].observe(usage.prompt_tokens)
        tgi["tgi_request_generated_tokens"].observe(usage.completion_tokens)
        tgi["tgi_request_total_tokens"].observe(usage.prompt_tokens + usage.completion_tokens)
        if max_new_tokens is not None:
            tgi["tgi_request_max_new_tokens"].observe(max_new_tokens)
        if times is None or times.first_scheduled is None:
            return
        tgi["tgi_request_queue_duration"].observe(times.first_scheduled - times.arrival)
        if times.finished is None:
            return
        inference = times.finished - times.first_scheduled
        tgi["tgi_request_inference_duration"].observe(inference)
        if usage.completion_tokens:
            tgi["tgi_request_mean_time_per_token_duration"].observe(
                inference / usage.completion_tokens)

    # StructuredOutputs observer protocol (structured.manager.CompileObserver)
    def on_compile(self, backend: str, seconds: float, ok: bool) -> None:
        self.structured_compile.labels(backend).observe(seconds)

    def on_cache_lookup(self, backend: str, hit: bool) -> None:
        (self.structured_cache_hits if hit else self.structured_cache_misses).labels(
            backend).inc()

    def on_served(self, backend: str) -> None:
        self.structured_requests.labels(backend).inc()

    # ---- HTTP -----------------------------------------------------------------------

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` (any path, as prometheus_client does) on a daemon thread."""
        self._http, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_port)

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
