"""A torch.compile backend that splits the graph at attention and compiles each piece once.

Compiling a whole decoder as one inductor graph costs a minute or more per shape on a
small CPU, and most of that is the same layer compiled N times. Split at the opaque
attention op (as vLLM's piecewise compile does), the graph becomes: the first piece
(embedding + layer 0 up to attention), N - 1 identical middle pieces (the rest of layer
i + layer i + 1 up to attention) and the last piece (the rest of layer N - 1 + the LM
head). Identical pieces are compiled once and the compiled code is shared: the pieces
differ only in which weights they are given. The attention pieces run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch._guards import detect_fake_mode
from torch.fx.node import map_arg
from torch.fx.passes.split_module import split_module

import engine.runners.torch.attention  # registers the op split on
from engine.runners.torch.fused_linear import dedupe_products

log = logging.getLogger(__name__)

# Serial generated kernels: a decode step's fused kernels are tiny (rows x hidden), so an
# OpenMP region costs more than it saves, and stalls when another process holds a core.
# The matmuls are aten calls and keep torch's threads. Measured on a tiny 30-layer model
# (overhead-bound): 1.73/1.51/1.31x over eager at 1/8/32 rows -> 1.78/1.55/1.38x.
_INDUCTOR_PATCHES = {"cpp.threads": 1}

SPLIT_OPS = (torch.ops.genserve.decode_attention.default,)
DIRECT_IMPLS: dict[Any, Callable[..., Any]] = {
    torch.ops.genserve.decode_attention.default:
        engine.runners.torch.attention.decode_attention_impl,
}


def _is_split_node(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in SPLIT_OPS


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', None) or target}"


def graph_signature(gm: torch.fx.GraphModule) -> str | None:
    """The graph's structure with node names replaced by positions: equal for pieces that
    compute the same thing from different inputs. None when the graph reads attributes
    (constants that may differ between pieces)."""
    index: dict[torch.fx.Node, int] = {}
    parts = []
    for i, node in enumerate(gm.graph.nodes):
        if node.op in ("get_attr", "call_module"):
            return None
        index[node] = i
        args = map_arg(node.args, lambda n: f"%{index[n]}")
        kwargs = map_arg(node.kwargs, lambda n: f"%{index[n]}")
        parts.append(f"{node.op} {_target_name(node.target)} {args!r} {kwargs!r}")
    return "\n".join(parts)


def _input_key(args: Sequence[Any]) -> tuple:
    key: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((str(tuple(a.shape)), str(tuple(a.stride())), a.dtype, a.device.type,
                        a.requires_grad))
        elif isinstance(a, torch.SymInt):
            key.append(("symint", str(a)))
        else:
            key.append((type(a).__name__, a))
    return tuple(key)


def _direct_call(piece: torch.fx.GraphModule) -> Callable[..., Any] | None:
    """A plain function computing ``piece`` when it is one split-op call (None otherwise):
    the eager op through the dispatcher costs ~100 us a call, the function a few."""
    nodes = list(piece.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    calls = [n for n in nodes if n.op not in ("placeholder", "output")]
    if len(calls) != 1 or not _is_split_node(calls[0]):
        return None
    call, output = calls[0], nodes[-1]
    impl = DIRECT_IMPLS[call.target]

    def direct(*inputs: Any) -> Any:
        env: dict[torch.fx.Node, Any] = dict(zip(placeholders, inputs, strict=True))
        env[call] = impl(*map_arg(call.args, env.__getitem__),
                         **map_arg(call.kwargs, env.__getitem__))
        return map_arg(output.args[0], env.__getitem__)

    return direct


class _CompilePieces(torch.fx.Interpreter):
    """Runs the split graph on the (fake) example inputs, compiling each non-attention
    piece with the inputs it sees, or reusing the code compiled for an identical one."""

    def __init__(self, module: torch.fx.GraphModule, to_compile: set[str], fake_mode: Any):
        super().__init__(module)
        self.to_compile = to_compile
        self.fake_mode = fake_mode
        self.compiled: dict[tuple, Callable[..., Any]] = {}
        self.shared = 0

    def run(self, *args: Any, **kwargs: Any) -> Any:
        from torch._dispatch.python import enable_python_dispatcher

        fake = [self.fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                for a in args]
        with self.fake_mode, enable_python_dispatcher():
            return super().run(*fake)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        out = super().call_module(target, args, kwargs)
        if target in self.to_compile:
            from torch._inductor.compile_fx import compile_fx

            piece = getattr(self.module, target)
            sig = graph_signature(piece)
            key = (sig, _input_key(args)) if sig is not None else None
            fn = self.compiled.get(key) if key is not None else None
            if fn is None:
                fn = cast(Callable[..., Any],
                          compile_fx(piece, list(args), config_patches=_INDUCTOR_PATCHES))
                if key is not None:
                    self.compiled[key] = fn
            else:
                self.shared += 1
            self.module.__dict__[target] = fn  # found before the submodule of that name
        return out


def piecewise_backend(gm: torch.fx.GraphModule,
                      example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """``torch.compile(backend=piecewise_backend)``: inductor for everything but the
    ``SPLIT_OPS`` calls, which stay eager, each in a piece of its own."""
    dedupe_products(gm)  # fused sibling projections: one product per input
    piece = 0
    pieces: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if _is_split_node(node):
            piece += 1
            pieces[node] = piece
            piece += 1
        else:
            pieces[node] = piece
    split = split_module(gm, gm, lambda n: pieces[n], keep_original_order=True)
    attention = {f"submod_{pieces[n]}" for n in pieces if _is_split_node(n)}
    to_compile = {name for name, _ in split.named_children() if name not in attention}
    fake_mode = detect_fake_mode(example_inputs) or detect_fake_mode()
    compiler = _CompilePieces(split, to_compile, fake_mode)
    compiler.run(*example_inputs)
    for name in attention:  # call the op's Python body directly: no dispatcher round trip
        direct = _direct_call(getattr(split, name))
        if direct is not None:
            split.__dict__[name] = direct
    log.debug("piecewise compile: %d pieces, %d compiled, %d shared", len(to_compile),
              len(compiler.compiled), compiler.shared)
    return split
