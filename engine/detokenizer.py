"""Incremental detokenization: each new token costs a small window decode, never the
whole output.

Byte-level BPE tokens do not map 1:1 to text (a character may span tokens; leading spaces
depend on the previous token), so we decode a short window ``ids[prefix:]`` and emit what
it adds beyond ``ids[prefix:read]``, holding text back while it ends in an incomplete
UTF-8 sequence (the replacement character), as vLLM does.
"""

from __future__ import annotations

PROMPT_CONTEXT = 5  # prompt tokens kept as left context for the first output token


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._special = set(tokenizer.all_special_ids) if skip_special_tokens else set()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def step(self, token_id: int) -> str:
        """Append one token; return the text it completes ('' while a character is partial)."""
        if token_id in self._special:
            return ""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            if self.prefix_offset > 64:  # keep the window (and the list) small
                drop = self.prefix_offset
                self.ids = self.ids[drop:]
                self.prefix_offset -= drop
                self.read_offset -= drop
            return new
        return ""
