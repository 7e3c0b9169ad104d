"""One parse of a GGUF file's metadata for all the readers of one job.

gguf-py's ``GGUFReader`` builds a numpy view for every vocabulary string: 2.3-2.5 s for the
default model's 49,152 tokens (and its merges), more for a 128k vocabulary. transformers
parses the file again for each of ``AutoTokenizer``, ``AutoConfig`` and the model, so
converting a .gguf parsed it four times (with our own metadata read): 9.3 of a first
start's 22.5 s. Inside :func:`shared_parses` every ``gguf.GGUFReader(path)`` (transformers'
included: it looks the class up in the ``gguf`` module at each call) returns one reader per
file version, kept while the outermost block is open, so memory is held no longer than the
job that needed it. Readers are read-only views of the file (``mode="r"``): sharing one is
safe. So, within the block, are gguf-py's tensor-name maps: transformers builds one per
module of the model while mapping the weights (397 for the default model, ~3 s), where one
per architecture and depth is the same map.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

KEEP = 3  # readers kept at once (~160 MB each for a 49k vocabulary): a conversion
# needs one; tests alternate between a few files

_lock = threading.Lock()
_depth = 0
_original: Any = None  # gguf.GGUFReader while a block is open
_original_name_map: Any = None  # gguf.get_tensor_name_map while a block is open
_readers: OrderedDict[tuple[str, int, int], Any] = OrderedDict()
_name_maps: dict[tuple[Any, int], Any] = {}


def _key(path: Any) -> tuple[str, int, int]:
    st = os.stat(path)
    return os.path.realpath(path), st.st_size, st.st_mtime_ns


def _shared_reader(path: Any, mode: str = "r") -> Any:
    """Stands in for ``gguf.GGUFReader`` inside a block: a kept reader of the same file
    version, else a new one (kept)."""
    if mode != "r":
        return _original(path, mode)
    key = _key(path)
    with _lock:
        reader = _readers.get(key)
        if reader is not None:
            _readers.move_to_end(key)
            return reader
    reader = _original(path, mode)
    with _lock:
        _readers[key] = reader
        while len(_readers) > KEEP:
            _readers.popitem(last=False)
    return reader


def _shared_name_map(arch: Any, n_blocks: int) -> Any:
    """Stands in for ``gguf.get_tensor_name_map`` inside a block (its maps are only read)."""
    key = (arch, n_blocks)
    with _lock:
        name_map = _name_maps.get(key)
    if name_map is None:
        name_map = _original_name_map(arch, n_blocks)
        with _lock:
            _name_maps[key] = name_map
    return name_map


@contextmanager
def shared_parses() -> Iterator[None]:
    """Within this block (any thread, nested blocks too) each GGUF file version is parsed
    once and each tensor-name map built once; both are let go when the outermost block
    ends."""
    global _depth, _original, _original_name_map
    import gguf

    with _lock:
        if _depth == 0:
            # the module attributes transformers looks up at each load
            _original, _original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
            gguf.GGUFReader = _shared_reader  # type: ignore[misc, assignment]
            gguf.get_tensor_name_map = _shared_name_map
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gguf.GGUFReader = _original  # type: ignore[misc]
                gguf.get_tensor_name_map = _original_name_map
                _readers.clear()
                _name_maps.clear()
