"""Runs each step on llama.cpp: one ``llama_decode`` over every token the step schedules.

Why: on a CPU llama.cpp runs a GGUF's quantised weights with SIMD kernels, several times
faster than fp32 torch can be there. Everything above the runner (scheduler, sampler,
processors, grammars, speculation) is unchanged: this runner keeps ``ModelRunner``'s
contract, ``execute(decodes, prefills) -> logits rows``.

How the engine maps onto llama.cpp (low-level API of ``llama-cpp-python``):

- One context with ``n_seq_max = max_num_seqs`` sequences and one unified KV cache of
  ``num_blocks * block_size`` cells. The scheduler keeps accounting in blocks: a sequence
  holds ``ceil(tokens / block_size)`` blocks, so the cells llama.cpp uses never exceed the
  blocks handed out (llama.cpp places a token in any free cell, no contiguity needed).
  Under ``--kv-streams`` / ``--batch-invariant`` one KV stream per sequence instead
  (``llamacpp_streams.py``):
  as many sequences as streams of a whole sequence fit the budget, no prefix caching.
- An engine sequence gets a llama.cpp sequence id on its first chunk and gives it back
  when the scheduler frees its blocks (finish, abort, preemption): ``release`` removes its
  cells with ``llama_memory_seq_rm``.
- llama.cpp needs each sequence's positions consecutive after what it caches, so a row
  below that (rejected speculative tokens) first trims the sequence's cells from there.
- Batch expansion's ``k + 1`` rows of one sequence are consecutive positions of one
  sequence id in the batch: llama.cpp masks them causally, exactly the multi-token query.
- Logits are asked for only on the rows the contract returns; they are read through
  tensors over llama.cpp's output buffer, made once per buffer (``LogitsViews``).
- Prefix caching: the cells of the scheduler's cached blocks live on in keeper sequence
  ids beyond the running ones (engine/runners/llamacpp_prefix.py); a sequence that starts
  from cached blocks gets their cells with ``llama_memory_seq_cp`` before its first chunk.
- LoRA adapters apply per context, not per sequence: a step holds the rows of one adapter
  slot (``supports_mixed_adapters = False``; the scheduler groups steps), whose adapter is
  set on the context before its decode (``engine/runners/llamacpp_lora.py``).
"""

from __future__ import annotations

import ctypes
import heapq
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.adapters import AdapterError, LoraAdapter
from engine.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from engine.kv_cache import BlockKeeper
from engine.loading.model_loader import (
    ModelSource,
    hf_source,
    load_tokenizer,
    resolve_model,
    use_chat_template,
)
from engine.loading.rope_scaling import llama_cpp_overrides
from engine.runners import llamacpp_handoff
from engine.runners.base import (
    DEFAULT_MAX_MODEL_LEN,
    DecodeRow,
    PrefillWork,
    WarmupReport,
    config_eos_ids,
)
from engine.runners.llamacpp_host_blocks import (
    HostBlocks,
    StateFormatError,
    available_memory,
    check_budget,
    get_state,
    parse_state,
    write_state,
)
from engine.runners.llamacpp_lora import AdapterSlots, BaseModel
from engine.runners.llamacpp_prefix import CellKeeper
from engine.runners.llamacpp_stream_cache import StreamKeeper
from engine.runners.llamacpp_streams import choose_layout
from engine.runners.requantize import cpu_has_bf16_gemm, requantize, target_format

log = logging.getLogger(__name__)

KV_BYTES_PER_ELEMENT = 2  # llama.cpp's default f16 K and V cache
LLAMA_MAX_SEQ = 256  # llama.cpp's bound on sequences in one context (src/llama-cparams.h)
# Batch invariance (``--batch-invariant``): a sequence's logits should not depend on how
# its prompt was chunked. llama.cpp's CPU attention without flash attention sums over KV
# cells with SIMD lanes, so its result depends on which cells a sequence landed in; flash
# attention's per-query kernel walks a sequence's cells in order and does not, but from 64
# queries in one ubatch llama.cpp switches to a tiled kernel whose logits differ (by up to
# 0.56 on the default model). Hence flash attention always, and ubatches of at most 63
# tokens in the invariant mode; 512 otherwise (prefill ~1.3-2x faster, measured in
# docs/llamacpp-runner.md; decode steps of up to 63 rows are the same either way).
FLASH_ATTN = 1  # llama_context_params.flash_attn_type: -1 auto, 0 off, 1 on
INVARIANT_UBATCH = 63
# ... and a bf16 V cache in that mode: a ubatch of one query over 512+ cells with an f16 K
# and V of the same type takes the split-KV decode kernel (cells split among threads),
# whose rounding differs from the same row's beside other rows (by up to 0.5 with 2
# threads); a V type unlike K's keeps every row on the per-query kernel. ggml's type id.
INVARIANT_TYPE_V = 30  # GGML_TYPE_BF16
# --kv-streams / --batch-invariant run one KV stream per sequence (llamacpp_streams.py);
# False runs those streams' worth of cells as one unified cache instead (what the tests
# compare with)
KV_STREAMS = True
UBATCH = 512
_VOCAB_CHECK_TEXT = ("Hello, world! The quick brown fox jumps over 13 lazy dogs.\n"
                     "def f(x):\n    return x ** 2  # héllo — 日本語 ✓\n\t{\"a\": [1, 2.5]}")
_backend_ready = False
# ggml.h's enum ggml_log_level (NONE, DEBUG, INFO, WARN, ERROR, CONT) in the llama.cpp
# this package builds; llama-cpp-python's _logger still documents an older order.
GGML_LOG_LEVEL_ERROR = 4


def default_threads() -> int:
    """The cores this process may run on (cgroup/affinity aware, unlike os.cpu_count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def llama_lib():
    """The ``llama_cpp`` module, its backend initialised once and its logging quietened to
    errors (llama.cpp prints every load step otherwise)."""
    global _backend_ready
    import llama_cpp

    if not _backend_ready:
        if not log.isEnabledFor(logging.DEBUG):
            logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        llama_cpp.llama_backend_init()
        _backend_ready = True
    return llama_cpp


# llama.cpp keeps one process-wide log callback and calls it from whichever thread logs
# (the engine thread's llama_decode included). It is installed once and never replaced:
# swapping in a callback per load and back freed the load's callback while the engine
# thread could still be calling it (a segfault under adapter churn). Each thread inside
# ``llama_errors`` collects only its own error lines.
_error_lines = threading.local()
_log_callback: Any = None


def _install_log_callback(llama_cpp) -> None:
    global _log_callback
    if _log_callback is not None:
        return
    from llama_cpp import _logger

    @llama_cpp.llama_log_callback
    def forward(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines = getattr(_error_lines, "lines", None)
        if lines is not None and level == GGML_LOG_LEVEL_ERROR:
            line = text.decode(errors="replace").strip()
            if line:
                lines.append(line)
        _logger.llama_log_callback(level, text, user_data)

    _log_callback = forward
    llama_cpp.llama_log_set(forward, ctypes.c_void_p(0))


@contextmanager
def llama_errors(llama_cpp) -> Iterator[list[str]]:
    """Collect llama.cpp's error log lines this thread causes while the block runs (why a
    load failed: e.g. "unknown model architecture: 'x'"), still printed as
    llama-cpp-python prints them."""
    _install_log_callback(llama_cpp)
    lines: list[str] = []
    outer = getattr(_error_lines, "lines", None)
    _error_lines.lines = lines
    try:
        yield lines
    finally:
        _error_lines.lines = outer


def gguf_architecture(path: str) -> str | None:
    """A GGUF's ``general.architecture``, None when it cannot be read (the gguf package
    reads the file's metadata: used only to explain a failed load)."""
    try:
        import gguf

        field = gguf.GGUFReader(path).fields["general.architecture"]
        return str(field.contents())
    except Exception:  # a file too broken to read: the caller's message says so
        return None


@dataclass
class BatchArrays:
    """A ``llama_batch``'s arrays owned by numpy, so a step fills them with slice writes
    instead of per-token ctypes stores (``llama_batch_init`` mallocs one seq-id array per
    token, which only per-token stores can fill). Each token belongs to one sequence."""

    token: np.ndarray
    pos: np.ndarray
    n_seq_id: np.ndarray
    seq_id: np.ndarray
    seq_ptr: np.ndarray  # address of seq_id[i], what llama_batch.seq_id[i] points to
    logits: np.ndarray
    first: Any = None  # the llama_batch from token 0, once built

    @classmethod
    def allocate(cls, capacity: int) -> BatchArrays:
        seq_id = np.zeros(capacity, dtype=np.int32)
        base = seq_id.ctypes.data
        return cls(np.zeros(capacity, dtype=np.int32), np.zeros(capacity, dtype=np.int32),
                   np.ones(capacity, dtype=np.int32), seq_id,
                   base + 4 * np.arange(capacity, dtype=np.uint64), np.zeros(capacity, np.int8))

    @property
    def capacity(self) -> int:
        return len(self.token)

    def batch(self, llama_cpp, start: int, n: int):
        """The ``llama_batch`` of tokens ``[start, start + n)`` (the one from 0, every
        step's, built once: five ctypes casts cost ~0.1 ms, a share of a batch-1 step)."""
        if start == 0 and self.first is not None:
            self.first.n_tokens = n
            return self.first

        def ptr(a: np.ndarray, ctype):
            return ctypes.cast(a.ctypes.data + start * a.itemsize, ctypes.POINTER(ctype))

        b = llama_cpp.llama_batch()
        b.n_tokens = n
        b.token = ptr(self.token, llama_cpp.llama_token)
        b.embd = None
        b.pos = ptr(self.pos, llama_cpp.llama_pos)
        b.n_seq_id = ptr(self.n_seq_id, ctypes.c_int32)
        b.seq_id = ptr(self.seq_ptr, ctypes.POINTER(llama_cpp.llama_seq_id))
        b.logits = ptr(self.logits, ctypes.c_int8)
        if start == 0:
            self.first = b
        return b


class LogitsViews:
    """Tensors over llama.cpp's logits buffer, made once per buffer address and row count.
    Why: right after a decode has streamed the weights through the caches, the
    ``np.ctypeslib.as_array`` + ``torch.from_numpy`` of each step ran cold, ~0.15 ms of a
    batch-1 step; a cached view costs one ctypes call and a dict lookup."""

    def __init__(self, llama_cpp, vocab_size: int) -> None:
        # llama_get_logits itself, returning the address as an int
        function = ctypes.cast(llama_cpp.llama_get_logits, ctypes.c_void_p).value
        assert function is not None
        self._address = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(function)
        self.vocab_size = vocab_size
        self._at: int | None = None
        self._views: dict[int, torch.Tensor] = {}

    def rows(self, ctx, k: int) -> torch.Tensor:
        """The ``[k, vocab]`` logits of the last decode (valid until the next one)."""
        address = self._address(ctx)
        if not address:
            raise RuntimeError("llama.cpp returned no logits buffer")
        if address != self._at:  # llama.cpp reallocated its output buffer
            self._at, self._views = address, {}
        view = self._views.get(k)
        if view is None:
            buf = (ctypes.c_float * (k * self.vocab_size)).from_address(address)
            view = torch.frombuffer(buf, dtype=torch.float32).view(k, self.vocab_size)
            self._views[k] = view
        return view


class LlamaCppRunner:
    name = "llamacpp"
    # Cached blocks' cells are kept in keeper sequence ids and shared with seq_cp
    # (block_keeper); False on an instance with no sequence id left for keepers.
    supports_prefix_caching = True
    # llama.cpp sets adapters on the context, for every row of a decode: one per step
    supports_mixed_adapters = False
    prefers_gguf_adapters = True  # goes to llama_adapter_lora_init as it is
    failure: str | None = None  # one process: nothing else can fail under it

    def __init__(self, config: EngineConfig) -> None:
        llama_cpp = llama_lib()
        self.llama_cpp = llama_cpp
        self.config = config
        source = resolve_model(config.model, config.revision)
        if source.gguf_file is None:
            raise ValueError(f"the llama.cpp runner needs a .gguf model; {config.model!r} "
                             "is an HF directory")
        path = os.path.join(source.directory, source.gguf_file)
        if config.dtype not in ("auto", "float32", "fp32"):
            log.warning("--dtype %s is ignored by the llama.cpp runner: it runs the GGUF's "
                        "own quantised weights", config.dtype)
        self.device = torch.device("cpu")
        self.dtype = torch.float32  # of the logits it returns
        self.model_id = source.model_id
        self.block_size = config.block_size
        self.max_rows_per_seq = 1  # set by the engine (speculation); steps past n_batch split
        self.threads = config.threads or default_threads()
        if torch.get_num_threads() > 1:
            # torch only samples here, and its OpenMP workers spin after each parallel op,
            # stealing the cores llama.cpp computes on (a batch-1 step on this 2-core
            # machine: 41 ms with torch's 2 threads, 21 ms with 1).
            log.info("llama.cpp runner: torch limited to 1 thread (it only samples)")
            torch.set_num_threads(1)

        start = time.perf_counter()
        self._overrides: dict[str, int] = {}
        self.model = self._load(path)
        model_max = llama_cpp.llama_model_n_ctx_train(self.model) or DEFAULT_MAX_MODEL_LEN
        self.max_model_len = min(model_max, config.max_model_len or DEFAULT_MAX_MODEL_LEN)
        if config.max_model_len and config.max_model_len > model_max:
            log.warning("max_model_len %d exceeds the model's %d; using %d",
                        config.max_model_len, model_max, model_max)
        arch = self._meta("general.architecture")
        # LongRoPE: llama.cpp would pick its factors from the context size; it takes ours
        self._overrides, rope_note = llama_cpp_overrides(str(arch), self._meta, model_max,
                                                         self.max_model_len)
        if self._overrides:
            llama_cpp.llama_model_free(self.model)
            self.model = self._load(path)
        if rope_note:
            log.log(rope_note[0], "llama.cpp runner: %s", rope_note[1])
        self.quantization = self._ftype()
        self.requantized_from: str | None = None
        target = target_format(config.requantize, self.quantization)
        if target == "BF16" and not cpu_has_bf16_gemm(llama_cpp):
            log.warning("--requantize BF16: this CPU (or llama.cpp build) has no AVX512-BF16;"
                        " BF16 weights are widened to f32 and run slower than Q8_0")
        if target is not None:
            try:
                path = str(requantize(llama_cpp, Path(path), target, self.threads))
            except (OSError, RuntimeError) as e:  # an optimisation: run the file as it is
                log.warning("could not requantise %s to %s (%s): running it as %s", path,
                            target, e, self.quantization)
            else:
                llama_cpp.llama_model_free(self.model)
                self.model = self._load(path)
                self.requantized_from, self.quantization = self.quantization, self._ftype()
        self.path = path
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(self.vocab)
        n_layer = llama_cpp.llama_model_n_layer(self.model)
        n_head_kv = llama_cpp.llama_model_n_head_kv(self.model)
        head_dim = llama_cpp.llama_model_n_embd(self.model) // llama_cpp.llama_model_n_head(
            self.model)
        k_dim = int(self._meta(f"{arch}.attention.key_length") or head_dim)
        v_dim = int(self._meta(f"{arch}.attention.value_length") or head_dim)

        bytes_per_cell = n_layer * n_head_kv * (k_dim + v_dim) * KV_BYTES_PER_ELEMENT
        bytes_per_block = bytes_per_cell * config.block_size
        if config.max_num_seqs > LLAMA_MAX_SEQ:
            raise ValueError(f"the llama.cpp runner holds at most {LLAMA_MAX_SEQ} "
                             f"sequences; --max-num-seqs is {config.max_num_seqs}")
        # One KV stream per sequence (--kv-streams, --batch-invariant, and auto where they
        # fit: llamacpp_streams.py) or one unified cache; the engine runs at most as many
        # sequences as there are streams.
        layout = choose_layout(config, self.max_model_len, bytes_per_cell,
                               available_memory(),
                               sliding_window=llama_cpp.llama_model_n_swa(self.model) > 0)
        self.streams = layout.streams
        self.max_num_seqs = self.streams.count if self.streams else config.max_num_seqs
        if self.streams:
            self.num_blocks = self.streams.n_ctx // config.block_size
        else:
            self.num_blocks = layout.budget // bytes_per_block
        if self.num_blocks < 2:
            raise ValueError(f"kv_cache_memory={layout.budget} bytes holds fewer "
                             f"than 2 blocks ({bytes_per_block} bytes each)")
        self.n_batch = config.step_token_budget() + config.max_num_seqs
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = self.streams.n_ctx if self.streams else \
            self.num_blocks * config.block_size
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = min(self.n_batch, INVARIANT_UBATCH if config.batch_invariant
                               else UBATCH)
        # Prefix caching: the sequence ids past the running ones keep cached cells.
        # llama.cpp reserves an output row per sequence id within min(n_ctx, n_batch)
        # (it aborts otherwise), so that bounds the ids too. With a stream per sequence,
        # cached KV goes by value through host memory instead (llamacpp_stream_cache.py):
        # seq_cp shares cells within one stream only.
        n_seq_max = min(LLAMA_MAX_SEQ, cparams.n_ctx, cparams.n_batch)
        host_memory = config.prefix_cache_host_memory
        if host_memory is None:  # as much as the KV budget given, else 1 GiB
            host_memory = config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
        if self.streams is None:
            caching = config.enable_prefix_caching and n_seq_max > config.max_num_seqs
        else:
            caching = config.enable_prefix_caching and host_memory >= bytes_per_block
        cparams.n_seq_max = n_seq_max if caching and not self.streams else \
            self.max_num_seqs
        cparams.kv_unified = self.streams is None or not KV_STREAMS
        if config.batch_invariant:
            cparams.type_v = INVARIANT_TYPE_V
        cparams.n_threads = cparams.n_threads_batch = self.threads
        cparams.no_perf = True
        cparams.flash_attn_type = FLASH_ATTN
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise ValueError(f"llama.cpp could not create a context for {path} "
                             f"({cparams.n_ctx} cells, {self.max_num_seqs} sequences)")
        self.n_batch = llama_cpp.llama_n_batch(self.ctx)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.arrays = BatchArrays.allocate(self.n_batch)
        self._logits = LogitsViews(llama_cpp, self.vocab_size)
        self._slot_of: dict[int, int] = {}  # engine seq id -> llama.cpp seq id
        # lowest first: with a stream per sequence, llama.cpp puts only sequences of
        # consecutive ids in one ubatch, so the running ones should sit together
        self._free_slots = list(range(self.max_num_seqs))
        self._cached = [0] * self.max_num_seqs  # positions each llama.cpp seq caches
        self.handoff: llamacpp_handoff.TorchPrefill | None = None
        self._kept: CellKeeper | StreamKeeper | None = None
        if caching and self.streams is None:
            self._kept = self._cell_keeper(config, n_seq_max, bytes_per_block, host_memory)
        elif caching:
            self._kept = self._stream_keeper(host_memory // bytes_per_block, bytes_per_block)
        self.supports_prefix_caching = self._kept is not None
        self.block_keeper: BlockKeeper | None = self._kept
        if self.streams:
            log.info("llama.cpp runner: one KV stream per sequence (%s), %d streams of "
                     "%d cells (%.0f MiB each: K f16, V %s)%s%s", layout.why,
                     self.streams.count, self.streams.cells,
                     self.streams.cells * bytes_per_cell / 2**20,
                     "bf16" if config.batch_invariant else "f16",
                     f"; --max-num-seqs {config.max_num_seqs} lowered to {self.max_num_seqs}"
                     f" (what the KV budget holds)"
                     if self.max_num_seqs < config.max_num_seqs else "",
                     "" if KV_STREAMS else " (KV_STREAMS off: in one unified cache)")
            if isinstance(self._kept, StreamKeeper):
                log.info("llama.cpp runner: prefix caching through host memory (a finished "
                         "sequence's cached blocks are copied out of its stream, a hit "
                         "written into the new sequence's), up to %d blocks (%.0f MiB, "
                         "--prefix-cache-host-memory)", self._kept.max_idle_blocks,
                         self._kept.max_idle_blocks * bytes_per_block / 2**20)
            elif config.enable_prefix_caching and not caching:
                log.info("llama.cpp runner: prefix caching off under %s: with a KV stream "
                         "per sequence cached blocks live in host memory, and "
                         "--prefix-cache-host-memory holds none", layout.why)
        elif isinstance(self._kept, CellKeeper):
            host = self._kept.host
            log.info("llama.cpp runner: prefix caching keeps cached cells in %d spare "
                     "sequence ids; %s", len(self._kept.keepers),
                     f"idle cached blocks in host memory, up to {self._kept.max_idle_blocks}"
                     f" blocks ({self._kept.max_idle_blocks * bytes_per_block / 2**20:.0f} "
                     "MiB, --prefix-cache-host-memory)" if host is not None else
                     "idle cached blocks stay in llama.cpp's cells (at most "
                     f"{self._kept.max_idle_blocks * config.block_size} cells, fewer under "
                     "load; --prefix-cache-host-memory 0)")
        elif config.enable_prefix_caching:
            log.info("llama.cpp runner: prefix caching needs a sequence id beyond the %d "
                     "running ones; this context allows %d (min of 256, n_ctx, n_batch)",
                     config.max_num_seqs, n_seq_max)

        self._row_cost: float | None = None  # timed on first use (row_cost)
        self.max_loras = config.max_loras if config.adapter_cache else 0
        self.adapters = AdapterSlots(llama_cpp, self.model, self.ctx, BaseModel(
            str(arch), n_layer, llama_cpp.llama_model_n_head(self.model), n_head_kv,
            llama_cpp.llama_model_rope_type(self.model) == llama_cpp.LLAMA_ROPE_TYPE_NORM),
            self.path)
        # Long prompts prefilled by torch, their KV handed over (llamacpp_handoff.py)
        self.handoff = llamacpp_handoff.start(self, source, config.torch_prefill_tokens)
        # The HF tokenizer and configs from the weights-cache entry the torch prefill
        # needs; without the torch prefill, from an entry of them alone (converting a big
        # model to float32 for its tokenizer would cost minutes and its size in memory)
        converted = self.handoff is not None
        self.tokenizer = self._load_tokenizer(source, path, arch, converted)
        if config.chat_template:
            use_chat_template(self.tokenizer, config.chat_template)
        self._config_eos = _config_eos_ids(source, converted)
        desc = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(self.model, desc, len(desc))
        log.info("llama.cpp runner: %s (%s, %s%s) loaded in %.1fs; %d threads; ubatch %d%s; "
                 "KV cache %d cells (%d blocks of %d, %.0f MiB f16) for %d sequences%s",
                 self.model_id, desc.value.decode(), self.quantization,
                 f", requantised from {self.requantized_from}" if self.requantized_from
                 else "", time.perf_counter() - start, self.threads, cparams.n_ubatch,
                 " (batch invariant)" if config.batch_invariant
                 else " (not batch invariant: near-ties may vary with batch mates; "
                      "--batch-invariant)", cparams.n_ctx,
                 self.num_blocks, config.block_size,
                 self.num_blocks * bytes_per_block / 2**20, self.max_num_seqs,
                 "" if self.streams else f", one unified cache ({layout.why}; each row "
                 "attends over every sequence's cells; --kv-streams: a stream each, for "
                 "many at once)")

    def _cell_keeper(self, config: EngineConfig, n_seq_max: int,
                     bytes_per_block: int, host_memory: int) -> CellKeeper:
        """Keepers in the sequence ids past the running ones; with host memory for idle
        blocks, the last id is the host tier's scratch."""
        host_blocks = host_memory // bytes_per_block
        ids = range(config.max_num_seqs, n_seq_max)
        host = None
        if host_blocks > 0 and len(ids) > 1:
            check_budget(host_blocks * bytes_per_block, available_memory())
            host = HostBlocks(self.llama_cpp, self.ctx, self.memory, config.block_size,
                              scratch=ids[-1], capacity=host_blocks,
                              cell_bytes=bytes_per_block // config.block_size)
            ids = ids[:-1]
        return CellKeeper(
            self.llama_cpp, self.memory, config.block_size, ids, self._slot_of.get,
            pending=lambda seq_id: self.handoff is not None and seq_id in self.handoff,
            host=host, host_blocks=host_blocks)

    def _stream_keeper(self, host_blocks: int, bytes_per_block: int) -> StreamKeeper | None:
        """Prefix caching through host memory, with a stream per sequence; None (logged)
        where llama.cpp's sequence state is not laid out as ``HostBlocks`` reads it (a
        second cache, as sliding-window models have): checked now on one token, since a
        block that could not be copied out when its sequence ends would be lost."""
        check_budget(host_blocks * bytes_per_block, available_memory())
        lc = self.llama_cpp
        try:
            a = self.arrays
            a.token[0], a.pos[0], a.seq_id[0], a.logits[0] = 0, 0, 0, 1
            if lc.llama_decode(self.ctx, a.batch(lc, 0, 1)) != 0:
                raise StateFormatError("llama_decode failed on one token")
            parse_state(get_state(lc, self.ctx, 0))
        except StateFormatError as e:
            log.warning("llama.cpp runner: prefix caching off: with a KV stream per "
                        "sequence it copies cached KV through host memory, and this "
                        "model's sequence state is not laid out as expected (%s)", e)
            return None
        finally:
            lc.llama_memory_seq_rm(self.memory, 0, -1, -1)
        host = HostBlocks(lc, self.ctx, self.memory, self.block_size, scratch=-1,
                          capacity=host_blocks, cell_bytes=bytes_per_block // self.block_size)
        return StreamKeeper(host, self._slot_of.get, host_blocks,
                            pending=lambda seq_id: self.handoff is not None
                            and seq_id in self.handoff)

    def close(self) -> None:
        """Nothing to stop: the context and model are freed with the runner."""

    def __del__(self) -> None:
        llama_cpp = getattr(self, "llama_cpp", None)
        if llama_cpp is None:
            return
        if getattr(self, "ctx", None):
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "adapters", None) is not None:
            self.adapters.free()
        if getattr(self, "model", None):
            llama_cpp.llama_model_free(self.model)
            self.model = None

    def _load(self, path: str) -> Any:
        mparams = self.llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = 0
        overrides = self._kv_overrides()
        if overrides is not None:
            mparams.kv_overrides = overrides
        with llama_errors(self.llama_cpp) as errors:
            model = self.llama_cpp.llama_model_load_from_file(path.encode(), mparams)
        if not model:
            reason = "; ".join(errors) or "no reason given"
            raise ValueError(f"llama.cpp could not load {path} (general.architecture "
                             f"{gguf_architecture(path)!r}): {reason}")
        return model

    def _kv_overrides(self) -> Any:
        """``self._overrides`` as llama.cpp's array of integer metadata overrides (ended by
        an empty key), None when there are none. Kept on the runner: llama.cpp reads it
        while loading."""
        if not self._overrides:
            return None
        lc = self.llama_cpp
        array = (lc.llama_model_kv_override * (len(self._overrides) + 1))()
        for item, (key, value) in zip(array, self._overrides.items(), strict=False):
            item.key = key.encode()
            item.tag = lc.LLAMA_KV_OVERRIDE_TYPE_INT
            item.value.val_i64 = value
        array[-1].key = b""
        self._override_array = array
        return array

    def _ftype(self) -> str:
        lc = self.llama_cpp
        return (lc.llama_ftype_name(lc.llama_model_ftype(self.model)) or b"?").decode()

    @property
    def row_cost(self) -> float:
        """``Runner.row_cost``, timed on first use: by the speculator, on the engine's
        thread. (Timed in ``__init__``, on the thread that builds the engine, it left a
        server's later steps ~30% slower, measured; the likely cause, not proven: OpenMP
        then keeps a worker team for each of the two threads that called llama.cpp.)"""
        if self._row_cost is None:
            self._row_cost = self._measure_row_cost()
            log.info("llama.cpp runner: an extra row of a sequence costs %.2f of a one-row "
                     "step", self._row_cost)
        return self._row_cost

    def _measure_row_cost(self, rows: int = 5, reps: int = 3) -> float:
        """What one more row of a sequence adds to a decode step, as a share of a one-row
        step, timed in a small context of its own (~0.1 s): it depends on the CPU and the
        quantisation. On this 2-core AVX2 machine the default Q4_1 model
        measured ~0.6 (9 rows ~6x one row): its matmuls are compute bound at batch 1."""
        lc = self.llama_cpp
        cparams = lc.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = 256, 64, 64, 1
        cparams.n_threads = cparams.n_threads_batch = self.threads
        cparams.no_perf = True
        cparams.flash_attn_type = FLASH_ATTN
        ctx = lc.llama_init_from_model(self.model, cparams)
        if not ctx:
            return 0.0
        memory = lc.llama_get_memory(ctx)
        arrays = BatchArrays.allocate(64)

        def decode(start: int, n: int) -> float:
            arrays.token[:n] = np.arange(100 + start, 100 + start + n)
            arrays.pos[:n] = np.arange(start, start + n)
            arrays.seq_id[:n] = 0
            arrays.logits[:n] = 1
            t0 = time.perf_counter()
            if lc.llama_decode(ctx, arrays.batch(lc, 0, n)) != 0:
                raise RuntimeError("llama_decode failed while timing a verify row")
            return time.perf_counter() - t0

        try:
            context = 64
            decode(0, context)
            ratios = []
            for _ in range(reps):
                one = decode(context, 1)
                lc.llama_memory_seq_rm(memory, 0, context, -1)
                more = decode(context, rows)
                lc.llama_memory_seq_rm(memory, 0, context, -1)
                ratios.append((more / one - 1) / (rows - 1))
        finally:
            lc.llama_free(ctx)
        return min(2.0, max(0.0, sorted(ratios)[reps // 2]))

    # ---- model facts ----------------------------------------------------------------

    def _meta(self, key: str) -> str | None:
        """A GGUF metadata value as text, None when the file has no such key."""
        buf = ctypes.create_string_buffer(256)
        n = self.llama_cpp.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    def _load_tokenizer(self, source: ModelSource, path: str, arch: str | None,
                        convert: bool = True) -> Any:
        """The HF tokenizer the engine tokenises with; its ids must be llama.cpp's.

        First the torch runner's (transformers' GGUF loader, through the weights cache).
        That loader reads only some architectures' files and gives a file the tokenizer
        class of its architecture (a qwen2 file gets Qwen2's pre-tokenizer whatever its
        ``tokenizer.ggml.pre`` says); so when it fails or disagrees with llama.cpp,
        transformers' generic GGUF tokenizer, built from the file's ``tokenizer.ggml.*``
        fields whatever the architecture. Neither agreeing is an error at start."""
        from transformers import PreTrainedTokenizerFast

        def generic() -> Any:
            return PreTrainedTokenizerFast.from_pretrained(source.directory,
                                                           gguf_file=source.gguf_file)

        problems = []
        def loader() -> Any:
            return load_tokenizer(source, self.config.trust_remote_code, convert=convert)

        for what, load in (("transformers' GGUF loader", loader),
                           ("the file's tokenizer fields", generic)):
            try:
                tokenizer = load()
            except (ValueError, KeyError, OSError) as e:
                problems.append(f"{what}: {e}")
                continue
            problem = self._vocab_problem(tokenizer)
            if problem is None:
                if problems:
                    log.info("llama.cpp runner: tokenizer built from %s (%s)", what,
                             problems[0])
                return tokenizer
            problems.append(f"{what}: {problem}")
        raise ValueError(f"{path}: no HF tokenizer agrees with llama.cpp's vocabulary of "
                         f"this GGUF (architecture {arch!r}, tokenizer.ggml.model "
                         f"{self._meta('tokenizer.ggml.model')!r}, tokenizer.ggml.pre "
                         f"{self._meta('tokenizer.ggml.pre')!r}); " + "; ".join(problems))

    def _vocab_problem(self, tokenizer: Any) -> str | None:
        """Why ``tokenizer``'s ids are not llama.cpp's, None when they agree on a sample
        text (or every prompt would be fed as other tokens)."""
        if len(tokenizer) > self.vocab_size:
            return (f"it has {len(tokenizer)} tokens; the GGUF's vocabulary has "
                    f"{self.vocab_size}")
        ours = tokenizer(_VOCAB_CHECK_TEXT, add_special_tokens=False)["input_ids"]
        theirs = self.tokenize(_VOCAB_CHECK_TEXT)
        if ours == theirs:
            return None
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                  min(len(ours), len(theirs)))
        return (f"it and llama.cpp disagree at token {at} of a sample text "
                f"({ours[at:at + 3]} vs {theirs[at:at + 3]})")

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's own tokenisation (no special tokens added)."""
        data = text.encode()
        buf = (self.llama_cpp.llama_token * (len(data) + 8))()
        n = self.llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, len(buf), False,
                                          False)
        if n < 0:
            raise ValueError(f"llama.cpp could not tokenise {len(data)} bytes")
        return list(buf[:n])

    def eos_token_ids(self) -> list[int]:
        """The torch runner's set (the model's and its generation config's EOS ids and the
        tokenizer's), so both runners end on the same tokens; llama.cpp's EOS when the HF
        config cannot be read. (llama.cpp's own end-of-generation set is wider: it also
        ends at SmolLM2's <|endoftext|>, which the HF config does not list.)"""
        ids = set(self._config_eos) or {self.llama_cpp.llama_vocab_eos(self.vocab)}
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(i for i in ids if 0 <= i < self.vocab_size)

    def warmup(self, buckets: list[int] | None = None,
               budget_s: float | None = None) -> WarmupReport:
        """Nothing to compile: llama.cpp's kernels are ready once the context exists."""
        log.info("llama.cpp runner: no compiled decode step (nothing to build)")
        return WarmupReport()

    def check_adapter(self, adapter: LoraAdapter) -> None:
        if not self.max_loras:
            raise AdapterError(adapter.adapter_id, "this runner was started without adapter "
                               "slots (--adapter-cache)")
        self.adapters.check(adapter)

    def load_adapter(self, slot: int, adapter: LoraAdapter) -> None:
        """Load ``adapter`` into ``slot``, its GGUF file as it is or its PEFT weights
        converted to one (off the engine thread; ``AdapterError`` when it does not fit)."""
        self.adapters.load(slot, adapter)

    # ---- sequences ------------------------------------------------------------------

    def release(self, seq_id: int) -> None:
        if self.handoff is not None:
            self.handoff.drop(seq_id)
        if self._kept is not None:
            self._kept.forget_grant(seq_id)
        slot = self._slot_of.pop(seq_id, None)
        if slot is None:
            return
        if isinstance(self._kept, StreamKeeper):  # its cached blocks out of its stream
            self._kept.release(seq_id, slot)
        self.llama_cpp.llama_memory_seq_rm(self.memory, slot, -1, -1)
        self._cached[slot] = 0
        heapq.heappush(self._free_slots, slot)

    def _slot(self, seq_id: int, first_pos: int, block_table: list[int] | None = None) -> int:
        """The llama.cpp sequence of ``seq_id``, its cells trimmed to ``first_pos``; a new
        one that starts after cached blocks gets their cells first."""
        if seq_id < 0:
            raise ValueError("the llama.cpp runner needs each row's seq_id")
        slot = self._slot_of.get(seq_id)
        if slot is None:
            if not self._free_slots:
                raise RuntimeError(f"more than {self.max_num_seqs} sequences hold KV")
            slot = self._slot_of[seq_id] = heapq.heappop(self._free_slots)
            if first_pos and self._kept is not None and block_table is not None:
                # the cached blocks, then a kept partial block after them
                self._kept.share(block_table[:first_pos // self.block_size], slot, seq_id)
                self._cached[slot] = first_pos
        if first_pos < self._cached[slot]:
            self.llama_cpp.llama_memory_seq_rm(self.memory, slot, first_pos, -1)
        elif first_pos > self._cached[slot]:
            raise RuntimeError(f"sequence {seq_id}: a chunk at position {first_pos} after "
                               f"only {self._cached[slot]} cached positions")
        return slot

    # ---- one step -------------------------------------------------------------------

    def execute(self, decodes: list[DecodeRow], prefills: list[PrefillWork]) -> torch.Tensor:
        """Logits ``[rows, vocab]``: one row per decode row, then ``num_logits`` per sampled
        prefill, then each prefill's ``prompt_rows`` (the torch runner's order)."""
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []  # batch index of each returned row, in contract order
        extra: list[int] = []  # prompt-logprob rows, after every sampled row
        seen: set[int] = set()
        # A prompt in the torch prefill whose last chunk is its one last token (with any
        # proposals after it) comes as decode rows: they are the chunk ending the hand-over
        ending: dict[int, tuple[int, PrefillWork]] = {}  # seq -> (first row, that chunk)
        if self.streams is not None:
            if isinstance(self._kept, StreamKeeper):
                self._stage_hits(decodes, prefills)
            self._pack_streams(decodes, prefills)
        for r in decodes:  # a sequence's rows (batch expansion) come in position order
            if self.handoff is not None and r.seq_id in self.handoff:
                if r.seq_id in ending:
                    work = ending[r.seq_id][1]
                    work.token_ids.append(r.token_id)
                    work.num_logits += 1
                else:
                    ending[r.seq_id] = (len(rows), PrefillWork(
                        [r.token_id], r.position, r.block_table, True, seq_id=r.seq_id,
                        adapter_slot=r.adapter_slot))
                rows.append(-1)
                continue
            if r.seq_id in seen:
                slot = self._slot_of[r.seq_id]
            else:
                seen.add(r.seq_id)
                # A prompt whose only uncached token is its last runs it as a decode row:
                # a new sequence then starts from the cached blocks of its table.
                slot = self._slot(r.seq_id, r.position, r.block_table)
            rows.append(len(tokens))
            tokens.append(r.token_id)
            positions.append(r.position)
            slots.append(slot)
        handed: list[tuple[int, torch.Tensor]] = []  # (contract row, logits) from torch
        for first, work in ending.values():
            got = self._torch_prefill(work)
            assert got is not None
            handed.extend((first + i, row) for i, row in enumerate(got))
        for work in prefills:
            n = len(work.token_ids)
            if self._torch_prefills(work):
                got = self._torch_prefill(work)
                if got is not None:
                    handed.extend((len(rows) + i, row) for i, row in enumerate(got))
                    rows.extend([-1] * len(got))
                continue
            start = len(tokens)
            slot = self._slot(work.seq_id, work.start_pos, work.block_table)
            tokens.extend(work.token_ids)
            positions.extend(range(work.start_pos, work.start_pos + n))
            slots.extend([slot] * n)
            if work.sample:
                rows.extend(range(start + n - work.num_logits, start + n))
            extra.extend(start + i for i in work.prompt_rows)
        rows.extend(extra)
        if not tokens:
            out = torch.empty(len(rows), self.vocab_size)
        else:
            adapter = {r.adapter_slot for r in decodes} | {w.adapter_slot for w in prefills}
            if len(adapter) > 1:  # the scheduler groups steps by adapter for this runner
                raise RuntimeError(f"one llama.cpp step cannot run adapter slots "
                                   f"{sorted(adapter)}")
            self.adapters.activate(adapter.pop())
            if not handed:
                return self._decode(tokens, positions, slots, rows)
            ours = [r for r in rows if r >= 0]
            out = torch.empty(len(rows), self.vocab_size)
            if ours:
                mine = torch.tensor([i for i, r in enumerate(rows) if r >= 0])
                out[mine] = self._decode(tokens, positions, slots, ours)
            else:
                self._decode(tokens, positions, slots, [len(tokens) - 1])
        for i, row in handed:
            out[i] = row
        return out

    def _stage_hits(self, decodes: list[DecodeRow], prefills: list[PrefillWork]) -> None:
        """Cached blocks that this step's new sequences start from, and that are still
        only in the streams of the sequences that computed them, go to host memory now,
        before ``_pack_streams`` may move those streams (see ``StreamKeeper``)."""
        assert isinstance(self._kept, StreamKeeper)
        bs = self.block_size
        for seq_id, first, table in [*((r.seq_id, r.position, r.block_table) for r in decodes),
                                     *((w.seq_id, w.start_pos, w.block_table) for w in prefills)]:
            if first >= bs and table is not None and seq_id not in self._slot_of:
                self._kept.stage(table[:first // bs])

    def _pack_streams(self, decodes: list[DecodeRow], prefills: list[PrefillWork]) -> None:
        """With a KV stream per sequence, move sequences from the highest ids into free
        lower ones, so that the running sequences and this step's new ones (which take the
        lowest free ids) sit on consecutive ids: llama.cpp puts only sequences of
        consecutive ids in one ubatch, and every extra ubatch reads all the weights again
        (gaps left by finished sequences made 32 staggered ones run ~5 ubatches a step).
        A move is llama.cpp's cross-stream ``seq_cp``, which copies the whole stream at the
        start of the next ``llama_decode`` (~n_ctx_seq x cell bytes), then ``seq_rm``.
        Not in a step that writes a torch-prefilled KV into a sequence: that write is
        immediate, and into a stream a move has just vacated it would be the copy's
        source before the copy runs."""
        h = self.handoff
        if h is not None and (any(r.seq_id in h for r in decodes)
                              or any(self._torch_prefills(w) for w in prefills)):
            return
        new = {r.seq_id for r in decodes if r.seq_id not in self._slot_of} | {
            w.seq_id for w in prefills if w.seq_id not in self._slot_of}
        used = len(self._slot_of) + len(new)
        holes = sorted(s for s in self._free_slots if s < used)
        movers = sorted(((slot, seq) for seq, slot in self._slot_of.items()
                         if slot >= used and (h is None or seq not in h)), reverse=True)
        if not movers or not holes:
            return
        lc = self.llama_cpp
        free = set(self._free_slots)
        for (src, seq), dst in zip(movers, holes, strict=False):  # holes left: new ones
            lc.llama_memory_seq_cp(self.memory, src, dst, -1, -1)
            lc.llama_memory_seq_rm(self.memory, src, -1, -1)
            self._slot_of[seq] = dst
            self._cached[dst], self._cached[src] = self._cached[src], 0
            free.discard(dst)
            free.add(src)
        self._free_slots = sorted(free)  # a sorted list is a heap

    def _torch_prefills(self, work: PrefillWork) -> bool:
        """Whether this chunk goes through the torch model: a sequence already started
        there, a long prompt prefilled from scratch, or the long enough uncached tail of a
        prompt that starts with cached blocks (``worth_torch``; its prefix's KV read from
        the cells it was just given, so this starts it in torch), on the base model, with
        no prompt logprobs (those stay llama.cpp's own)."""
        h = self.handoff
        if h is None:
            return False
        if work.seq_id in h:
            return True
        if work.adapter_slot != 0 or work.prompt_rows:
            return False
        min_tokens = max(self.config.torch_prefill_tokens, h.min_tokens)
        if work.start_pos == 0:
            return work.seq_len >= min_tokens
        seq_len = max(work.seq_len, work.start_pos + len(work.token_ids))
        if (work.seq_id in self._slot_of or self._kept is None or self._kept.host is None
                or not llamacpp_handoff.worth_torch(seq_len - work.start_pos, seq_len,
                                                    min_tokens, not h.min_tokens)):
            return False
        slot = self._slot(work.seq_id, work.start_pos, work.block_table)
        try:
            h.begin_after(work.seq_id, parse_state(get_state(self.llama_cpp, self.ctx, slot)))
        except StateFormatError as e:
            log.warning("llama.cpp runner: a cached prefix's KV could not be read into torch "
                        "(%s); its prompt's tail prefills in llama.cpp", e)
            return False
        return True

    def _torch_prefill(self, work: PrefillWork) -> torch.Tensor | None:
        """One chunk in torch; on the last one, the KV handed to the sequence's llama.cpp
        cells and the sampled rows' logits returned."""
        assert self.handoff is not None
        slot = self._slot(work.seq_id, 0, work.block_table) if work.start_pos == 0 \
            else self._slot_of[work.seq_id]
        got = self.handoff.run(work.seq_id, work.token_ids, work.start_pos,
                               work.num_logits if work.sample else 0)
        if not work.sample:
            return None
        tokens = self.handoff.tokens(work.seq_id)
        first = self.handoff.first_position(work.seq_id)
        self.llama_cpp.llama_memory_seq_rm(self.memory, slot, first, -1)
        try:
            state = self.handoff.state(work.seq_id)
            if first == 0:
                llamacpp_handoff.set_seq_state(self.llama_cpp, self.ctx, slot, state)
            else:  # after cached cells the slot keeps: through the scratch sequence
                self._set_tail_state(slot, state, first, first + len(tokens))
        except RuntimeError as e:
            # llama.cpp restores a state into one run of free cells only; a fragmented
            # cache may have room for the prompt but no such run: prefill it here instead
            log.warning("%s; prefilling those %d tokens in llama.cpp", e, len(tokens))
            self.llama_cpp.llama_memory_seq_rm(self.memory, slot, first, -1)
            self.adapters.activate(0)  # the base model's KV, whatever ran last
            self._decode(tokens, list(range(first, first + len(tokens))),
                         [slot] * len(tokens), [])
        finally:
            self.handoff.drop(work.seq_id)
        self._cached[slot] = first + len(tokens)
        return got

    def _set_tail_state(self, slot: int, state: np.ndarray, p0: int, p1: int) -> None:
        """Cells of positions ``p0..p1`` for ``slot``, which holds the positions before them
        (shared with keepers): llama.cpp writes a state into a sequence it first empties,
        so the tail goes into the host tier's scratch sequence and is shared from there.
        With a stream per sequence (no scratch: cells are not shared across streams) the
        slot's state is read and written again with the tail after it."""
        assert self._kept is not None and self._kept.host is not None
        if isinstance(self._kept, StreamKeeper):
            head, tail = parse_state(get_state(self.llama_cpp, self.ctx, slot)), \
                parse_state(state.data)
            if tail.kinds != head.kinds or (len(head.positions) and head.positions[-1] + 1
                                            != p0):
                raise RuntimeError("a torch-prefilled tail unlike its cached prefix")
            whole = write_state(head.header, head.kinds,
                                np.concatenate([head.positions, tail.positions]),
                                [np.concatenate(pair) for pair in zip(head.parts, tail.parts,
                                                                      strict=True)],
                                head.streams)
            llamacpp_handoff.set_seq_state(self.llama_cpp, self.ctx, slot, whole)
            return
        scratch = self._kept.host.scratch
        try:
            llamacpp_handoff.set_seq_state(self.llama_cpp, self.ctx, scratch, state)
            self.llama_cpp.llama_memory_seq_cp(self.memory, scratch, slot, p0, p1)
        finally:
            self.llama_cpp.llama_memory_seq_rm(self.memory, scratch, -1, -1)

    def _decode(self, tokens: list[int], positions: list[int], slots: list[int],
                rows: list[int]) -> torch.Tensor:
        n = len(tokens)
        a = self.arrays
        if n > a.capacity:
            self.arrays = a = BatchArrays.allocate(n)
        a.token[:n] = tokens
        a.pos[:n] = positions
        a.seq_id[:n] = slots
        a.logits[:n] = 0
        wanted = np.asarray(rows, dtype=np.int64)
        if self.streams is not None and len(set(slots)) > 1:
            # llama.cpp's ubatches over several streams take sequences of consecutive ids
            # only, in the order the batch first names them: the batch in id order
            order = np.lexsort((a.pos[:n], a.seq_id[:n]))
            for arr in (a.token, a.pos, a.seq_id):
                arr[:n] = arr[:n][order]
            wanted = np.argsort(order)[wanted]
        a.logits[wanted] = 1
        # One llama_decode (n <= n_batch): the step's tensor is llama.cpp's own logits
        # buffer, no copy (6 MB for 32 decodes). It stays valid until this context's next
        # llama_decode: the rest of this engine step, which consumes the logits before it.
        single = n <= self.n_batch
        out = None if single else torch.empty(len(rows), self.vocab_size)
        done = 0
        for start in range(0, n, self.n_batch):
            size = min(self.n_batch, n - start)
            rc = self.llama_cpp.llama_decode(self.ctx, a.batch(self.llama_cpp, start, size))
            if rc != 0:
                raise RuntimeError(f"llama_decode failed ({rc}) on a batch of {size} tokens")
            k = 1 if len(rows) == 1 else int(a.logits[start:start + size].sum())
            if k:
                got = self._logits.rows(self.ctx, k)
                if out is None:
                    out = got
                else:
                    out[done:done + k] = got
                done += k
        if out is None:  # a chunk that asked for no logits
            out = torch.empty(0, self.vocab_size)
        self._note_cached(slots, positions)
        if len(rows) > 1:
            # Outputs come back in batch order; ``order`` puts them in the contract's.
            in_batch_order = np.flatnonzero(a.logits[:n])
            if not np.array_equal(in_batch_order, wanted):
                order = np.searchsorted(in_batch_order, wanted)
                out = out[torch.from_numpy(order)]
        return out

    def _note_cached(self, slots: list[int], positions: list[int]) -> None:
        """Each touched sequence now caches up to its last position of the step (its
        positions in a step are consecutive and in order)."""
        for slot, pos in zip(slots, positions, strict=True):
            self._cached[slot] = pos + 1


def _config_eos_ids(source: ModelSource, convert: bool = True) -> set[int]:
    """EOS ids of the model's HF config and generation config (what the torch runner
    reads), from the converted-weights cache entry the tokenizer came from (or the file,
    with no entry and not ``convert``)."""
    from transformers import AutoConfig, GenerationConfig

    hf = hf_source(source, convert)
    kwargs: dict[str, Any] = {"gguf_file": hf.gguf_file} if hf.gguf_file else {}
    configs = []
    for load in (GenerationConfig.from_pretrained, AutoConfig.from_pretrained):
        try:
            configs.append(load(hf.directory, **kwargs))
        except (OSError, ValueError):  # no such file in the entry
            continue
    return config_eos_ids(*configs)
