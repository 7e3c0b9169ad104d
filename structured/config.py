"""Structured output's server settings (the ``--structured-*`` flags).

Apart from ``structured.manager`` so that ``genserve serve`` can build its flags without
importing torch or the grammar backends.
"""

from __future__ import annotations

from dataclasses import dataclass

from structured.spec import DEFAULT_WHITESPACE


@dataclass
class StructuredConfig:
    max_spec_bytes: int = 512 * 1024  # real Kubernetes schemas are 100-250 KB
    compile_timeout_s: float = 10.0
    compile_max_rss_mb: int = 6144  # a compile worker past this is killed
    cache_size: int = 256
    max_consecutive_whitespace: int = 12
    compile_threads: int = 4  # threads that build llguidance grammars or wait on workers
    compile_workers: int = 1  # processes for xgrammar / lm-format-enforcer compiles
    accelerate_after: int = 2  # AUTO: requests of one spec before xgrammar builds it; 0 = off
    accelerate_timeout_s: float = 120.0
    default_whitespace: str = DEFAULT_WHITESPACE  # for requests that do not choose
    prestart_workers: bool = True  # False: spawn compile workers on first use (or prestart())
