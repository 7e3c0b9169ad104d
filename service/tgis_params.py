"""TGIS ``fmaas.Parameters`` -> engine inputs, validated as TGIS validates them.

TGIS clients rely on its defaults (0 = off for top_k/top_p/typical_p/repetition_penalty,
unset temperature = 1.0 when sampling, max_new_tokens 0 = the server's cap) and on its
error messages; they are kept here where they are clear. Every failure is an
``InvalidArgument`` (INVALID_ARGUMENT), never anything else.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.config import ModelInfo
from engine.request_limits import context_room
from engine.sampling_params import ParamError, SamplingParams
from fmaas import generation_pb2 as tgis
from service.validation import InvalidArgument, ServiceLimits, parse_structured, sampling_seed
from structured.spec import AUTO, StructuredSpec

MAX_TOP_N_TOKENS = 10
MAX_STOP_SEQS = 6
MAX_STOP_SEQ_LENGTH = 240
MIN_TEMPERATURE = 0.05
MAX_LOG_GROWTH = 80.0  # the length penalty's EOS growth stops at e**80 (finite, decisive)
TGIS_STRUCTURED_PREFIX = ""  # TGIS names its fields bare: "choice.choices", "json_schema"


@dataclass
class TgisOptions:
    """Server settings only the TGIS API reads."""

    default_include_stop_seqs: bool = True  # --default-include-stop-seqs


@dataclass
class TgisRequest:
    """One prompt of a TGIS call, ready for the engine."""

    text: str
    prompt_token_ids: list[int]
    params: SamplingParams
    structured: StructuredSpec | None
    token_limited: bool  # the context, not the request, set max_new_tokens (TOKEN_LIMIT)


class LengthPenalty:
    """TGIS's exponential EOS boost: after ``start_index`` generated tokens, the EOS logits
    grow by ``|logit| * (decay_factor ** (generated - start_index) - 1)``.

    Stateless (shared by a request's sequences): the output so far, which the engine
    passes with every row (speculative rows included), is the count it needs.
    """

    def __init__(self, start_index: int, decay_factor: float, eos_token_ids: list[int]) -> None:
        self.start_index = start_index
        self.decay_factor = decay_factor
        self.eos = eos_token_ids

    def __call__(self, prompt_ids: Sequence[int], output_ids: Sequence[int],
                 logits: torch.Tensor) -> torch.Tensor:
        past = len(output_ids) - self.start_index
        if past <= 0 or not self.eos:
            return logits
        logits = logits.clone()
        eos = logits[self.eos]
        # decay_factor ** past overflows a float past ~646 tokens at 3.0 (TGIS allows up to
        # 10.0 and outputs of thousands): e**80 already makes EOS certain, and stays finite
        growth = (self.decay_factor ** past
                  if past * math.log(self.decay_factor) < MAX_LOG_GROWTH
                  else math.exp(MAX_LOG_GROWTH))
        logits[self.eos] = eos + eos.abs() * (growth - 1)
        return logits


def check_adapters(request) -> None:
    """Prompt tuning (the deprecated ``prefix_id``) does not exist here; LoRA adapters
    (``adapter_id``) are the engine's to load and check."""
    if request.HasField("prefix_id") and request.prefix_id:
        raise InvalidArgument(f"prefix_id: prompt-tuning prefixes are not supported by this "
                              f"server (got {request.prefix_id!r}); LoRA adapters go in "
                              f"adapter_id")


def validate_params(p: tgis.Parameters, limits: ServiceLimits) -> None:
    """The checks TGIS makes on ``Parameters``, with its messages."""
    resp, stopping, decoding = p.response, p.stopping, p.decoding
    if p.method not in (tgis.GREEDY, tgis.SAMPLE):
        raise InvalidArgument(f"method: unknown decoding method {p.method}")
    if decoding.HasField("length_penalty") and not (
            1.0 <= decoding.length_penalty.decay_factor <= 10.0):
        raise InvalidArgument("length_penalty.decay_factor must be >= 1.0 and <= 10.0")
    if not 0 <= decoding.repetition_penalty <= 2:
        raise InvalidArgument("repetition_penalty must be > 0.0 and <= 2.0")
    if stopping.max_new_tokens > limits.max_new_tokens:
        raise InvalidArgument(f"max_new_tokens must be <= {limits.max_new_tokens}")
    if stopping.min_new_tokens > (stopping.max_new_tokens or limits.max_new_tokens):
        raise InvalidArgument("min_new_tokens must be <= max_new_tokens")
    stops = stopping.stop_sequences
    if len(stops) > MAX_STOP_SEQS or not all(0 < len(s) <= MAX_STOP_SEQ_LENGTH for s in stops):
        raise InvalidArgument(f"can specify at most {MAX_STOP_SEQS} non-empty stop sequences, "
                              f"each not more than {MAX_STOP_SEQ_LENGTH} UTF8 bytes")
    if resp.top_n_tokens > MAX_TOP_N_TOKENS:
        raise InvalidArgument(f"top_n_tokens ({resp.top_n_tokens}) must be <= "
                              f"{MAX_TOP_N_TOKENS}")
    if (resp.token_logprobs or resp.token_ranks or resp.top_n_tokens) and not (
            resp.input_tokens or resp.generated_tokens):
        raise InvalidArgument("must request input and/or generated tokens to request extra "
                              "token detail")
    if p.method == tgis.SAMPLE:  # sampling fields are ignored (not checked) when greedy
        s = p.sampling
        if s.temperature and s.temperature < MIN_TEMPERATURE:
            raise InvalidArgument(f"temperature must be >= {MIN_TEMPERATURE}")
        if not 0 <= s.top_p <= 1:
            raise InvalidArgument("top_p must be > 0.0 and <= 1.0")
        if not 0 <= s.typical_p <= 1:
            raise InvalidArgument("typical_p must be >= 0.0 and <= 1.0 (0 = off)")
        if s.HasField("seed") and s.seed >= 2**63:
            raise InvalidArgument(f"seed must be < 2^63, got {s.seed}")


def guided_spec(decoding: tgis.DecodingParameters) -> StructuredSpec | None:
    """TGIS's ``guided`` oneof, checked by the native API's ``parse_structured``."""
    kind = decoding.WhichOneof("guided")
    if kind is None:
        return None
    if kind == "format":
        if decoding.format == tgis.DecodingParameters.TEXT:
            return None
        if decoding.format != tgis.DecodingParameters.JSON:
            raise InvalidArgument(f"format: unknown response format {decoding.format}")
        return parse_structured("json_object", "", AUTO, "", TGIS_STRUCTURED_PREFIX)
    value = tuple(decoding.choice.choices) if kind == "choice" else getattr(decoding, kind)
    return parse_structured(kind, value, AUTO, "", TGIS_STRUCTURED_PREFIX)


def tokenize_prompt(text: str, tokenizer, truncate: int) -> list[int]:
    """Prompt ids exactly as ``Tokenize`` counts them: the last ``truncate`` kept."""
    ids = list(tokenizer(text)["input_ids"]) if text else []
    return ids[-truncate:] if truncate and len(ids) > truncate else ids


def build_request(p: tgis.Parameters, text: str, tokenizer, info: ModelInfo,
                  limits: ServiceLimits, options: TgisOptions) -> TgisRequest:
    """One prompt of a call whose ``p`` passed ``validate_params``."""
    ids = tokenize_prompt(text, tokenizer, p.truncate_input_tokens)
    if not ids:
        raise InvalidArgument("text: the prompt is empty (it tokenizes to no tokens)")
    n, ctx, room = len(ids), info.max_model_len, context_room(len(ids), info)
    if room < 1:
        raise InvalidArgument(f"input tokens ({n}) plus prefix length (0) must be < {ctx}")
    stopping, decoding, resp = p.stopping, p.decoding, p.response
    if stopping.min_new_tokens > room:
        raise InvalidArgument(f"input tokens ({n}) plus prefix length (0) plus min_new_tokens "
                              f"({stopping.min_new_tokens}) must be <= {ctx}")
    asked = stopping.max_new_tokens or limits.max_new_tokens
    max_new = min(asked, room)

    processors: list = []
    if decoding.HasField("length_penalty"):
        lp = decoding.length_penalty
        processors.append(LengthPenalty(lp.start_index, lp.decay_factor, info.eos_token_ids))
    sampling: dict = {}
    if p.method == tgis.SAMPLE:
        s = p.sampling
        temperature = s.temperature if s.HasField("temperature") else 1.0
        sampling = dict(
            temperature=temperature, top_k=s.top_k, top_p=s.top_p or 1.0,
            typical_p=s.typical_p or 1.0,
            seed=sampling_seed(temperature, s.seed if s.HasField("seed") else None))
    detail = resp.token_logprobs or resp.token_ranks or resp.top_n_tokens > 0
    include_stop = (stopping.include_stop_sequence if stopping.HasField("include_stop_sequence")
                    else options.default_include_stop_seqs)
    try:
        params = SamplingParams(
            **sampling,
            repetition_penalty=decoding.repetition_penalty or 1.0,
            max_new_tokens=max_new,
            min_new_tokens=stopping.min_new_tokens,
            stop=list(stopping.stop_sequences),
            include_stop_sequence=include_stop,
            time_limit_s=stopping.time_limit_millis / 1000 if stopping.time_limit_millis else None,
            logprobs=bool(resp.generated_tokens and detail),
            top_logprobs=resp.top_n_tokens if resp.generated_tokens else 0,
            prompt_logprobs=(resp.top_n_tokens if resp.input_tokens and detail
                             and limits.prompt_logprobs else None),
            logits_processors=processors,
        )
    except ParamError as e:  # a range TGIS does not check itself (e.g. top_k)
        raise InvalidArgument(str(e)) from None
    return TgisRequest(text, ids, params, guided_spec(decoding), max_new < asked)
