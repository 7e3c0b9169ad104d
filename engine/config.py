"""Engine configuration and the facts about the loaded model that callers need."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # bytes, where kv_cache_memory is not given


@dataclass
class EngineConfig:
    """Knobs of the engine; the CLI flags of ``genserve serve`` map onto these 1:1."""

    model: str = "default"  # HF directory, .gguf file, hub id (org/name) or "default"
    revision: str | None = None  # hub id's branch, tag or commit (None = main)
    trust_remote_code: bool = False  # run a model's own code (auto_map) from its files
    chat_template: str | None = None  # a Jinja file replacing the model's chat template
    # Which model runner (engine/runners/select.py): auto = llama.cpp for a .gguf on CPU when the
    # llama_cpp package is importable, torch otherwise.
    runner: str = "auto"  # auto | torch | llamacpp
    threads: int | None = None  # llama.cpp runner's threads; None = the cores we may use
    # llama.cpp runner: prefill in ubatches of at most 63 tokens, the size below which its
    # flash attention keeps one kernel, so a sequence's logits do not depend on how its
    # prompt was chunked (~2x slower prefill; docs/llamacpp-runner.md#batch-invariance).
    batch_invariant: bool = False
    # llama.cpp runner: one KV stream per sequence (llama.cpp's kv_unified = false), as
    # --batch-invariant runs, without its 63-token ubatches and bf16 V. In one unified
    # cache every row's attention walks every cell in use, its batch mates' included, so a
    # step's attention grows with the square of the sequences; with a stream each, a row
    # walks its own cells (32 sequences x 200 tokens: 1.5x the throughput). Concurrency is
    # what the KV budget holds of whole sequences; cached prefixes go through host memory.
    # None = auto: streams where 32 of them fit in a quarter of the memory available (or
    # in kv_cache_memory when given), else one unified cache (llamacpp_streams.py,
    # docs/llamacpp-runner.md#many-sequences-at-once-one-kv-stream-each).
    kv_streams: bool | None = None
    # llama.cpp runner: run a requantised copy of the GGUF (cached on disk): auto = Q8_0
    # for Q4_1, whose batched kernels scale worse (engine/runners/requantize.py); none =
    # the file as it is; Q8_0 / F16 = that format.
    requantize: str = "auto"
    max_model_len: int | None = None  # None = min(model's max positions, 4096)
    max_num_seqs: int = 64  # sequences running in one step
    # Token budget of one step (chunked prefill). 0 = by device: 512 on CPU (a step stays
    # under a second on two cores), 2048 on CUDA (a 2k prompt in one step: 0.95x HF's
    # time to first token on an H200 where 512-token chunks gave 4.2x; bench.cuda_roofline).
    max_num_batched_tokens: int = 0
    # Most tokens one prefill gets in a step (0 = the whole budget): keeps a step short
    # while a long prompt prefills, so new requests are admitted and decoded beside it.
    # None = by runner (llm_engine.long_prefill_threshold): 128 on llama.cpp (a 1,024-token
    # prompt's first token came as soon as with 256 or 512, within noise, on its default
    # Q8_0 copy in 512-token ubatches; 63-token ubatches with --batch-invariant), 256
    # on the torch runner on CPU (~0.5 s; 128 cost ~25% prefill throughput there, 256
    # ~10%) and on llama.cpp when long prompts prefill in torch (--torch-prefill-tokens:
    # 3,000 tokens in 128-token chunks took 6.9-7.1 s, in 256 5.8-6.5, whole 5.0-6.0),
    # 0 on CUDA (a 512-token step takes milliseconds). A prefill alone in the engine takes
    # twice this (scheduler.ALONE_CHUNK_FACTOR).
    long_prefill_token_threshold: int | None = None
    # Prompts with more than the threshold left to prefill that may prefill at once; the
    # rest wait, and shorter prompts queued behind them are admitted meanwhile.
    max_long_partial_prefills: int = 1
    # Tokens a stream's message carries at least (the first token and the last message
    # go out at once): 1 = a message per step, as vLLM's and SGLang's stream_interval
    # default. Each message costs the server's event loop and the client CPU (~1.3 ms a
    # token beside a ~15 ms llama.cpp step on two cores); 4 gave ~4% more batch-1
    # throughput there, ~7% at 32 streaming clients (AsyncEngine._hold,
    # docs/operations.md).
    stream_interval: int = 1
    # llama.cpp runner: prompts of at least this many tokens (to prefill from scratch) are
    # prefilled by the torch model in bf16 (float32 on a CPU without AVX512-BF16, from
    # llamacpp_handoff.FLOAT32_MIN_TOKENS) and their KV handed to llama.cpp
    # (engine/runners/llamacpp_handoff.py); 0 = llama.cpp prefills everything.
    # 128: torch was the faster prefill from there up (2026-11-27, default model, two
    # servers alternating: first token at 128 / 256 / 384 / 511 tokens 0.155 / 0.286 /
    # 0.501 / 0.694 s against 0.190 / 0.366 / 0.559 / 0.773 s with 512; 16 clients of
    # 200-token prompts 1.58x the throughput); at 64 tokens both took 0.096 s.
    torch_prefill_tokens: int = 128
    # Bytes for the KV cache. None = 1 GiB (DEFAULT_KV_CACHE_MEMORY), or on the llama.cpp
    # runner with KV streams what its streams take (llamacpp_streams.choose_layout).
    kv_cache_memory: int | None = None
    block_size: int = 16  # tokens per KV block
    # Automatic prefix caching: full KV blocks found again by later prompts (both runners)
    enable_prefix_caching: bool = True
    # llama.cpp runner: host memory for cached blocks no sequence uses, moved out of
    # llama.cpp's cells (engine/runners/llamacpp_host_blocks.py); None = as much as
    # kv_cache_memory (1 GiB when that is not given), 0 = idle blocks stay in the cells (a
    # few, as their cells cost steps).
    prefix_cache_host_memory: int | None = None
    dtype: str = "auto"  # auto: fp32 on CPU; on CUDA the checkpoint's half dtype (fp32 -> bf16)
    device: str = "auto"  # auto = cuda if available else cpu
    max_waiting: int = 1024  # waiting-queue bound; beyond it generate() raises QueueFullError
    # Run batched processors' prepare in a worker thread during the forward. None = auto:
    # only when the forward leaves a CPU core free (CUDA, or more cores than torch uses);
    # on a CPU whose cores the forward saturates, overlapping measured slower (make bench).
    overlap_prepare: bool | None = None
    # CPU fp32: linear weights reordered once for oneDNN at load
    # (engine/runners/torch/packed_linear.py); faster than the compiled step there, and it
    # needs no start-up compile, so a packed model is not compiled. False: plain F.linear
    # (and the compiled step, unless eager).
    pack_weights: bool = True
    # Compiled decode step (engine/runners/torch/compiled_step.py, built by
    # ModelRunner.warmup()). CUDA: a CUDA graph per bucket, rows padded up to it. CPU:
    # torch.compile covers 1..largest bucket rows (two graphs, no padding). Mixed and larger
    # steps run eagerly.
    enforce_eager: bool = False  # True: never compile or capture anything
    # CUDA: the graphs replay inductor's compiled forward (fused norms, rotary, residual
    # adds: batch 1 on a Llama-3-8B shape 125 -> 154 tok/s on an H200, at ~30 s more
    # start-up); False: the eager model captured (no compile). Adapters: always eager.
    compile_cuda_graphs: bool = True
    decode_buckets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    compile_budget_s: float = 300.0  # start-up time for building graphs; the rest stay eager
    # Tensor parallelism (torch runner; engine/runners/torch/tp_*.py): the model's attention
    # heads and MLP sharded over this many processes (this one is rank 0), spread over
    # ``tp_nnodes`` nodes (the others run ``genserve worker``). KV cache memory is per rank.
    tensor_parallel_size: int = 1
    tp_nnodes: int = 1
    # LoRA adapters (engine/adapters.py): PEFT directories under adapter_cache, one per id,
    # loaded on first use; None = no adapters (requests naming one are refused).
    adapter_cache: str | None = None
    max_loras: int = 4  # adapters resident at once (LRU); their rows may share one step
    max_lora_rank: int = 16  # highest LoRA rank accepted (sizes the runner's adapter slots)
    # Seconds a request for a non-resident adapter waits in line for a slot while every
    # slot is held by running requests, before RESOURCE_EXHAUSTED (0: refused at once).
    max_lora_wait_s: float = 60.0

    def step_token_budget(self) -> int:
        """``max_num_batched_tokens`` with 0 resolved for the device (torch is imported
        here, not when the config is built: the CLI sets OpenMP up before torch loads)."""
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        import torch

        cuda = self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())
        return 2048 if cuda else 512


@dataclass
class ModelInfo:
    model_id: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    runner: str = "torch"  # the model runner that runs: "torch" | "llamacpp"
    quantization: str = ""  # weights as they run: "float32", "bfloat16", "Q4_1", ...
    spec_method: str = ""  # "" = speculative decoding off
    spec_k: int = 0
    prefix_caching: bool = False  # the scheduler shares cached prompt blocks
    max_loras: int = 0  # adapter slots (--max-loras); 0 = adapters off


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class WorkerLostError(EngineDeadError):
    """A tensor-parallel worker died or a collective failed: the model cannot run a step
    any more. The server reports NOT_SERVING and exits non-zero, to be restarted (a
    request that meets it, e.g. loading an adapter, gets UNAVAILABLE)."""


class RequestError(ValueError):
    """A request the engine cannot serve. ``limit`` names what it exceeds, in engine terms
    ("prompt", "vocabulary", "context", "kv_cache"), so callers can map it to their own
    field names without reading the message."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit
