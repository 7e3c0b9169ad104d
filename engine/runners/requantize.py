"""The GGUF the llama.cpp runner runs: the given file, or a copy requantised once to a
format whose batched kernels scale better, cached on disk.

Why: llama.cpp's CPU kernels for some formats cost nearly a whole one-row step per extra
row (Q4_1: 9 rows of one sequence 6.2x one row, on this 2-core machine), so prefill and
many concurrent sequences are slow, while Q8_0 has GEMM kernels (9 rows 4.7x; prefill ~2x
Q4_1) and the same batch-1 speed (docs/llamacpp-runner.md#weight-format). BF16, on a CPU
with AVX512-BF16, prefills faster still but runs one row ~25-33% slower, so it is offered,
not chosen. A requantised model is a slightly different model (the 4-bit values
re-rounded: a small error added to the file's own), so it is a flag, on by default only
for the formats measured to lose.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from pathlib import Path

from engine.loading.weights_cache import cache_root, source_key

log = logging.getLogger(__name__)

# llama_ftype values (llama.h) of the formats one may requantise to
FTYPES = {"Q8_0": 7, "BF16": 32, "F16": 1}
REQUANTIZE_CHOICES = ("auto", "none", *FTYPES)
# auto: the shipped formats measured slower than Q8_0 in batched steps, and what they become
AUTO = {"Q4_1": "Q8_0"}


def cpu_has_bf16_gemm(llama_cpp) -> bool:
    """Whether llama.cpp's CPU backend was built with and runs on AVX512-BF16 (what its
    BF16 GEMM needs; without it BF16 weights are widened to f32, slower than Q8_0)."""
    return b"AVX512_BF16 = 1" in (llama_cpp.llama_print_system_info() or b"")


def target_format(choice: str, current: str) -> str | None:
    """The format to requantise a ``current``-format file to, None to run it as it is."""
    if choice not in REQUANTIZE_CHOICES:
        raise ValueError(f"requantize must be one of {', '.join(REQUANTIZE_CHOICES)}; "
                         f"got {choice!r}")
    target = AUTO.get(current) if choice == "auto" else None if choice == "none" else choice
    return None if target == current else target


def file_format(llama_cpp, gguf: Path) -> str:
    """The GGUF's weight format as llama.cpp names it ("Q4_1"), read without its weights:
    from the file's ``general.file_type`` (a vocabulary-only load leaves
    ``llama_model_ftype`` at its "all F32" default, whatever the file holds)."""
    from gguf import LlamaFileType

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), params)
    if not model:
        raise ValueError(f"llama.cpp could not read {gguf}")
    try:
        buf = ctypes.create_string_buffer(32)
        n = llama_cpp.llama_model_meta_val_str(model, b"general.file_type", buf, len(buf))
    finally:
        llama_cpp.llama_model_free(model)
    if n < 0:
        raise ValueError(f"{gguf} names no general.file_type")
    ftype = LlamaFileType(int(buf.value))
    return "all F32" if ftype == LlamaFileType.ALL_F32 else ftype.name.removeprefix("MOSTLY_")


def served_gguf(llama_cpp, gguf: Path, choice: str, threads: int) -> Path:
    """The file the llama.cpp runner runs for ``gguf`` under ``--requantize choice`` (for
    a bench to run llama.cpp itself on the same weights)."""
    target = target_format(choice, file_format(llama_cpp, gguf))
    return requantize(llama_cpp, gguf, target, threads) if target else gguf


def requantized_path(gguf: Path, target: str) -> Path:
    """Where the cached copy of ``gguf`` in ``target`` format lives (it may not exist)."""
    return cache_root() / "requantized" / f"{gguf.stem}-{source_key(gguf)[:20]}.{target}.gguf"


def requantize(llama_cpp, gguf: Path, target: str, threads: int) -> Path:
    """The cached ``target``-format copy of ``gguf``, written now if missing (seconds;
    atomically, so a concurrent start never reads half a file). Raises OSError or
    RuntimeError when it cannot be written: the caller then runs the file as it is."""
    gguf = gguf.resolve()
    out = requantized_path(gguf, target)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[target]
    params.allow_requantize = True
    params.nthread = threads
    log.info("requantising %s to %s in %s ... (once: later starts load the copy)",
             gguf.name, target, out.parent)
    start = time.perf_counter()
    try:
        if llama_cpp.llama_model_quantize(str(gguf).encode(), str(tmp).encode(), params) != 0:
            raise RuntimeError(f"llama_model_quantize failed on {gguf}")
        tmp.chmod(0o644)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("requantised %s to %s in %.1f s", gguf.name, target, time.perf_counter() - start)
    for old in out.parent.glob(f"{gguf.stem}-*.{target}.gguf"):
        key = old.name[len(gguf.stem) + 1:-len(f".{target}.gguf")]
        if old != out and len(key) == 20 and all(c in "0123456789abcdef" for c in key):
            old.unlink(missing_ok=True)  # a copy of an earlier version of the source file
    return out
