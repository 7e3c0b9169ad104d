"""The torch runner's own fp32 CPU kernels, built once per machine: the linear
(native_gemm.cpp) and the decode attention over the paged KV cache (native_attention.cpp,
used by attention.py), compiled into one library.

oneDNN runs a one-row product on about one core's memory bandwidth (a decode step's
linears read the weights at 10-12 GB/s on a 2-core AVX2 CPU where a plain ``sum`` reads
17.5), and its packed product is the only library one whose rows do not depend on the
batch. The native kernel keeps that property by construction (one FMA chain per output
over k in order) and splits the output features across threads at every row count.

The shared library is compiled with the C++ compiler and torch's headers on first use
(``make setup`` does it ahead: ~40 s, through ``build_now``) into ``$GENSERVE_NATIVE_DIR``
(default ``~/.cache/genserve/native``), under a name keyed by the sources, torch's version
and the flags. A CPU without AVX2/FMA, or a failed build, keeps oneDNN (logged once, with why).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = (Path(__file__).with_name("native_gemm.cpp"),
           Path(__file__).with_name("native_attention.cpp"),
           Path(__file__).with_name("native_decode.cpp"),
           Path(__file__).with_name("native_elementwise.cpp"))
HEADERS = (Path(__file__).with_name("native_simd.h"),)  # part of the library's key
NATIVE_DIR_ENV = "GENSERVE_NATIVE_DIR"
PANEL = 16  # output features per packed panel (native_gemm.cpp's NR)
QUANT_BITS = (4, 8)  # the quantised panels' forms, tried in this order
# -ffp-contract=off: the arithmetic is the one written (the quantised panels are checked
# at packing by the very operations their expansion runs)
FLAGS = ["-O3", "-std=c++20", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC",
         "-shared", "-D_GLIBCXX_USE_CXX11_ABI=" + str(int(torch.compiled_with_cxx11_abi()))]


def native_dir() -> Path:
    env = os.environ.get(NATIVE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "genserve" / "native"


def library_path() -> Path:
    key = hashlib.sha256(b"".join(src.read_bytes() for src in (*SOURCES, *HEADERS))
                         + torch.__version__.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return native_dir() / f"genserve_gemm-{key}.so"


def cpu_supported() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    words = set(flags.split())
    return sys.platform == "linux" and {"avx2", "fma"} <= words


def build(target: Path) -> None:
    """Compile the kernel into ``target`` (atomically: concurrent builders are harmless)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CXX", "g++")
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [compiler, *FLAGS, *map(str, SOURCES), "-o", tmp,
           *(f"-I{p}" for p in include_paths()),
           *(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu", "-ltorch"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{compiler} failed: {e.stderr.strip()[-2000:]}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def available() -> bool:
    """Load the kernel (building it first if this machine has no copy); False, with a
    log line saying why, where oneDNN must stay."""
    if not cpu_supported():
        log.info("native fp32 GEMM: this CPU lacks AVX2/FMA; oneDNN runs the linears")
        return False
    path = library_path()
    try:
        if not path.exists():
            log.info("building the native fp32 kernels into %s (once per machine, ~40 s)",
                     path)
            build(path)
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        log.warning("native fp32 GEMM unavailable, oneDNN runs the linears: %s", e)
        return False
    _register_fakes()
    return True


@functools.cache
def _register_fakes() -> None:
    """Shapes of the linears' outputs for torch.compile, which calls the ops in its graph
    (packed_linear.py) with the panels as inputs."""

    def out(x: torch.Tensor, n: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], n))

    torch.library.register_fake("genserve_gemm::linear")(
        lambda x, packed, n, bias: out(x, n))
    torch.library.register_fake("genserve_gemm::linear_quantized")(
        lambda x, q, scales, bits, n, bias: out(x, n))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N / 16), K, 16]`` panels, zero-padded."""
    return torch.ops.genserve_gemm.pack(weight.detach())


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The dense ``[out_features, K]`` weight back from its panels."""
    panels, k, width = packed.shape
    return packed.transpose(1, 2).reshape(panels * width, k)[:out_features].contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.genserve_gemm.linear(x, packed, out_features, bias)


def pack_quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """``weight``'s quantised panels ``(q, scales, bits)`` if every 32-weight block of every
    row is exactly ``fp32(d * q) + m`` with a 4-bit ``q`` (Q4_1's form; also Q4_0's) or
    ``fp32(d * q)`` with an 8-bit one (Q8_0's), as a model dequantised from a quantised
    file is; else None. The kernel expands them to these same fp32 values, so the product
    is the fp32 panels' bit for bit, from 6 or 9 bits a weight instead of 32."""
    for bits in QUANT_BITS:
        parts = torch.ops.genserve_gemm.pack_quantized(weight.detach(), bits)
        if parts:
            return parts[0], parts[1], bits
    return None


def dequantize(q: torch.Tensor, scales: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """The dense ``[out_features, K]`` weight back from its quantised panels."""
    return torch.ops.genserve_gemm.dequantize(q, scales, bits, out_features)


def linear_quantized(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bits: int,
                     out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.genserve_gemm.linear_quantized(x, q, scales, bits, out_features, bias)


def build_now() -> int:
    """``make setup``: build now, so the first start does not wait; exit status."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return 0 if available() else 1
