"""GenerateRequest -> engine inputs, rejecting bad input with a message naming the field.

Each check lives in one place: numeric ranges in ``SamplingParams.__post_init__`` (its
``ParamError`` names the parameter, mapped here to the proto field), what only the engine
knows (vocabulary, KV capacity) in the engine (its ``RequestError`` is mapped by the
servicer), and here what only the edge knows (the proto's fields, the tokenizer, the
server's limits).
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import ModelInfo
from engine.request_limits import context_room
from engine.sampling_params import ParamError, SamplingParams
from genserve.v1 import generation_pb2 as pb
from service.limits import ServiceLimits
from structured.spec import (
    AUTO,
    COMPACT,
    FLEXIBLE,
    LLGUIDANCE,
    LM_FORMAT_ENFORCER,
    SINGLE,
    XGRAMMAR,
    StructuredSpec,
)

if TYPE_CHECKING:
    from structured.processor import GrammarFactory

CHAT_ROLES = {"system", "user", "assistant", "tool"}
MAX_REQUEST_ID_LEN = 256
MAX_STOP_SEQUENCE_LEN = 256
MAX_SEED = 2**63 - 1


MAX_JSON_DEPTH = 64  # nesting of any JSON a request carries (schemas, processor args)
MAX_PROCESSORS = 16
MAX_ARGS_JSON_BYTES = 64 * 1024


class InvalidArgument(ValueError):
    """Bad input: the servicer answers INVALID_ARGUMENT with this message."""


def json_depth(text: str) -> int:
    """Deepest ``[``/``{`` nesting of ``text`` (outside strings), found in one pass before
    parsing, so a hostile document cannot drive ``json.loads`` into a RecursionError."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def check_json_depth(text: str, field: str) -> None:
    if json_depth(text) > MAX_JSON_DEPTH:
        raise InvalidArgument(f"{field} is nested deeper than {MAX_JSON_DEPTH} levels")


@dataclass
class ParsedRequest:
    request_id: str  # echoed to the client: theirs, or a generated one
    engine_request_id: str  # unique in the engine even when clients reuse an id
    prompt_token_ids: list[int]
    params: SamplingParams
    output: pb.OutputOptions
    structured: StructuredSpec | None = None
    structured_prefix: str = "structured_output."  # how the API names its fields in errors
    grammar: GrammarFactory | None = None  # set once the structured spec is compiled
    adapter_id: str = ""  # the LoRA adapter to run with ('' = the base model)

    @property
    def seed(self) -> int | None:
        """The seed to echo: the sampler's, for a sampled request (None when greedy)."""
        return self.params.seed if self.params.temperature > 0 else None


_seeds: random.Random = random.SystemRandom()


def seed_sampling(seed: int) -> None:
    """``--seed``: the seeds picked for unseeded sampled requests come from ``seed``, so a
    restarted server answers the same sequence of calls identically."""
    global _seeds
    import torch

    _seeds = random.Random(seed)
    torch.manual_seed(seed)


def sampling_seed(temperature: float, seed: int | None) -> int | None:
    """The request's seed, or one picked now for a sampled request without one, so the
    response can name it and the call be replayed (greedy needs none)."""
    if seed is None and temperature > 0:
        return _seeds.getrandbits(63)
    return seed


def new_request_id(given: str) -> tuple[str, str]:
    """(the id echoed to the client, a unique engine id): the client's own id may be
    reused across calls, so the engine's gets a suffix."""
    if not given:
        rid = uuid.uuid4().hex
        return rid, rid
    return given, f"{given}-{uuid.uuid4().hex[:8]}"


_BACKENDS = {
    pb.STRUCTURED_BACKEND_UNSPECIFIED: AUTO,
    pb.STRUCTURED_BACKEND_XGRAMMAR: XGRAMMAR,
    pb.STRUCTURED_BACKEND_LM_FORMAT_ENFORCER: LM_FORMAT_ENFORCER,
    pb.STRUCTURED_BACKEND_LLGUIDANCE: LLGUIDANCE,
}
_WHITESPACE = {
    pb.STRUCTURED_WHITESPACE_UNSPECIFIED: "",  # the server's default
    pb.STRUCTURED_WHITESPACE_COMPACT: COMPACT,
    pb.STRUCTURED_WHITESPACE_SINGLE: SINGLE,
    pb.STRUCTURED_WHITESPACE_FLEXIBLE: FLEXIBLE,
}


def structured_spec(so: pb.StructuredOutput) -> StructuredSpec | None:
    """The native API's ``structured_output``, checked by ``parse_structured``."""
    kind = so.WhichOneof("kind")
    if kind is None:
        return None
    if so.backend not in _BACKENDS:
        raise InvalidArgument(f"structured_output.backend: unknown value {so.backend}")
    if so.whitespace not in _WHITESPACE:
        raise InvalidArgument(f"structured_output.whitespace: unknown value {so.whitespace}")
    if kind == "json_object" and not so.json_object:
        raise InvalidArgument("structured_output.json_object must be true when set")
    value = (tuple(so.choice.choices) if kind == "choice" else
             "" if kind == "json_object" else getattr(so, kind))
    return parse_structured(kind, value, _BACKENDS[so.backend], _WHITESPACE[so.whitespace],
                            "structured_output.")


def parse_structured(kind: str, value: str | tuple[str, ...], backend: str,
                     whitespace: str, prefix: str) -> StructuredSpec:
    """The one check of a structured-output request, whichever API it came through: the
    limits are the same for all; messages name the field with the API's ``prefix``
    (``structured_output.`` natively, none for TGIS). The spec's size is the compile
    manager's to bound (``--structured-max-spec-bytes``)."""
    if kind == "choice":
        assert isinstance(value, tuple)
        if not value or not all(value):
            raise InvalidArgument(f"{prefix}choice.choices must be non-empty strings")
        return StructuredSpec(kind, value, backend, whitespace)
    if kind == "json_object":
        return StructuredSpec(kind, "", backend, whitespace)
    assert isinstance(value, str)
    if not value.strip():
        raise InvalidArgument(f"{prefix}{kind} must not be empty")
    if kind == "json_schema":
        check_json_depth(value, f"{prefix}json_schema")
    return StructuredSpec(kind, value, backend, whitespace)


# Which message of the proto a SamplingParams field lives in, for error messages.
_SECTION = {
    "max_new_tokens": "stopping", "min_new_tokens": "stopping", "stop_sequences": "stopping",
    "stop_token_ids": "stopping", "time_limit_ms": "stopping", "top_logprobs": "output",
}


def check_input_chars(chars: int, field: str, limits: ServiceLimits) -> None:
    if chars > limits.max_input_chars:
        raise InvalidArgument(f"{field} has {chars} characters; the limit is "
                              f"{limits.max_input_chars} (--max-input-chars)")


def _prompt_ids(req: pb.GenerateRequest, tokenizer, info: ModelInfo,
                limits: ServiceLimits) -> list[int]:
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("input: one of prompt, prompt_token_ids or chat is required")
    if kind == "prompt":
        check_input_chars(len(req.prompt), "prompt", limits)
        if not req.prompt:
            raise InvalidArgument("prompt must not be empty")
        ids = tokenizer(req.prompt)["input_ids"]
    elif kind == "prompt_token_ids":
        ids = list(req.prompt_token_ids.ids)  # the engine checks them against its vocabulary
        if not ids:
            raise InvalidArgument("prompt_token_ids.ids must not be empty")
    else:
        msgs = req.chat.messages
        if not msgs:
            raise InvalidArgument("chat.messages must not be empty")
        check_input_chars(sum(len(m.content) + len(m.role) for m in msgs), "chat.messages",
                          limits)
        for i, m in enumerate(msgs):
            if m.role not in CHAT_ROLES:
                raise InvalidArgument(f"chat.messages[{i}].role must be one of "
                                      f"{sorted(CHAT_ROLES)}, got {m.role!r}")
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidArgument("chat: the served model has no chat template; send a prompt")
        try:
            enc = tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in msgs],
                add_generation_prompt=req.chat.add_generation_prompt, tokenize=True)
        except Exception as e:  # templates raise on conversations they do not support
            raise InvalidArgument(f"chat.messages: the chat template rejected them: {e}") \
                from None
        ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    if not ids:
        raise InvalidArgument(f"{kind} tokenizes to no tokens")
    if req.truncate_input_tokens and len(ids) > req.truncate_input_tokens:
        ids = ids[-req.truncate_input_tokens:]
    if context_room(len(ids), info) < 1:
        raise InvalidArgument(
            f"{kind}: the prompt has {len(ids)} tokens but max_model_len is "
            f"{info.max_model_len} (leave room for output, or set truncate_input_tokens)")
    return ids


def _float(msg, name: str, default: float) -> float:
    return getattr(msg, name) if msg.HasField(name) else default


def check_request_id(request_id: str, field: str = "request_id") -> None:
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidArgument(f"{field} is longer than {MAX_REQUEST_ID_LEN} characters")
    if not request_id.isprintable():
        raise InvalidArgument(f"{field} must contain only printable characters")


def parse_request(req: pb.GenerateRequest, tokenizer, info: ModelInfo,
                  limits: ServiceLimits, registry=None,
                  correlation_id: str = "") -> ParsedRequest:
    """``registry`` (a ``PluginRegistry``) resolves ``processors``; None = none allowed.
    ``correlation_id`` (x-correlation-id metadata) names the request when it has no id."""
    check_request_id(req.request_id)
    structured = structured_spec(req.structured_output)
    if structured is not None and req.stopping.ignore_eos:
        raise InvalidArgument("stopping.ignore_eos cannot be combined with structured_output: "
                              "the grammar decides where the output ends")
    if req.speculative.enabled and not info.spec_method:
        raise InvalidArgument("speculative.enabled: speculative decoding is not enabled on "
                              "this server")
    processors = []
    if len(req.processors) > MAX_PROCESSORS:
        raise InvalidArgument(f"processors has {len(req.processors)} entries; the limit is "
                              f"{MAX_PROCESSORS}")
    if req.processors:
        if registry is None:
            raise InvalidArgument(f"processors[0]: unknown processor {req.processors[0].name!r}"
                                  " (no processor plugins on this server)")
        processors = registry.build(list(req.processors))
    ids = _prompt_ids(req, tokenizer, info, limits)
    s, st, out = req.sampling, req.stopping, req.output

    n = s.n if s.HasField("n") else 1
    if n < 1 or n > limits.max_n:
        raise InvalidArgument(f"sampling.n must be in [1, {limits.max_n}], got {n}")
    if s.HasField("seed") and s.seed > MAX_SEED:
        raise InvalidArgument(f"sampling.seed must be < 2^63, got {s.seed}")
    if out.prompt_logprobs and not limits.prompt_logprobs:
        raise InvalidArgument("output.prompt_logprobs: prompt logprobs are disabled on this "
                              "server (--disable-prompt-logprobs)")
    if out.top_logprobs > limits.max_top_logprobs:
        raise InvalidArgument(f"output.top_logprobs must be <= {limits.max_top_logprobs}, "
                              f"got {out.top_logprobs}")
    if len(st.stop_sequences) > limits.max_stop_sequences:
        raise InvalidArgument(f"stopping.stop_sequences has {len(st.stop_sequences)} entries; "
                              f"the limit is {limits.max_stop_sequences}")
    for i, stop in enumerate(st.stop_sequences):
        if len(stop) > MAX_STOP_SEQUENCE_LEN:
            raise InvalidArgument(f"stopping.stop_sequences[{i}] is longer than "
                                  f"{MAX_STOP_SEQUENCE_LEN} characters")
    for i, t in enumerate(st.stop_token_ids):
        if t >= info.vocab_size:
            raise InvalidArgument(f"stopping.stop_token_ids[{i}] = {t} is outside the "
                                  f"vocabulary [0, {info.vocab_size})")

    room = context_room(len(ids), info)
    if st.HasField("max_new_tokens"):
        max_new = st.max_new_tokens
        if max_new > limits.max_new_tokens:
            raise InvalidArgument(f"stopping.max_new_tokens must be <= {limits.max_new_tokens} "
                                  f"(the server's --max-new-tokens), got {max_new}")
        if max_new > room:
            raise InvalidArgument(
                f"stopping.max_new_tokens: prompt ({len(ids)} tokens) + max_new_tokens "
                f"({max_new}) exceeds max_model_len ({info.max_model_len})")
    else:
        max_new = min(limits.default_max_new_tokens, limits.max_new_tokens, room)
        if st.min_new_tokens > max_new:  # name where the unset maximum came from
            raise InvalidArgument(
                f"stopping.min_new_tokens ({st.min_new_tokens}) is more than the "
                f"{max_new} tokens max_new_tokens defaults to here (unset: the least of "
                f"--default-max-new-tokens {limits.default_max_new_tokens}, --max-new-tokens "
                f"{limits.max_new_tokens} and the context's room after a {len(ids)}-token "
                f"prompt, {room})")

    try:
        params = SamplingParams(
            n=n,
            temperature=_float(s, "temperature", 0.0),  # unset = greedy, as in TGIS
            top_k=s.top_k if s.HasField("top_k") else 0,
            top_p=_float(s, "top_p", 1.0),
            min_p=_float(s, "min_p", 0.0),
            typical_p=_float(s, "typical_p", 1.0),
            repetition_penalty=_float(s, "repetition_penalty", 1.0),
            presence_penalty=_float(s, "presence_penalty", 0.0),
            frequency_penalty=_float(s, "frequency_penalty", 0.0),
            seed=sampling_seed(_float(s, "temperature", 0.0),
                               s.seed if s.HasField("seed") else None),
            max_new_tokens=max_new,
            min_new_tokens=st.min_new_tokens,
            stop=list(st.stop_sequences),
            stop_token_ids=list(st.stop_token_ids),
            ignore_eos=st.ignore_eos,
            include_stop_sequence=st.include_stop_sequence,
            time_limit_s=st.time_limit_ms / 1000 if st.time_limit_ms else None,
            logprobs=out.logprobs,
            top_logprobs=out.top_logprobs,
            prompt_logprobs=out.top_logprobs if out.prompt_logprobs else None,
            logits_processors=processors,
            speculative=(req.speculative.enabled if req.speculative.HasField("enabled")
                         else None),
        )
    except ParamError as e:
        raise InvalidArgument(f"{_SECTION.get(e.param, 'sampling')}.{e}") from None
    request_id, engine_request_id = new_request_id(req.request_id or correlation_id)
    return ParsedRequest(request_id, engine_request_id, ids, params, out, structured,
                         adapter_id=req.adapter_id)
