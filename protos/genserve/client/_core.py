"""What the sync and asyncio clients share: results, errors, request building, channels."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc

SERVICE_NAME = "genserve.v1.GenerationService"
DEFAULT_TARGET = "localhost:50051"
DEFAULT_TIMEOUT = 120.0  # seconds; the deadline of one call (of a whole stream)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # the server's limit too

# A plain prompt, its token ids, or chat messages ({"role": ..., "content": ...}).
Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]
PemSource = bytes | str | os.PathLike[str]  # PEM bytes, or the path of a PEM file
FinishReason = Literal["eos", "length", "stop_sequence", "stop_token", "time_limit",
                       "aborted", "error"]
LoadBalancing = Literal["round_robin", "pick_first"]

_FINISH: dict[int, FinishReason] = {
    pb.FINISH_REASON_EOS: "eos",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop_sequence",
    pb.FINISH_REASON_STOP_TOKEN: "stop_token",
    pb.FINISH_REASON_TIME_LIMIT: "time_limit",
    pb.FINISH_REASON_ABORTED: "aborted",
    pb.FINISH_REASON_ERROR: "error",
}
_BACKENDS = {
    None: pb.STRUCTURED_BACKEND_UNSPECIFIED,
    "auto": pb.STRUCTURED_BACKEND_UNSPECIFIED,
    "xgrammar": pb.STRUCTURED_BACKEND_XGRAMMAR,
    "lm-format-enforcer": pb.STRUCTURED_BACKEND_LM_FORMAT_ENFORCER,
}
_CODES = {c.value[0]: c for c in grpc.StatusCode}


# ---- errors ----------------------------------------------------------------------------

class GenserveError(Exception):
    """A failed call: ``code`` (a ``grpc.StatusCode``) and the server's ``details``.

    ``str(error)`` explains the code in words (``invalid request: ...``,
    ``server unavailable ...``); ``retryable`` is true for codes that another attempt,
    later or on another replica, may get past (UNAVAILABLE, RESOURCE_EXHAUSTED).
    """

    def __init__(self, code: grpc.StatusCode, details: str, *,
                 timeout: float | None = None) -> None:
        self.code = code
        self.details = details
        self.timeout = timeout  # the call's deadline, when it had one
        super().__init__(self.describe())

    @property
    def retryable(self) -> bool:
        return self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)

    def describe(self) -> str:
        c, d = self.code, self.details
        if c == grpc.StatusCode.INVALID_ARGUMENT:
            return f"invalid request: {d}"
        if c == grpc.StatusCode.UNAVAILABLE:
            return f"server unavailable (not running, still loading the model, or draining): {d}"
        if c == grpc.StatusCode.DEADLINE_EXCEEDED:
            after = f" ({self.timeout:g}s)" if self.timeout is not None else ""
            return f"deadline exceeded{after}: {d}"
        if c == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return f"server overloaded (waiting queue full), retry later: {d}"
        if c == grpc.StatusCode.INTERNAL:
            return f"server error: {d}"
        return f"{c.name}: {d}"

    def __repr__(self) -> str:
        return f"GenserveError({self.code.name}, {self.details!r})"

    @classmethod
    def from_rpc(cls, error: grpc.RpcError, timeout: float | None = None) -> GenserveError:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "", timeout=timeout)

    @classmethod
    def from_status(cls, code: int, message: str) -> GenserveError:
        """From a numeric code, as a batch item's error carries it."""
        return cls(_CODES.get(code, grpc.StatusCode.UNKNOWN), message)


# ---- results ---------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
    text: str = ""  # the token's vocabulary piece (e.g. "Ġthe")
    rank: int = 0  # 1-based rank in its position's distribution


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass(frozen=True)
class Completion:
    index: int
    text: str
    finish_reason: FinishReason | None
    stop_sequence: str | None = None  # the stop sequence that ended it
    token_ids: tuple[int, ...] = ()  # with return_token_ids=True
    logprobs: tuple[TokenLogprob, ...] = ()  # with logprobs=True
    error: str | None = None  # with finish_reason "error"


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    completions: tuple[Completion, ...]
    usage: Usage
    prompt_token_ids: tuple[int, ...] = ()  # with return_prompt_token_ids=True
    # with prompt_logprobs=True: prompt tokens 1.. (the first token has none)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    seed: int | None = None  # the sampling seed used (sampled requests): replays the call

    @property
    def text(self) -> str:
        """The first completion's text (the only one unless n > 1)."""
        return self.completions[0].text if self.completions else ""

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.completions[0].finish_reason if self.completions else None

    def json(self) -> Any:
        """Parse the first completion as JSON (a json_schema / json_object request)."""
        return json.loads(self.text)

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable data (what ``genserve generate --json`` prints)."""
        return _with_set(
            {"request_id": self.request_id,
             "completions": [_completion_dict(c) for c in self.completions],
             "usage": vars(self.usage).copy()},
            prompt_token_ids=list(self.prompt_token_ids),
            prompt_logprobs=_logprobs_list(self.prompt_logprobs), seed=self.seed)


def _completion_dict(c: Completion) -> dict[str, Any]:
    return _with_set({"index": c.index, "text": c.text, "finish_reason": c.finish_reason},
                     stop_sequence=c.stop_sequence, token_ids=list(c.token_ids),
                     logprobs=_logprobs_list(c.logprobs), error=c.error)


def _with_set(d: dict[str, Any], **optional: Any) -> dict[str, Any]:
    """``d`` and, in their order, the ``optional`` items that are set (not None, not an
    empty list): ``to_dict`` leaves unset fields out."""
    d.update((k, v) for k, v in optional.items() if v is not None and v != [])
    return d


def _logprobs_list(items: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    return [{"token_id": t.token_id, "text": t.text, "logprob": t.logprob, "rank": t.rank,
             "top": [list(x) for x in t.top]} for t in items]


@dataclass(frozen=True)
class BatchItem:
    """One ``generate_batch`` item: a result, or the error of that item alone."""

    index: int
    result: GenerateResult | None = None
    error: GenserveError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> GenerateResult:
        """The result, or raise the item's error."""
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


@dataclass(frozen=True)
class StreamChunk:
    """One ``generate_stream`` message: a text delta of completion ``index``.

    ``finish_reason`` is set on the last chunk of each completion; ``usage`` on the very
    last chunk of the stream.
    """

    request_id: str
    index: int
    text: str
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = None
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    usage: Usage | None = None
    error: str | None = None
    seed: int | None = None  # first chunk only, as in GenerateResult
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # first chunk only

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable data (``genserve generate --stream --json`` prints one
        per line); unset fields are left out."""
        return _with_set(
            {"request_id": self.request_id, "index": self.index, "text": self.text},
            token_ids=list(self.token_ids), finish_reason=self.finish_reason,
            stop_sequence=self.stop_sequence, logprobs=_logprobs_list(self.logprobs),
            usage=vars(self.usage).copy() if self.usage is not None else None,
            error=self.error, seed=self.seed,
            prompt_logprobs=_logprobs_list(self.prompt_logprobs))


@dataclass(frozen=True)
class Tokenized:
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...] = ()  # with return_tokens=True


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    # structured-output backend -> the kinds it supports (json_schema, regex, choice, ...)
    structured_backends: dict[str, tuple[str, ...]] = field(default_factory=dict)
    speculative_method: str | None = None  # None: speculative decoding is off
    speculative_k: int = 0
    max_new_tokens: int = 0  # the server's cap on max_new_tokens


class _StreamState:
    """Text, finish reasons and usage of a stream, gathered as its chunks pass."""

    def __init__(self) -> None:
        self.request_id = ""
        self._texts: dict[int, list[str]] = {}
        self.finish_reasons: dict[int, FinishReason] = {}
        self.usage: Usage | None = None

    def add(self, chunk: StreamChunk) -> None:
        self.request_id = chunk.request_id or self.request_id
        self._texts.setdefault(chunk.index, []).append(chunk.text)
        if chunk.finish_reason is not None:
            self.finish_reasons[chunk.index] = chunk.finish_reason
        if chunk.usage is not None:
            self.usage = chunk.usage

    @property
    def texts(self) -> dict[int, str]:
        return {i: "".join(parts) for i, parts in sorted(self._texts.items())}

    @property
    def text(self) -> str:
        return "".join(self._texts.get(0, []))


# ---- proto -> results ------------------------------------------------------------------

def _finish(value: int) -> FinishReason | None:
    return _FINISH.get(value)


def _logprobs(items: Sequence[pb.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(t.token_id, t.logprob, tuple((x.token_id, x.logprob)
                                                           for x in t.top), t.text, t.rank)
                 for t in items)


def _usage(u: pb.Usage) -> Usage:
    return Usage(u.prompt_tokens, u.completion_tokens, u.spec_proposed_tokens,
                 u.spec_accepted_tokens)


def result_from_pb(resp: pb.GenerateResponse) -> GenerateResult:
    return GenerateResult(
        request_id=resp.request_id,
        completions=tuple(Completion(
            index=c.index, text=c.text, finish_reason=_finish(c.finish_reason),
            stop_sequence=c.stop_sequence or None, token_ids=tuple(c.token_ids),
            logprobs=_logprobs(c.logprobs), error=c.error or None) for c in resp.completions),
        usage=_usage(resp.usage), prompt_token_ids=tuple(resp.prompt_token_ids),
        prompt_logprobs=_logprobs(resp.prompt_logprobs),
        seed=resp.seed if resp.HasField("seed") else None)


def batch_from_pb(resp: pb.GenerateBatchResponse) -> list[BatchItem]:
    items = []
    for r in resp.results:
        if r.HasField("error"):
            items.append(BatchItem(r.index, error=GenserveError.from_status(
                r.error.code, r.error.message)))
        else:
            items.append(BatchItem(r.index, result=result_from_pb(r.response)))
    return sorted(items, key=lambda item: item.index)


def chunk_from_pb(msg: pb.GenerateStreamResponse) -> StreamChunk:
    return StreamChunk(
        request_id=msg.request_id, index=msg.index, text=msg.text,
        finish_reason=_finish(msg.finish_reason), stop_sequence=msg.stop_sequence or None,
        token_ids=tuple(msg.token_ids), logprobs=_logprobs(msg.logprobs),
        usage=_usage(msg.usage) if msg.HasField("usage") else None, error=msg.error or None,
        seed=msg.seed if msg.HasField("seed") else None,
        prompt_logprobs=_logprobs(msg.prompt_logprobs))


def model_info_from_pb(resp: pb.GetModelInfoResponse) -> ModelInfo:
    backends = {b.name: tuple(b.kinds) for b in resp.structured_backend_info}
    for name in resp.structured_backends:
        backends.setdefault(name, ())
    return ModelInfo(
        model_id=resp.model_id, max_model_len=resp.max_model_len, vocab_size=resp.vocab_size,
        eos_token_ids=tuple(resp.eos_token_ids), structured_backends=backends,
        speculative_method=resp.speculative.method or None, speculative_k=resp.speculative.k,
        max_new_tokens=resp.max_new_tokens)


# ---- requests --------------------------------------------------------------------------

class GenerateOptions(TypedDict, total=False):
    """Keyword options of ``generate``, ``generate_batch`` and ``generate_stream``.

    Unset options take the server's defaults (greedy, ``--default-max-new-tokens``...).
    At most one structured-output option (json_schema, json_object, regex, choice,
    grammar) may be given.
    """

    # stopping
    max_new_tokens: int
    min_new_tokens: int
    stop: str | Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    include_stop_sequence: bool
    time_limit_ms: int
    # sampling
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    typical_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    n: int
    # structured output
    json_schema: str | Mapping[str, Any]
    json_object: bool
    regex: str
    choice: Sequence[str]
    grammar: str
    structured_backend: Literal["auto", "xgrammar", "lm-format-enforcer"]
    # output
    logprobs: bool
    top_logprobs: int
    return_token_ids: bool
    return_prompt_token_ids: bool
    prompt_logprobs: bool  # logprob and rank of each prompt token (with top_logprobs)
    # input and the rest
    truncate_input_tokens: int
    add_generation_prompt: bool  # chat prompts only; default True
    speculative: bool
    request_id: str
    processors: Sequence[tuple[str, Any]]  # (plugin name, args: a JSON string or JSON data)


_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "seed", "n")
_STRUCTURED = ("json_schema", "json_object", "regex", "choice", "grammar")
_OPTIONS = frozenset(GenerateOptions.__annotations__)


def build_request(prompt: Prompt | pb.GenerateRequest,
                  options: Mapping[str, Any] | None = None) -> pb.GenerateRequest:
    """A ``GenerateRequest`` from a prompt and :class:`GenerateOptions`.

    ``prompt`` is a string, a sequence of token ids, chat messages (mappings with
    ``role`` and ``content``), or a ready ``GenerateRequest`` (sent as it is: no options
    then). Only the shape is checked here; the server validates values
    (``INVALID_ARGUMENT``).
    """
    opts = dict(options or {})
    unknown = sorted(set(opts) - _OPTIONS)
    if unknown:
        raise TypeError(f"unknown generate option(s): {', '.join(unknown)}")
    if isinstance(prompt, pb.GenerateRequest):
        if opts:
            raise TypeError("options cannot be combined with a ready GenerateRequest")
        return prompt
    req = pb.GenerateRequest(request_id=opts.get("request_id", ""))
    _set_prompt(req, prompt, opts.get("add_generation_prompt", True))
    if "truncate_input_tokens" in opts:
        req.truncate_input_tokens = opts["truncate_input_tokens"]
    for name in _SAMPLING:
        if opts.get(name) is not None:
            setattr(req.sampling, name, opts[name])
    s = req.stopping
    if opts.get("max_new_tokens") is not None:
        s.max_new_tokens = opts["max_new_tokens"]
    if opts.get("min_new_tokens"):
        s.min_new_tokens = opts["min_new_tokens"]
    stop = opts.get("stop")
    if stop:
        s.stop_sequences.extend([stop] if isinstance(stop, str) else list(stop))
    s.stop_token_ids.extend(opts.get("stop_token_ids") or ())
    s.ignore_eos = bool(opts.get("ignore_eos", False))
    s.include_stop_sequence = bool(opts.get("include_stop_sequence", False))
    s.time_limit_ms = opts.get("time_limit_ms") or 0
    _set_structured(req, opts)
    out = req.output
    out.logprobs = bool(opts.get("logprobs", False))
    out.top_logprobs = opts.get("top_logprobs") or 0
    out.return_token_ids = bool(opts.get("return_token_ids", False))
    out.return_prompt_token_ids = bool(opts.get("return_prompt_token_ids", False))
    out.prompt_logprobs = bool(opts.get("prompt_logprobs", False))
    if opts.get("speculative") is not None:
        req.speculative.enabled = bool(opts["speculative"])
    for name, args in opts.get("processors") or ():
        req.processors.add(name=name, args_json=args if isinstance(args, str) else
                           "" if args is None else json.dumps(args))
    return req


def _set_prompt(req: pb.GenerateRequest, prompt: Prompt, add_generation_prompt: bool) -> None:
    if isinstance(prompt, str):
        req.prompt = prompt
        return
    if isinstance(prompt, bytes | bytearray):
        raise TypeError("prompt must be a str, token ids or chat messages, not bytes")
    items = list(prompt)
    if items and all(isinstance(m, Mapping) for m in items):
        for m in items:
            assert isinstance(m, Mapping)
            if set(m) - {"role", "content"} or "role" not in m:
                raise TypeError(f"a chat message has 'role' and 'content', got {dict(m)!r}")
            req.chat.messages.add(role=m["role"], content=m.get("content", ""))
        req.chat.add_generation_prompt = add_generation_prompt
        return
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        raise TypeError("prompt must be a str, a sequence of token ids (int) or chat "
                        "messages (mappings with role and content)")
    req.prompt_token_ids.ids.extend(items)  # an empty list: the server rejects it


def _set_structured(req: pb.GenerateRequest, opts: Mapping[str, Any]) -> None:
    given = [k for k in _STRUCTURED if opts.get(k) not in (None, False)]
    backend = opts.get("structured_backend")
    if backend not in _BACKENDS:
        raise ValueError(f"structured_backend must be one of auto, xgrammar, "
                         f"lm-format-enforcer, got {backend!r}")
    if len(given) > 1:
        raise ValueError(f"give at most one structured-output option, got {', '.join(given)}")
    if not given:
        if backend not in (None, "auto"):
            raise ValueError("structured_backend needs a structured-output option")
        return
    so, kind = req.structured_output, given[0]
    value = opts[kind]
    if kind == "json_schema":
        so.json_schema = value if isinstance(value, str) else json.dumps(value)
    elif kind == "json_object":
        so.json_object = True
    elif kind == "choice":
        if isinstance(value, str):
            raise TypeError("choice is a sequence of strings, not one string")
        so.choice.choices.extend(value)
    else:
        setattr(so, kind, value)
    so.backend = _BACKENDS[backend]


# ---- channels --------------------------------------------------------------------------

def _pem(source: PemSource | None, what: str) -> bytes | None:
    if source is None or isinstance(source, bytes):
        return source
    try:
        with open(source, "rb") as f:
            return f.read()
    except OSError as e:
        raise OSError(f"cannot read the {what} {os.fspath(source)!r}: "
                      f"{e.strerror or e}") from e


@dataclass
class ChannelSettings:
    """How a client connects (see :class:`genserve.client.Client` for the meaning)."""

    target: str = DEFAULT_TARGET
    tls: bool = False
    root_certificates: PemSource | None = None
    certificate_chain: PemSource | None = None
    private_key: PemSource | None = None
    server_name: str | None = None
    load_balancing: LoadBalancing | None = "round_robin"
    max_attempts: int = 1
    max_message_bytes: int = MAX_MESSAGE_BYTES
    options: Sequence[tuple[str, Any]] = ()

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate needs both certificate_chain and "
                             "private_key")
        if self.load_balancing not in (None, "round_robin", "pick_first"):
            raise ValueError(f"load_balancing must be round_robin, pick_first or None, got "
                             f"{self.load_balancing!r}")
        if not 1 <= self.max_attempts <= 5:
            raise ValueError(f"max_attempts must be in 1..5, got {self.max_attempts}")

    @property
    def secure(self) -> bool:
        return bool(self.tls or self.root_certificates is not None
                    or self.certificate_chain is not None)

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials (None = plaintext); system roots unless root_certificates."""
        if not self.secure:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_pem(self.root_certificates, "TLS root certificates"),
            private_key=_pem(self.private_key, "TLS client key"),
            certificate_chain=_pem(self.certificate_chain, "TLS client certificate"))

    def service_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {}
        if self.load_balancing is not None:
            config["loadBalancingConfig"] = [{self.load_balancing: {}}]
        if self.load_balancing == "round_robin":
            # grpc.health.v1 Watch on each replica: one that turns NOT_SERVING (a drain)
            # gets no new calls before its GOAWAY
            config["healthCheckConfig"] = {"serviceName": ""}
        if self.max_attempts > 1:
            # UNAVAILABLE only: the call did not run (no replica ready, or one draining), so
            # another attempt, likely on another replica with round_robin, is safe.
            config["methodConfig"] = [{
                "name": [{"service": SERVICE_NAME}],
                "retryPolicy": {"maxAttempts": self.max_attempts, "initialBackoff": "0.1s",
                                "maxBackoff": "2s", "backoffMultiplier": 2,
                                "retryableStatusCodes": ["UNAVAILABLE"]},
            }]
        return config

    def channel_options(self) -> list[tuple[str, Any]]:
        options: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
        ]
        config = self.service_config()
        if config:
            options.append(("grpc.service_config", json.dumps(config)))
        if self.max_attempts > 1:
            options.append(("grpc.enable_retries", 1))
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
            options.append(("grpc.default_authority", self.server_name))
        options.extend(self.options)
        return options


# ---- what Client and AsyncClient share ------------------------------------------------
# The two differ only in blocking vs awaiting; everything else lives here once.

class _StreamBase:
    """The call of one ``generate_stream``, its deadline, and what has passed so far."""

    def __init__(self, call: Any, timeout: float | None) -> None:
        self._call = call
        self._timeout = timeout
        self._state = _StreamState()

    def _received(self, msg: pb.GenerateStreamResponse) -> StreamChunk:
        chunk = chunk_from_pb(msg)
        self._state.add(chunk)
        return chunk

    def cancel(self) -> None:
        self._call.cancel()

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


class _ClientBase:
    """Settings, channel, stubs and per-call options; subclasses set ``_grpc`` to the
    module whose ``insecure_channel``/``secure_channel`` make their channel (grpc or
    grpc.aio: same signatures)."""

    _grpc: Any

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
            self._grpc.insecure_channel(target, options=options_) if credentials is None
            else self._grpc.secure_channel(target, credentials, options=options_))
        self._stub = pb_grpc.GenerationServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _call_options(self, timeout: float | None) -> dict[str, Any]:
        return {"timeout": timeout, "metadata": self.metadata or None,
                "wait_for_ready": self.wait_for_ready}

    def _start_stream(self, prompt: Prompt | pb.GenerateRequest, timeout: float | None,
                      options: GenerateOptions) -> tuple[Any, float | None]:
        """(the GenerateStream call, its deadline)."""
        request = pb.GenerateStreamRequest(request=build_request(prompt, options))
        t = self._timeout(timeout)
        return self._stub.GenerateStream(request, **self._call_options(t)), t


def batch_request(prompts: Sequence[Prompt | pb.GenerateRequest],
                  options: GenerateOptions) -> pb.GenerateBatchRequest:
    if isinstance(prompts, str | pb.GenerateRequest):
        raise TypeError("generate_batch takes a sequence of prompts")
    if "request_id" in options:
        raise TypeError("request_id is per item: pass GenerateRequest items to set it")
    return pb.GenerateBatchRequest(requests=[
        build_request(p, None if isinstance(p, pb.GenerateRequest) else options)
        for p in prompts])


def tokenized_from_pb(resp: pb.TokenizeResponse) -> Tokenized:
    return Tokenized(tuple(resp.token_ids), tuple(resp.tokens))


def health_request(service: str) -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service=service)


def health_name(resp: health_pb2.HealthCheckResponse) -> str:
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


class ServingWait:
    """``wait_until_serving``'s clock and last answer."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.end = time.monotonic() + timeout
        self.last = "no answer"

    def check_timeout(self) -> float:
        """The deadline of the next health check: at most 5 s, at least 0.1 s."""
        return max(0.1, min(5.0, self.end - time.monotonic()))

    def done(self, answer: str | GenserveError) -> bool:
        """True on SERVING; raises GenserveError(DEADLINE_EXCEEDED) once time is up."""
        self.last = answer.describe() if isinstance(answer, GenserveError) else answer
        if self.last == "SERVING":
            return True
        if time.monotonic() >= self.end:
            raise GenserveError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"not SERVING after {self.timeout:g}s (last: {self.last})")
        return False
