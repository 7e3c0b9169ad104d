"""The torch runner: any Hugging Face causal LM through transformers, one packed forward
per step over a paged KV cache (CPU or CUDA). Its public face for the rest of genserve."""

from engine.runners.torch.model_runner import ModelRunner
from engine.runners.torch.packed_linear import (
    can_pack,
    pack_linears,
    stock_transformers,
    unpack_linears,
)

__all__ = ["ModelRunner", "can_pack", "pack_linears", "stock_transformers", "unpack_linears"]
