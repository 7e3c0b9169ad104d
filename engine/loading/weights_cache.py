"""Converted-weights cache: a .gguf model converted once into a plain HF directory.

Loading a GGUF through transformers parses its metadata in pure Python (the tokenizer's
49k-token vocabulary and merges, three reads of the file) and renames and dequantises every
tensor: tens of seconds for the 135M default model on a busy CPU. The same model saved as
safetensors + config + tokenizer files loads in about a second (the tensors are mmapped).
So a .gguf is converted once, on first use or at ``make setup``, into an entry under
``$GENSERVE_CACHE_DIR`` (default ``~/.cache/genserve/converted``), and later loads read
the entry. The weights are saved as float32, the dtype GGUF tensors are dequantised to, so
the cached model equals the GGUF-loaded one exactly (for every load dtype: both cast
from the same float32 values).

Entries are written to a temporary directory in the cache root and renamed into place, so
a crash never leaves a half entry under an entry's name; an entry that is still found
broken (a file missing or truncated, an unreadable manifest or config) is logged, removed
and rebuilt. When the cache cannot be written, callers load the .gguf directly. A GGUF of
an architecture transformers' GGUF loader does not read (one only llama.cpp runs) has no
entry: said once at INFO, not warned about, since the llama.cpp runner needs no torch
weights and the torch runner's own load names the architecture it cannot read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from engine.loading.gguf_config import UnfaithfulGGUF, gguf_config
from engine.loading.gguf_reader import shared_parses

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "GENSERVE_CACHE_DIR"
MANIFEST = "genserve-cache.json"
FORMAT = 2  # bump when the entry layout or the conversion changes: old entries are ignored
TOKENIZER_SUFFIX = "-tokenizer"  # a tokenizer entry's name: its full entry's, then this
_SAMPLE_BYTES = 1 << 20
_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 3600.0  # a temporary directory this old is a crashed conversion's: removed

Converter = Callable[[Path, Path], None]  # (gguf file, empty output directory)
# transformers' GGUF loader refusing a file's architecture (modeling_gguf_pytorch_utils)
_UNREAD_ARCHITECTURE = re.compile(r"GGUF model with architecture (\S+) is not supported")


def cache_root() -> Path:
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "genserve" / "converted"


def source_key(gguf: Path) -> str:
    """The file's identity: size, mtime and a hash of its first and last MiB.

    Not a hash of the whole file: that would cost a second per GB on every start, for
    models that can be many GB. A GGUF's header (metadata and tensor table) is in its
    first MiB, any rewrite of the file changes its mtime, and size catches truncation;
    so a changed source gets a new key, and a touched but identical one only a needless
    (correct) rebuild. The conversion's own inputs (FORMAT, transformers' version) are in
    the key too: an upgrade that changes how GGUFs load converts again.
    """
    st = gguf.stat()
    h = hashlib.sha256(f"{FORMAT}|{_transformers_version()}|{st.st_size}|{st.st_mtime_ns}|"
                       .encode())
    with gguf.open("rb") as f:
        h.update(f.read(_SAMPLE_BYTES))
        if st.st_size > 2 * _SAMPLE_BYTES:
            f.seek(-_SAMPLE_BYTES, os.SEEK_END)
            h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def _transformers_version() -> str:
    try:
        return version("transformers")
    except PackageNotFoundError:
        return "?"


def check_entry(entry: Path, key: str, weights: bool = True) -> str | None:
    """Why ``entry`` cannot be used, or None when it is complete (a tokenizer entry,
    not ``weights``, has none).

    Cheap (no tensor data is read): the manifest, written last, names every file with its
    size; config.json must parse; each safetensors file's header must parse and its data
    reach exactly the end of the file, which catches truncation.
    """
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        if manifest.get("format") != FORMAT or manifest.get("key") != key:
            return "written for another source file or cache format"
        files: dict[str, int] = manifest["files"]
        for name, size in files.items():
            if (entry / name).stat().st_size != size:
                return f"{name} has the wrong size"
        json.loads((entry / "config.json").read_text())
        tensors = [name for name in files if name.endswith(".safetensors")]
        if weights and not tensors:
            return "no safetensors weights"
        for name in tensors:
            _check_safetensors(entry / name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _check_safetensors(path: Path) -> None:
    """Raise ValueError unless the header parses and its tensors end at the file's end."""
    size = path.stat().st_size
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= size - 8:
            raise ValueError(f"{path.name}: bad header length")
        header = json.loads(f.read(n))
    ends = [t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"]
    if 8 + n + max(ends, default=0) != size:
        raise ValueError(f"{path.name}: truncated or padded")


def discard(entry: Path) -> None:
    """Remove an entry: first renamed aside (atomic), so no reader sees a half-deleted one."""
    trash = entry.with_name(f"{_TMP_PREFIX}discard-{entry.name}-{os.getpid()}")
    try:
        entry.rename(trash)
    except FileNotFoundError:
        return
    except OSError as e:  # e.g. a read-only cache: the rebuild then falls back too
        log.warning("cannot remove weights cache entry %s: %s", entry, e)
        return
    shutil.rmtree(trash, ignore_errors=True)


def cached_model_dir(gguf: Path, convert: Converter | None = None,
                     build: bool = True) -> Path | None:
    """The HF directory converted from ``gguf``, converting it now when there is no
    usable entry (with ``build``: without, only an entry already there); None when the
    cache cannot be used (then load the .gguf directly)."""
    gguf = gguf.resolve()
    root = cache_root()
    try:
        key = source_key(gguf)
    except OSError as e:
        log.warning("cannot read %s for the weights cache (%s): loading it directly", gguf, e)
        return None
    entry = _entry_path(gguf, key)
    remembered = _remembered_unread(entry, key)
    if remembered is not None:
        log.info("%s: %s (remembered from an earlier start), so there is no converted copy "
                 "(the llama.cpp runner needs none)", gguf.name, remembered)
        return None
    found = _usable(entry, key)
    if found is not None or not build:
        return found
    try:
        return _build(gguf, key, entry, convert or convert_gguf)
    except Exception as e:  # the cache is an optimisation: never the reason a start fails
        unread = _UNREAD_ARCHITECTURE.search(str(e))
        if unread or isinstance(e, UnfaithfulGGUF):
            reason = (f"transformers cannot read GGUF architecture "
                      f"{unread.group(1).rstrip('.')}" if unread else str(e))
            log.info("%s: %s, so there is no converted copy to cache (the llama.cpp runner "
                     "needs none)", gguf.name, reason)
            _remember_unread(entry, key, reason)
            return None
        log.warning("could not cache the converted weights of %s in %s (%s): loading the "
                    ".gguf directly, which is slower", gguf.name, root, e)
        return None


def cached_tokenizer_dir(gguf: Path) -> Path | None:
    """An HF directory with ``gguf``'s tokenizer, config and generation config: its full
    entry when there is one, else a tokenizer entry (no weights, a few MB), converted now
    if missing; None when the cache cannot be used (then read them from the .gguf).

    Why: the llama.cpp runner needs no torch weights, only the HF tokenizer (and the EOS
    ids of the configs); converting a big model to float32 for them cost its whole size in
    memory and on disk, and parsing them from the .gguf at every start costs two reads of
    its vocabulary (seconds each for a large one)."""
    gguf = gguf.resolve()
    try:
        key = source_key(gguf)
    except OSError:
        return None
    full = _usable(_entry_path(gguf, key), key)
    if full is not None:
        return full
    entry = _entry_path(gguf, key, TOKENIZER_SUFFIX)
    if _remembered_unread(entry, key) is not None:
        return None
    found = _usable(entry, key, weights=False)
    if found is not None:
        return found
    try:
        return _build(gguf, key, entry, convert_tokenizer, weights=False)
    except Exception as e:  # an optimisation: the caller reads the .gguf instead
        log.info("%s: no tokenizer entry in the weights cache (%s): reading the .gguf",
                 gguf.name, e)
        if not isinstance(e, OSError):  # transformers cannot read it: not again
            _remember_unread(entry, key, str(e))
        return None


def _entry_path(gguf: Path, key: str, suffix: str = "") -> Path:
    return cache_root() / f"{gguf.stem}-{key[:20]}{suffix}"


def _usable(entry: Path, key: str, weights: bool = True) -> Path | None:
    """``entry`` when it exists and ``check_entry`` passes; one that fails is removed."""
    if not entry.exists():
        return None
    problem = check_entry(entry, key, weights)
    if problem is None:
        return entry
    log.warning("weights cache entry %s is unusable (%s): rebuilding it", entry, problem)
    discard(entry)
    return None


def _unread_marker(entry: Path) -> Path:
    return entry.with_name(entry.name + ".unreadable.json")


def _remembered_unread(entry: Path, key: str) -> str | None:
    """Why an earlier start found transformers cannot read this very file (its
    architecture, or ``UnfaithfulGGUF``), with this transformers version (a newer one may
    read it): each start otherwise paid a tokenizer parse to be refused again."""
    try:
        marker = json.loads(_unread_marker(entry).read_text())
    except (OSError, ValueError):
        return None
    if (not isinstance(marker, dict) or marker.get("key") != key
            or marker.get("transformers") != _transformers_version()):
        return None
    if "reason" in marker:
        return str(marker["reason"])
    return f"transformers cannot read GGUF architecture {marker.get('architecture', '?')}"


def _remember_unread(entry: Path, key: str, reason: str) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        _unread_marker(entry).write_text(json.dumps({
            "key": key, "transformers": _transformers_version(),
            "reason": reason}))
    except OSError:  # the cache is an optimisation: the next start just asks again
        pass


def _build(gguf: Path, key: str, entry: Path, convert: Converter,
           weights: bool = True) -> Path:
    root = entry.parent
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(root)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{entry.name}-", dir=root))
    try:
        log.info("converting %s to the weights cache %s ... (once: later starts load the "
                 "converted copy)", gguf.name, entry)
        start = time.perf_counter()
        convert(gguf, tmp)
        files = {str(p.relative_to(tmp)): p.stat().st_size
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        _make_readable(tmp)
        manifest = {"format": FORMAT, "key": key, "source": str(gguf),
                    "source_size": gguf.stat().st_size, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        problem = check_entry(tmp, key, weights)
        if problem:
            raise ValueError(f"the conversion wrote an unusable entry: {problem}")
        try:
            tmp.rename(entry)
        except OSError:
            if check_entry(entry, key, weights) is None:  # another process finished first
                return entry
            raise
        log.info("converted %s: done in %.1f s", gguf.name, time.perf_counter() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a successful rename
    _remove_older_versions(gguf, key, entry)
    return entry


def _make_readable(tree: Path) -> None:
    """mkdtemp makes 0700 and some writers 0600: an entry is plain data, readable by all
    (a cache filled at build time by root, read by the service's own user)."""
    tree.chmod(0o755)
    for p in tree.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)


def _remove_stale_tmp(root: Path) -> None:
    now = time.time()
    for p in root.glob(f"{_TMP_PREFIX}*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _remove_older_versions(gguf: Path, key: str, keep: Path) -> None:
    """Entries of earlier versions of the same source file (another key; not this
    version's other entry, full or tokenizer) are dead weight: remove them."""
    for other in keep.parent.glob(f"{gguf.stem}-*"):
        if other == keep:
            continue
        try:
            manifest = json.loads((other / MANIFEST).read_text())
            source, other_key = manifest.get("source"), manifest.get("key")
        except (OSError, ValueError, AttributeError):
            continue
        if source == str(gguf) and other_key != key:
            log.info("removing %s (an earlier version of %s)", other, gguf.name)
            discard(other)


def convert_tokenizer(gguf: Path, out: Path) -> None:
    """The tokenizer entry's converter: the tokenizer, config and generation config
    transformers reads from ``gguf``, no weights."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with shared_parses():  # transformers parses the file for each of the two
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)


def convert_gguf(gguf: Path, out: Path) -> None:
    """The default converter: :func:`load_gguf`, then :func:`save_converted` into ``out``."""
    save_converted(*load_gguf(gguf), out)


def load_gguf(gguf: Path) -> tuple[Any, Any]:
    """(tokenizer, model) loaded from ``gguf`` by transformers, dequantised to float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with shared_parses():  # one parse for the tokenizer, the config and the weights
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     config=gguf_config(gguf),
                                                     dtype=torch.float32)
    return tokenizer, model


def save_converted(tokenizer: Any, model: Any, out: Path) -> None:
    """Save a GGUF-loaded model as an HF directory: safetensors weights, config,
    generation config and tokenizer files."""
    import torch

    # transformers marks any GGUF-loaded model "quantized, not serializable", even when it
    # dequantised every tensor (as it does for llama here). Plain float32 weights are what
    # the GGUF load gives us, so drop the marker; weights still packed in GGUF blocks (a
    # newer transformers with ``kernels``) cannot be saved like this: fail, load directly.
    packed = {p.dtype for p in model.state_dict().values()} - {torch.float32}
    if packed:
        raise ValueError(f"weights kept packed as {sorted(map(str, packed))}: not cacheable")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out)  # safetensors; generation_config.json too
    tokenizer.save_pretrained(out)
