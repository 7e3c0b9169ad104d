"""Incremental detokenization: each new token costs one decode of a short window of ids,
never a decode of the whole output.

Tokens do not map 1:1 to text: a character may be split over several byte-level tokens,
and whether a token starts with a space can depend on the token before it (SentencePiece
strips the leading space of the first token it decodes). So, as vLLM's
``detokenize_incrementally`` does, we keep two offsets into the ids:

* ``prefix_offset``: start of the window; the tokens in ``[prefix_offset, read_offset)``
  are already emitted and only serve as left context;
* ``read_offset``: end of the emitted tokens.

Each step decodes ``ids[prefix_offset:]`` and emits what it adds beyond the (cached) text of
``ids[prefix_offset:read_offset]``. While the window's text ends in U+FFFD the last
character is probably incomplete UTF-8, so we emit nothing and wait for more tokens.

Tokenizer clean-up heuristics (``clean_up_tokenization_spaces``) are never applied: they
rewrite text across token boundaries (" ." -> ".") and would make the stream depend on how
it was chunked. For a tokenizer whose ``decode`` cleans up by default, the streamed text
equals ``decode(..., clean_up_tokenization_spaces=False)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens kept as left context, so the first output token gets its leading space right.
PROMPT_CONTEXT = 5

# Longest run of tokens we wait on while the text ends in U+FFFD. A real character is at
# most 4 UTF-8 bytes (so at most 4 tokens); a longer run is invalid bytes, which we then
# emit as U+FFFD so the window, and the cost per token, stay bounded.
MAX_PENDING_TOKENS = 16

# Emitted tokens dropped from the front of the id list once this many pile up (amortised
# O(1) per token; the list never holds more than a window plus this much).
TRIM_AT = 32


def backend_decode(tokenizer: Any) -> Callable[..., str] | None:
    """The Rust ``tokenizers.Tokenizer.decode`` behind a transformers fast tokenizer whose
    ``decode`` does nothing else once clean-up is off (its stock ``decode``/``_decode``),
    else None. Why: transformers' wrapper costs more than the decode of a short window
    itself, twice a token on the engine thread's critical path."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (isinstance(tokenizer, TokenizersBackend) and backend is not None
            and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode):
        return backend.decode
    return None


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, one token at a time."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._backend_decode = backend_decode(tokenizer)
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # Text of ids[prefix_offset:read_offset]: decoded once per advance, not per step.
        self._prefix_len = len(self._decode(self._ids))

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens,
                                      clean_up_tokenization_spaces=False)

    def step(self, token_id: int) -> str:
        """Append one token; return the newly decodable text.

        Returns '' while a multi-byte UTF-8 character is incomplete (the text comes with
        the token that completes it) and for tokens that decode to nothing (special tokens
        when ``skip_special_tokens``).
        """
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix_offset:])
        if len(self._ids) - self._read_offset >= MAX_PENDING_TOKENS:
            return self._advance(text)
        if len(text) <= self._prefix_len or text.endswith(REPLACEMENT_CHAR):
            # Nothing new yet. Not advancing keeps the emitted tokens as left context.
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end), as ``decode``
        renders it (U+FFFD). Called once the sequence is finished."""
        if self._read_offset == len(self._ids):
            return ""
        return self._advance(self._decode(self._ids[self._prefix_offset:]))

    def _advance(self, text: str) -> str:
        """Emit ``text``'s new part; the tokens just read become the next left context."""
        new = text[self._prefix_len:]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_len = len(self._decode(self._ids[self._prefix_offset:self._read_offset]))
        if self._prefix_offset >= TRIM_AT:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new
