"""``python -m bench.cuda_decode_attention``: the CUDA graphs' decode attention, Triton paged
kernel (engine/runners/torch/triton_decode.py) against the gather + SDPA path.

Two things on a GPU: accuracy against a float64 reference (bf16 and fp32, GQA, MHA, sliding
window, soft-capping; the interpreter the CPU tests use gets bf16 products wrong), and the
attention part of a 32-layer Llama-3-8B-shaped decode step (GQA 32/8, head 128) captured
as one CUDA graph per path and replayed, at 1 and 64 rows and three context widths.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.runners.torch import triton_decode
from engine.runners.torch.attention import StaticDecode, _decode, _static_decode
from engine.runners.torch.kv_tensors import KVCache, KVCacheSpec

ACCURACY_CASES = [  # rows, heads, kv heads, head dim, block size, table width, window, softcap
    (1, 32, 8, 128, 16, 16, None, None), (1, 32, 8, 128, 16, 256, None, None),
    (64, 32, 8, 128, 16, 64, None, None), (7, 16, 4, 64, 16, 40, 100, 50.0),
    (3, 8, 8, 256, 16, 20, None, 30.0), (2, 9, 3, 64, 16, 30, None, None),
    (4, 32, 32, 96, 16, 24, 50, None),  # SmolLM2's 3 KV heads; Phi-3's head size 96
]


def accuracy(dev: torch.device) -> list[dict]:
    rows_out = []
    for rows, heads, kv_heads, d, bs, width, window, cap in ACCURACY_CASES:
        for dtype in (torch.bfloat16, torch.float32):
            g = torch.Generator(device=dev).manual_seed(rows)
            blocks = width * rows + 3
            k = torch.randn(blocks, bs, kv_heads, d, generator=g, device=dev).to(dtype)
            v = torch.randn_like(k)
            tables = torch.randperm(blocks, device=dev)[:rows * width].view(rows, width)
            seq = torch.randint(1, width * bs + 1, (rows,), device=dev)
            q = torch.randn(1, heads, rows, d, generator=g, device=dev).to(dtype)[0]
            q = q.transpose(0, 1)
            mask = (torch.arange(width * bs, device=dev)[None] < seq[:, None])[:, None, None]
            ref = _decode(q.double(), k.double(), v.double(), tables, mask, d ** -0.5,
                          window, cap)

            def err(out: torch.Tensor, ref: torch.Tensor = ref) -> float:
                return ((out.double() - ref).norm() / ref.norm()).item()

            kernel = err(triton_decode.paged_decode(q, k, v, tables, seq, d ** -0.5, window,
                                                    cap))
            sdpa = err(_decode(q, k, v, tables, mask, d ** -0.5, window, cap))
            rows_out.append(dict(rows=rows, heads=f"{heads}/{kv_heads}", head_dim=d,
                                 context=width * bs, window=window, softcap=cap,
                                 dtype=str(dtype), kernel_err=kernel, sdpa_err=sdpa))
            print(json.dumps(rows_out[-1]))
    return rows_out


def step_attention_us(dev: torch.device) -> list[dict]:
    """Microseconds of 32 layers' decode attention (cache write included) per step."""
    cache = KVCache(KVCacheSpec(32, 8, 128, 16, torch.bfloat16), 4200, dev)
    out = []
    for rows, width in [(1, 256), (1, 1024), (1, 4096), (64, 256), (64, 1024), (64, 4096)]:
        tables = torch.randint(0, 4096, (rows, width // 16), device=dev)
        seq = torch.full((rows,), 200 if width == 256 else width - 5, device=dev)
        slots = torch.randint(0, 4096 * 16, (rows,), device=dev)
        q = torch.randn(1, rows, 32, 128, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        kv = torch.randn(1, rows, 8, 128, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        times = {}
        for kernel in (False, True):
            meta = StaticDecode(cache, slots, tables, seq, kernel=kernel)

            def layers(meta: StaticDecode = meta, q: torch.Tensor = q,
                       kv: torch.Tensor = kv) -> None:
                for layer in range(32):
                    _static_decode(meta, layer, q, kv, kv, None)

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                layers()
                layers()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                layers()
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                graph.replay()
            torch.cuda.synchronize()
            times["kernel" if kernel else "gather_sdpa"] = (time.perf_counter() - t0) / 50 * 1e6
        out.append(dict(rows=rows, width=width, **times))
        print(json.dumps(out[-1]))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("bench/results/cuda_decode_attention.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.cuda_decode_attention needs a CUDA device")
    dev = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "accuracy": accuracy(dev), "attention_us_per_step": step_attention_us(dev)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
