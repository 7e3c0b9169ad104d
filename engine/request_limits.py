"""A request's limits in engine terms: what it may ask for when it arrives (vocabulary,
context, KV capacity) and when its time limit ends it."""

from __future__ import annotations

from collections.abc import Iterable

from engine.config import ModelInfo, RequestError
from engine.sampling_params import SamplingParams
from engine.sequence import Request, Sequence


def check_request(prompt_token_ids: list[int], params: SamplingParams, info: ModelInfo,
                  kv_capacity: int) -> int:
    """The request's max new tokens, or ``RequestError`` naming the limit it exceeds."""
    if not prompt_token_ids:
        raise RequestError("prompt", "the prompt is empty")
    bad = next((t for t in prompt_token_ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise RequestError("vocabulary", f"token id {bad} is outside the vocabulary "
                           f"[0, {info.vocab_size})")
    room = info.max_model_len - len(prompt_token_ids)
    if room < 1:
        raise RequestError("context", f"the prompt has {len(prompt_token_ids)} tokens; "
                           f"the context is {info.max_model_len} tokens")
    max_new = min(params.max_new_tokens, room)
    if len(prompt_token_ids) + max_new > kv_capacity:
        raise RequestError("kv_cache", f"prompt + max new tokens "
                           f"({len(prompt_token_ids) + max_new} tokens) exceeds the KV "
                           f"cache ({kv_capacity} tokens)")
    return max_new


def past_time_limit(requests: Iterable[Request], now: float) -> list[Sequence]:
    """The unfinished sequences of the requests whose deadline is at or before ``now``."""
    return [seq for req in requests if req.deadline is not None and now >= req.deadline
            for seq in req.sequences if not seq.is_finished]
