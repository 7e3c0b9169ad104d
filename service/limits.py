"""The server's request limits (``--max-new-tokens``, ``--max-batch-size``, ...).

Apart from ``service.validation`` so that ``genserve serve`` can build its flags without
importing torch: the server sets OpenMP's environment before torch loads libgomp.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServiceLimits:
    default_max_new_tokens: int = 256
    max_new_tokens: int = 1024  # the cap a request may ask for (--max-new-tokens)
    prompt_logprobs: bool = True  # False: --disable-prompt-logprobs
    max_batch_size: int = 256
    max_n: int = 16
    max_top_logprobs: int = 20
    max_stop_sequences: int = 16
    # characters of a prompt (text or chat contents) or a Tokenize text: refused before
    # tokenising, so one huge request cannot hold the tokenizer for seconds
    max_input_chars: int = 1_000_000

    def __post_init__(self) -> None:
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens:
            raise ValueError(f"the default max new tokens ({self.default_max_new_tokens}) must "
                             f"be in [1, the cap --max-new-tokens ({self.max_new_tokens})]")
