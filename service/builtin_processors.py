"""Two example processor plugins, always registered.

``banned_phrases`` (stateless, shared): the listed words/phrases never appear in the
output as tokenized (with and without a leading space). ``no_repeat_window`` (stateless,
shared): no token may repeat within the last ``window`` output tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

MAX_PHRASES = 256
MAX_PHRASE_CHARS = 256
MAX_WINDOW = 1024


class BannedPhrasesProcessor:
    """Bans a phrase's last token whenever the output ends with the rest of it."""

    def __init__(self, phrases: list[list[int]]) -> None:
        self.single = sorted({p[0] for p in phrases if len(p) == 1})
        self.multi = [p for p in phrases if len(p) > 1]

    def __call__(self, prompt_ids: Sequence[int], output_ids: Sequence[int],
                  logits: torch.Tensor) -> torch.Tensor:
        ban = list(self.single)
        for p in self.multi:
            k = len(p) - 1
            if len(output_ids) >= k and list(output_ids[len(output_ids) - k:]) == p[:-1]:
                ban.append(p[-1])
        if ban:
            logits = logits.clone()
            logits[ban] = -torch.inf
        return logits


class BannedPhrases:
    name = "banned_phrases"

    def __init__(self, context) -> None:
        self.tokenizer = context.tokenizer

    def build(self, args: dict[str, Any]) -> BannedPhrasesProcessor:
        phrases = args.get("phrases")
        extra = set(args) - {"phrases"}
        if extra:
            raise ValueError(f"unknown argument(s) {sorted(extra)}; expected 'phrases'")
        if (not isinstance(phrases, list) or not phrases or len(phrases) > MAX_PHRASES
                or not all(isinstance(p, str) and p.strip() for p in phrases)):
            raise ValueError(f"'phrases' must be a list of 1..{MAX_PHRASES} non-empty strings")
        if any(len(p) > MAX_PHRASE_CHARS for p in phrases):
            raise ValueError(f"each phrase must be at most {MAX_PHRASE_CHARS} characters")
        encoded = []
        for phrase in phrases:
            for variant in (phrase, " " + phrase.lstrip()):
                ids = self.tokenizer(variant, add_special_tokens=False)["input_ids"]
                if ids:
                    encoded.append(list(ids))
        return BannedPhrasesProcessor(encoded)


class NoRepeatWindowProcessor:
    """Bans the last ``window`` output tokens, read afresh from each row's output: the
    rows of a speculative verify pass it outputs that end in proposals, and the next step's
    output may have dropped them (a running count of what it was shown kept rejected
    proposals and missed their replacements). At most 1,024 ids a row."""

    def __init__(self, window: int) -> None:
        self.window = window

    def __call__(self, prompt_ids: Sequence[int], output_ids: Sequence[int],
                 logits: torch.Tensor) -> torch.Tensor:
        recent = set(output_ids[-self.window:])
        if not recent:
            return logits
        logits = logits.clone()
        logits[list(recent)] = -torch.inf
        return logits


class NoRepeatWindow:
    name = "no_repeat_window"

    def __init__(self, context) -> None:  # needs nothing from the server
        del context

    def build(self, args: dict[str, Any]) -> NoRepeatWindowProcessor:
        window = args.get("window")
        extra = set(args) - {"window"}
        if extra:
            raise ValueError(f"unknown argument(s) {sorted(extra)}; expected 'window'")
        if not isinstance(window, int) or isinstance(window, bool) or not \
                1 <= window <= MAX_WINDOW:
            raise ValueError(f"'window' must be an integer in [1, {MAX_WINDOW}]")
        return NoRepeatWindowProcessor(window)
