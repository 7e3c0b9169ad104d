"""Decode-only steps through a forward compiled (CPU) or captured (CUDA) at start-up.

A pure-decode step has one query token per row, so its shape is fixed by the row count.

- CPU: ``torch.compile`` of the whole model with attention left out of the graph as the
  opaque op ``genserve::decode_attention`` (attention.py), split there and compiled
  piece by piece (piecewise.py: one layer compiled, shared by all). Two graphs:
  one for a single row (static shapes) and one for 2..``max_rows`` rows (the row count a
  dynamic dimension, so no padding and no graph per bucket; compiled at ``max_rows``,
  see ``_compile_dynamic``). Attention runs eagerly
  between the pieces and reads only as many KV blocks as the step's longest row needs
  (in place on a CPU in fp32: native_attention.cpp).
  Inductor's FX graph cache keeps the compiled code under the genserve cache root.
- CUDA: the model captured as one ``torch.cuda.CUDAGraph`` per (row bucket, context
  width) over static buffers, rows padded up to the bucket (padded rows write to the
  scratch block), attention in-graph over a block table of the width's columns masked by
  sequence length (no host values in the graph). Widths of 256, 1024 tokens and
  ``max_model_len``: a graph as wide as the context gathers 16x the KV a short sequence
  needs, which at 32 rows cost more than the rest of the step. Tested on a lent H100
  (tests/engine/runners/test_cuda_graphs.py). What is captured is the same compiled
  forward as on CPU (inductor's fused kernels between the opaque attention calls; one
  graph for 1 row, one with the row count dynamic for the rest), unless
  ``compile_cuda_graphs`` is off or adapters are on (then the eager model).

Steps with prefills, and decode steps with more rows than the largest bucket, run
eagerly. A compiled step that would recompile at run time (a guard failed) is dropped
and that step runs eagerly, instead of stalling the server for a compile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from engine.runners.base import BuildReport, WarmupReport
from engine.runners.torch import triton_decode
from engine.runners.torch.attention import OpaqueDecode, StaticDecode, forward_context
from engine.runners.torch.decode_inputs import (
    DecodeInputs,
    DecodeRowLike,
    build_decode_inputs,
    decode_width,
    flat_decode_inputs,
    flat_views,
)
from engine.runners.torch.kv_tensors import KVCache
from engine.runners.torch.lora import LoraLayers
from engine.runners.torch.native_decode import NativeDecodeStep, native_step

log = logging.getLogger(__name__)

_OPAQUE = OpaqueDecode()


def cache_root() -> Path:
    """genserve's on-disk cache: ``$GENSERVE_CACHE_DIR`` or ``~/.cache/genserve``."""
    env = os.environ.get("GENSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "genserve"


def use_inductor_cache_dir() -> Path:
    """Keep inductor's compiled code under the genserve cache root, unless the user chose
    a ``TORCHINDUCTOR_CACHE_DIR``. Torch fills that variable with its own default (under
    /tmp) the first time anything asks, e.g. when a custom op is registered, so torch's
    default counts as not chosen; inductor's path caches are cleared after the switch."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")
        if current is not None:
            from torch._inductor.utils import clear_caches

            clear_caches()
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def cap_buckets(buckets: Sequence[int], max_rows: int) -> list[int]:
    """The buckets up to ``max_rows``, plus the smallest one above it (so ``max_rows``
    itself fits when it is not a bucket)."""
    ordered = sorted({b for b in buckets if b > 0})
    kept = [b for b in ordered if b <= max_rows]
    above = [b for b in ordered if b > max_rows]
    if above and (not kept or kept[-1] < max_rows):
        kept.append(above[0])
    return kept


StepFn = Callable[[torch.Tensor], torch.Tensor]  # flat_decode_inputs -> logits


def _plain_forward(model: Any, input_ids: torch.Tensor, positions: torch.Tensor
                   ) -> torch.Tensor:
    return model(input_ids=input_ids, position_ids=positions, use_cache=False,
                 genserve_meta=_OPAQUE).logits


def _compile_patches() -> contextlib.AbstractContextManager:
    """Dynamo settings for every compile of the decode step. One code object serves every
    graph of every runner: allow an entry for each, and keep each entry static but for the
    row count marked dynamic. Dynamo's defaults track what changed between compiles *of
    the code object*: a float that differs from the previous model's (Granite's attention
    scale 0.1 after Llama's 0.25) became a symbolic input, inductor failed on the piece
    that produced it, and every later compile in the process failed the same way
    (specialize_float alone fixes it; a draft model of other shapes would meet the same
    with automatic dynamic shapes). Specialised, a changed float or shape is just another
    entry."""
    return torch._dynamo.config.patch(recompile_limit=1024,
                                      accumulated_recompile_limit=65536,
                                      specialize_float=True,
                                      automatic_dynamic_shapes=False)


class DecodeGraphs:
    """The compiled decode step of one runner (its model and KV cache)."""

    def __init__(self, model: Any, kv_cache: KVCache, block_size: int, scratch_block: int,
                 max_blocks_per_seq: int, device: torch.device,
                 lora: LoraLayers | None = None, compile_cuda: bool = True,
                 allow_native: bool = True) -> None:
        self.model = model
        self.allow_native = allow_native  # False with tensor parallelism (sharded layers)
        self._native: NativeDecodeStep | None = None  # CPU: the native step, when it applies
        self.compile_cuda = compile_cuda
        self.lora = lora  # adapter slots: every graph applies them, masked per row
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.num_layers = kv_cache.spec.num_layers  # attention calls in one forward
        self._compiled: Any = None  # CPU: torch.compile'd forward (both graphs)
        self._single = False  # CPU: the one-row graph is ready
        self._native_max = 0  # CPU: the most rows the native step takes (its largest bucket)
        self._dynamic_max = 0  # CPU: the 2..max-row graph is ready (0 = not)
        self._cuda_steps: dict[tuple[int, int], StepFn] = {}  # CUDA: (rows, width) -> replay
        self._pool: Any = None

    @property
    def max_rows(self) -> int:
        """The most decode rows a compiled step takes (0 = none ready)."""
        if self.device.type == "cuda":
            return max((rows for rows, _ in self._cuda_steps), default=0)
        if self._native is not None:
            return self._native_max
        return max(self._dynamic_max, int(self._single))

    def covers(self, rows: int) -> bool:
        if self._native is not None:
            return 1 <= rows <= self._native_max
        if self.device.type == "cuda":
            return self.max_rows >= rows
        return (rows == 1 and self._single) or 2 <= rows <= self._dynamic_max

    # ---- running -------------------------------------------------------------------

    def run(self, decodes: Sequence[DecodeRowLike]) -> torch.Tensor | None:
        """Logits ``[len(decodes), vocab]``, or None when no compiled step covers this
        many rows (the caller runs it eagerly)."""
        n = len(decodes)
        if self.device.type == "cuda":
            need = decode_width(decodes, self.block_size)
            key = min(((r, w) for r, w in self._cuda_steps if r >= n and w >= need),
                      default=None)
            if key is None:
                return None
            flat = flat_decode_inputs(decodes, self.block_size, self.scratch_block,
                                      key[0], key[1])
            if self.lora is not None:
                self.lora.fill_static([r.adapter_slot for r in decodes] + [0] * (key[0] - n))
            return self._cuda_steps[key](flat)[:n]
        if not self.covers(n):
            return None
        inputs = build_decode_inputs(decodes, self.block_size, self.scratch_block,
                                     self.device)
        if self._native is not None:
            if self._native.stale:  # re-packed since: take the panels again, or run eagerly
                self._native = native_step(self.model, self.kv_cache)
                if self._native is None:
                    self._native_max = 0
                    return None
            return self._native.run(inputs)
        if self.lora is not None:
            self.lora.fill_static([r.adapter_slot for r in decodes])
        try:
            return self._cpu_step(inputs)
        except Exception:  # a guard failed (it would recompile mid-serving) or worse
            log.exception("compiled decode step for %d rows failed; steps of that size "
                          "run eagerly from now on", n)
            if n == 1:
                self._single = False
            else:
                self._dynamic_max = 0
            return None

    def _cpu_step(self, inputs: DecodeInputs) -> torch.Tensor:
        """Run the ready graph. Dynamo checks only the guards that tell its cache entries
        apart (the row count, the model): evaluating all of them (every weight's shape,
        stride, dtype...) cost ~2 ms a step on the default model, and nothing they would
        catch can change here: the inputs always come from ``build_decode_inputs``."""
        meta = inputs.metadata(self.kv_cache, self.block_size)
        with forward_context(meta, self.num_layers), \
                torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=True):
            return self._compiled(inputs.input_ids, inputs.positions)[0]

    # ---- building ------------------------------------------------------------------

    def build(self, buckets: Sequence[int], budget_s: float,
              agree: Callable[[bool], bool] | None = None) -> WarmupReport:
        """Build while the budget lasts; a build that would likely overrun it (judged by
        the previous one's time) is skipped and its steps run eagerly. ``agree``: with
        tensor parallelism, every rank goes by rank 0's decision to build or skip (each
        build runs forwards whose all-reduces need every rank)."""
        report = WarmupReport()
        if self.device.type == "cpu" and self.lora is None and self.allow_native:
            self._native = native_step(self.model, self.kv_cache)
            if self._native is not None:  # nothing to compile
                self._native_max = max(buckets, default=1)
                label = f"1-{self._native_max}"
                report.graphs = [BuildReport(label, 0.0, "native")]
                log.info("decode steps of %s rows run natively (nothing compiled)", label)
                return report
        if self.lora is not None:
            self.lora.reserve_static(max(buckets, default=1))
            self.lora.freeze_folds()
        start = time.perf_counter()
        last = 0.0
        if (reason := self._uncapturable()) is not None:
            log.warning("decode graphs not captured: %s; decode steps run eagerly", reason)
            report.graphs = [BuildReport(label, 0.0, f"skipped ({reason})")
                             for label, _ in self._plan(buckets)]
            return report
        for label, build in self._plan(buckets):
            left = budget_s - (time.perf_counter() - start)
            go = not (left <= 0 or last > left)
            if agree is not None:
                go = agree(go)
            if not go:
                report.graphs.append(BuildReport(label, 0.0, "skipped (budget)"))
                log.warning("decode graph for %s rows skipped: the %.0fs compile budget is "
                            "spent; those steps run eagerly", label, budget_s)
                continue
            t0 = time.perf_counter()
            try:
                status = build()
            except Exception as exc:  # a model the compiler cannot handle stays eager
                log.exception("decode graph for %s rows failed to build; those steps run "
                              "eagerly", label)
                status = f"failed: {type(exc).__name__}"
            last = time.perf_counter() - t0
            report.graphs.append(BuildReport(label, last, status))
            log.info("decode graph for %s rows: %s in %.1fs", label, status, last)
        report.seconds = time.perf_counter() - start
        log.info("compiled decode step (%s): %s rows ready in %.1fs",
                 "CUDA graphs" if self.device.type == "cuda" else "torch.compile",
                 ", ".join(report.ready) or "no", report.seconds)
        return report

    def _uncapturable(self) -> str | None:
        """Why this model's decode step cannot be a CUDA graph, if it cannot. Measured on
        an H200 (torch 2.11): transformers' grouped_mm experts in float32 copy to the host
        inside the forward (torch's float32 grouped_mm, or transformers' fallback reading
        the offsets), which capture forbids; bf16, the CUDA default, captures."""
        if self.device.type != "cuda":
            return None
        experts = getattr(self.model.config, "_experts_implementation", None)
        dtype = next(self.model.parameters()).dtype
        if experts == "grouped_mm" and dtype == torch.float32:
            return "mixture-of-experts layers in float32 sync with the host; use bf16"
        return None

    def _plan(self, buckets: Sequence[int]) -> list[tuple[str, Callable[[], str]]]:
        sizes = sorted({b for b in buckets if b > 0})
        if self.device.type == "cuda":  # largest first: later graphs reuse its pool memory
            widths = sorted({min(w, self.max_blocks_per_seq) for w in (
                256 // self.block_size, 1024 // self.block_size, self.max_blocks_per_seq)})
            return [(f"{b}x{w * self.block_size}",
                     partial(self._capture_cuda, b, w, sizes[-1]))
                    for b in reversed(sizes) for w in reversed(widths) if w > 0]
        plan: list[tuple[str, Callable[[], str]]] = []
        if 1 in sizes:
            plan.append(("1", self._compile_single))
        if sizes and sizes[-1] >= 2:
            plan.append((f"2-{sizes[-1]}", partial(self._compile_dynamic, sizes[-1])))
        return plan

    def _inductor_on_cuda(self) -> bool:
        """Capture inductor's compiled forward instead of the eager model: its fused
        kernels replace the ~400 small ones (norms, rotary, residual adds) that cost a
        third of a Llama-3-8B-shaped batch-1 step on an H200. Adapters keep the eager
        capture (their slot masks are captured per row bucket)."""
        return self.compile_cuda and self.lora is None

    def _paged_kernel(self) -> bool:
        """Attend with the Triton paged-decode kernel where it applies (CUDA, Triton
        present, head size up to 256, the kernel checked on this device); otherwise
        the gather + SDPA path."""
        spec = self.kv_cache.spec
        return triton_decode.enabled(self.device, spec.dtype, spec.num_kv_heads,
                                     spec.head_dim)

    def _compiled_forward(self) -> Any:
        if self._compiled is None:
            from engine.runners.torch.piecewise import piecewise_backend

            use_inductor_cache_dir()
            self._compiled = torch.compile(partial(_plain_forward, self.model),
                                           fullgraph=True, backend=piecewise_backend)
        return self._compiled

    def _warm_call(self, rows: int, dynamic_max: int = 0) -> None:
        """One padding-only step (every row reads and writes the scratch block)."""
        fn = self._compiled_forward()
        with _compile_patches(), torch.inference_mode():  # inputs as execute() makes them
            warm = build_decode_inputs([], self.block_size, self.scratch_block,
                                       self.device, pad_to=rows, width=1)
            if dynamic_max:
                for t in (warm.input_ids, warm.positions):
                    torch._dynamo.mark_dynamic(t, 1, min=2, max=dynamic_max)
            with forward_context(warm.metadata(self.kv_cache, self.block_size),
                                 self.num_layers):
                fn(warm.input_ids, warm.positions)

    def _verify(self, rows: int) -> None:
        """A padding-only step of ``rows`` through the ready graphs, refusing to compile."""
        with torch.inference_mode():
            warm = build_decode_inputs([], self.block_size, self.scratch_block,
                                       self.device, pad_to=rows, width=1)
            self._cpu_step(warm)

    def _compile_single(self) -> str:
        self._warm_call(1)
        self._single = True
        return "compiled"

    def _compile_dynamic(self, max_rows: int) -> str:
        """Compiled at the top of the range, then checked at its bottom. Both caches pick
        an entry by evaluating its guards at the example's row count only, not over the
        marked range: compiled at 2 rows, an entry for 2..4 rows (a smaller
        ``max_num_seqs`` earlier, in this process or in inductor's on-disk cache) matched,
        and its ``rows <= 4`` broke the 2..8 constraint (ConstraintViolationError) or the
        check at 8 rows. At ``max_rows`` only an entry covering it can match."""
        self._warm_call(max_rows, dynamic_max=max_rows)
        for rows in sorted({2, 3} - {max_rows}):
            if rows <= max_rows:
                self._verify(rows)  # raises if this size would need a graph of its own
        self._dynamic_max = max_rows
        return "compiled"

    def _capture_cuda(self, rows: int, width: int, max_rows: int) -> str:
        """Static buffers + one CUDA graph for ``rows`` (padded) decode rows whose contexts
        fit ``width`` blocks. Compiled with inductor, one graph of 2..``max_rows`` rows
        (the row count dynamic) serves every bucket above 1, so a bucket costs a capture,
        not a compile."""
        with torch.inference_mode():  # padding only until a step copies its rows in
            flat = flat_decode_inputs([], self.block_size, self.scratch_block, rows,
                                      width).to(self.device)
            static = flat_views(flat, rows, width)
        if rows >= 2 and self._inductor_on_cuda():
            for t in (static.input_ids, static.positions):
                torch._dynamo.mark_dynamic(t, 1, min=2, max=max(max_rows, 2))
        meta = StaticDecode(self.kv_cache, static.slot_mapping, static.block_tables,
                            static.seq_lens, kernel=self._paged_kernel())
        model, lora = self.model, self.lora
        compiled = self._compiled_forward() if self._inductor_on_cuda() else None

        def forward() -> torch.Tensor:
            if compiled is not None:  # inductor's fused kernels, attention opaque
                with _compile_patches(), forward_context(meta, self.num_layers):
                    return compiled(static.input_ids, static.positions)
            with lora.capturing(rows) if lora is not None else contextlib.nullcontext():
                return model(input_ids=static.input_ids, position_ids=static.positions,
                             use_cache=False, genserve_meta=meta).logits

        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    forward()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._pool):
                out = forward()

        def step(inputs: torch.Tensor) -> torch.Tensor:
            flat.copy_(inputs)  # flat_decode_inputs' layout: every static input at once
            graph.replay()
            return out[0].clone()  # the next replay overwrites ``out``

        self._cuda_steps[rows, width] = step
        return "captured"
