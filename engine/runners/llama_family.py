"""Which modules are transformers' own Llama, Mistral or Qwen2 code: the families whose
layers genserve's native paths compute in their place (the float32 prefill's elementwise
ops and cut last layer, the torch runner's native decode step).

Why by class name and defining module: those paths reproduce what transformers' own
forward computes for these families. A class of the same name from elsewhere (remote
code, a subclass in another package) may compute something else, so it keeps its forward.
"""

from __future__ import annotations

from torch import nn

# model_type -> the prefix of transformers' class names for it
FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


def is_family_module(mod: nn.Module, kind: str, family: str | None = None) -> bool:
    """Whether ``mod`` is transformers' own ``<Family><kind>`` (``kind``: "RMSNorm",
    "MLP", "Attention", "DecoderLayer") of ``family`` (a model_type), or of any of them."""
    cls = type(mod)
    for model_type, prefix in FAMILIES.items():
        if family is not None and model_type != family:
            continue
        if cls.__name__ == prefix + kind and cls.__module__.startswith(
                f"transformers.models.{model_type}."):
            return True
    return False
