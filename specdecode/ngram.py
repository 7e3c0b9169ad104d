"""Prompt lookup: propose what followed the last earlier occurrence of the context's tail.

No model: copy-heavy generations (editing code, repeating a list, extracting fields from a
passage) repeat spans of their own prompt and output, so the tokens that followed the
latest earlier match of the last n tokens are a cheap, often right, guess. Longer n-grams
are tried first (a longer match is a better predictor).
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min ({ngram_min}) <= ngram_max ({ngram_max})")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def lookup(self, context: list[int], k: int) -> list[int]:
        tokens = np.asarray(context, dtype=np.int64)
        n_tokens = len(tokens)
        for n in range(min(self.ngram_max, n_tokens - 1), self.ngram_min - 1, -1):
            # Windows starting at 0 .. n_tokens - n - 1: every earlier n-gram that has at
            # least one token after it (the tail itself is excluded).
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[n_tokens - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return context[start:start + k]
        return []
