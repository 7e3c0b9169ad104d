"""A request's limits in engine terms: what it may ask for when it arrives (vocabulary,
context, KV capacity) and when its time limit ends it.

``admit`` decides a request's ``max_new_tokens`` once, at admission, and writes it into
its params: everything downstream (sequences, stop checking, speculation) reads
``params.max_new_tokens`` and nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from engine.config import ModelInfo, RequestError
from engine.sampling_params import SamplingParams
from engine.sequence import Request, Sequence


def context_room(prompt_len: int, info: ModelInfo) -> int:
    """Tokens the context leaves for output after a ``prompt_len``-token prompt (< 1: none).
    The one definition of the room: the services refuse or clip by it, the engine clips."""
    return info.max_model_len - prompt_len


def admit(prompt_token_ids: list[int], params: SamplingParams, info: ModelInfo,
          kv_capacity: int) -> SamplingParams:
    """``params`` as the engine runs them (``max_new_tokens`` clipped to the context room),
    or ``RequestError`` naming the limit the request exceeds."""
    if not prompt_token_ids:
        raise RequestError("prompt", "the prompt is empty")
    bad = next((t for t in prompt_token_ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise RequestError("vocabulary", f"token id {bad} is outside the vocabulary "
                           f"[0, {info.vocab_size})")
    room = context_room(len(prompt_token_ids), info)
    if room < 1:
        raise RequestError("context", f"the prompt has {len(prompt_token_ids)} tokens; "
                           f"the context is {info.max_model_len} tokens")
    max_new = min(params.max_new_tokens, room)
    if len(prompt_token_ids) + max_new > kv_capacity:
        raise RequestError("kv_cache", f"prompt + max new tokens "
                           f"({len(prompt_token_ids) + max_new} tokens) exceeds the KV "
                           f"cache ({kv_capacity} tokens)")
    if max_new == params.max_new_tokens:
        return params
    # min_new_tokens <= max_new_tokens is a rule of the params; clipping both keeps the
    # behaviour (the sequence cannot stop before its last token, which ends it by length)
    return dataclasses.replace(params, max_new_tokens=max_new,
                               min_new_tokens=min(params.min_new_tokens, max_new))


def past_time_limit(requests: Iterable[Request], now: float) -> list[Sequence]:
    """The unfinished sequences of the requests whose deadline is at or before ``now``."""
    return [seq for req in requests if req.deadline is not None and now >= req.deadline
            for seq in req.sequences if not seq.is_finished]
