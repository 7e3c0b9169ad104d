"""``genserve serve`` (the server) and ``genserve generate`` (a small client).

Only ``serve`` needs the engine: its modules (torch, transformers, the grammar backends)
are imported when ``serve`` is chosen, so ``genserve generate`` and ``--help`` start in a
fraction of a second and run where only the client's dependencies are installed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

from engine.config import EngineConfig
from service.logs import LOG_FORMATS, setup_logging
from specdecode.config import SpeculativeConfig
from structured.spec import WHITESPACE_MODES

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB' or a plain number of bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"int>={low}"
    return parse


positive_int, non_negative_int = _int_at_least(1), _int_at_least(0)


def non_negative_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value

# Flag groups that set one config dataclass's fields, a flag a field: (flag, field, kind,
# help). A flag's default is its field's default; ``kind`` is the flag's argparse type, a
# tuple of choices, or ``bool`` for a switch. ``_add_flags`` adds a group to the parser and
# ``_flag_values`` reads it back as the config's keyword arguments.
Flags = tuple[tuple[str, str, Any, str], ...]

_ENGINE_FLAGS: Flags = (  # EngineConfig
    ("--max-model-len", "max_model_len", positive_int,
     "context length (default: min(model's, 4096))"),
    ("--max-num-seqs", "max_num_seqs", positive_int, "sequences running in one step"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", positive_int,
     "token budget of one step (longer prompts are prefilled in chunks; default: 512 on "
     "CPU, 2048 on CUDA)"),
    ("--long-prefill-token-threshold", "long_prefill_token_threshold", non_negative_int,
     "most tokens one prompt's prefill gets in a step, so short requests are admitted and "
     "decoded while a long prompt prefills (0 = the whole step budget; default: 128 on "
     "the llama.cpp runner, 256 where its long prompts prefill in torch and on the torch "
     "runner on CPU, 0 on CUDA)"),
    ("--max-long-partial-prefills", "max_long_partial_prefills", positive_int,
     "prompts longer than --long-prefill-token-threshold prefilling at once; shorter "
     "prompts queued behind the others go first"),
    ("--stream-interval", "stream_interval", positive_int,
     "tokens a GenerateStream message carries at least (the first token and the end go "
     "out at once): 1 = a message per token; more = fewer messages for the server and "
     "its clients to handle, tokens arriving in bursts (4 on 2 CPU cores: ~4%% more "
     "batch-1 throughput, ~7%% at 32 streaming clients)"),
    ("--kv-cache-memory", "kv_cache_memory", parse_bytes,
     "memory for the KV cache, e.g. 2GiB (default: 1 GiB; on the llama.cpp runner with a "
     "KV stream per sequence, what its streams take)"),
    ("--block-size", "block_size", positive_int, "tokens per KV block"),
    ("--enable-prefix-caching", "enable_prefix_caching", bool,
     "reuse the KV blocks of prompt prefixes seen before (shared system prompts, chat "
     "histories, n > 1 samples); both runners"),
    ("--prefix-cache-host-memory", "prefix_cache_host_memory", parse_bytes,
     "llama.cpp runner: host memory for cached prefix blocks no request is using, moved "
     "out of llama.cpp's KV cells (which every step's attention walks) and written back on "
     "a hit; default: as much as --kv-cache-memory, 1 GiB when that is not given; 0 = "
     "keep them in the cells (at most "
     "2,048 tokens' worth, fewer under load)"),
    ("--revision", "revision", str, "a hub id's branch, tag or commit (default: main)"),
    ("--trust-remote-code", "trust_remote_code", bool,
     "run a model's own Python code (auto_map in its config.json); off by default"),
    ("--chat-template", "chat_template", str,
     "a Jinja chat template file that replaces the model's own"),
    ("--dtype", "dtype", ("auto", "float32", "bfloat16", "float16"),
     "weights and activations: auto = float32 on CPU; on CUDA the checkpoint's own "
     "bfloat16/float16 (a float32 checkpoint runs in bfloat16)"),
    ("--device", "device", str, "auto|cpu|cuda|cuda:N"),
    ("--runner", "runner", ("auto", "torch", "llamacpp"),
     "model runner: llamacpp runs a .gguf's quantised weights on the CPU "
     "(llama-cpp-python); torch runs HF directories and GGUFs through transformers (fp32 "
     "on CPU, CUDA); auto = llamacpp for a .gguf on CPU when llama-cpp-python is "
     "installed, else torch"),
    ("--threads", "threads", positive_int,
     "llama.cpp runner's threads (default: the cores this process may use)"),
    ("--batch-invariant", "batch_invariant", bool,
     "llama.cpp runner: a request's output (greedy and seeded) does not depend on its "
     "batch mates, chunking or speculation: one KV stream per sequence (concurrency = "
     "what --kv-cache-memory holds of whole sequences), bf16 V cache, 63-token ubatches "
     "(about half the prefill speed), no prefix caching"),
    ("--kv-streams", "kv_streams", bool,
     "llama.cpp runner: one KV stream per sequence, so each row's attention reads only "
     "its own cells (in the one shared cache it walks every sequence's: ~1.15x the "
     "throughput at 32 sequences of 64 tokens, ~1.5x at 200); concurrency = what "
     "--kv-cache-memory holds of whole --max-model-len sequences (default: 32 of them); "
     "cached prefixes go through host memory. Default: auto, streams where 32 of them "
     "fit in a quarter of the memory available (or in --kv-cache-memory when given), else "
     "one shared cache; --no-kv-streams: one shared cache"),
    ("--requantize", "requantize", ("auto", "none", "Q8_0", "BF16", "F16"),
     "llama.cpp runner: run a copy of the GGUF requantised once (cached beside the "
     "converted weights): auto = Q8_0 for a Q4_1 file (about 2x faster prefill and "
     "batches, same batch-1 speed, slightly different numerics); BF16 (CPUs with "
     "AVX512-BF16): ~1.2-1.4x Q8_0's prefill and 32-client throughput, ~30%% slower "
     "batch 1; none = the file as is"),
    ("--torch-prefill-tokens", "torch_prefill_tokens", non_negative_int,
     "llama.cpp runner: prompts of at least this many tokens are prefilled by the torch "
     "model in bf16 (float32 on CPUs without AVX512-BF16) and their KV handed to "
     "llama.cpp (checked at start, off with the reason logged where it cannot be used); "
     "0 = off (default 128)"),
    ("--enforce-eager", "enforce_eager", bool,
     "run every step eagerly: no compiled decode step (torch.compile on CPU, built in the "
     "background while serving; CUDA graphs on CUDA, captured before SERVING)"),
    ("--compile-cuda-graphs", "compile_cuda_graphs", bool,
     "CUDA: capture inductor's compiled forward in the decode graphs (fused kernels: "
     "batch 1 1.23x faster on an 8B model; ~30 s more start-up); --no-compile-cuda-graphs "
     "captures the eager model"),
    ("--max-waiting", "max_waiting", positive_int,
     "waiting-queue bound; beyond it calls get RESOURCE_EXHAUSTED"),
    ("--adapter-cache", "adapter_cache", str,
     "directory of LoRA adapters in the PEFT format, one sub-directory per adapter id "
     "(adapter_config.json + adapter_model.safetensors), loaded on a request's first use of "
     "its adapter_id; default: adapters off (torch runner)"),
    ("--max-loras", "max_loras", positive_int,
     "LoRA adapters resident at once (least recently used evicted); rows of all of them "
     "share a step"),
    ("--max-lora-rank", "max_lora_rank", positive_int,
     "highest LoRA rank accepted (with --max-loras it sizes each layer's adapter slots)"),
    ("--max-lora-wait-s", "max_lora_wait_s", non_negative_seconds,
     "seconds a request for an adapter not resident waits in line for a slot while every "
     "--max-loras slot is held by running requests, then RESOURCE_EXHAUSTED (0: at once)"),
    ("--tensor-parallel-size", "tensor_parallel_size", positive_int,
     "shard the model's attention heads and MLP over this many processes (torch runner; "
     "gloo on CPU, NCCL on CUDA, one GPU each); this process is rank 0"),
    ("--tp-nnodes", "tp_nnodes", positive_int,
     "nodes the tensor-parallel ranks span; the others run 'genserve worker' and meet "
     "this one at MASTER_ADDR:MASTER_PORT"),
)
_LIMIT_FLAGS: Flags = (  # ServiceLimits (and --disable-prompt-logprobs)
    ("--default-max-new-tokens", "default_max_new_tokens", positive_int,
     "max_new_tokens when a request leaves it unset"),
    ("--max-new-tokens", "max_new_tokens", positive_int,
     "the most new tokens a request may ask for (both APIs; a TGIS request's "
     "max_new_tokens 0 means this)"),
    ("--max-input-chars", "max_input_chars", positive_int,
     "longest prompt (text or chat contents) or Tokenize text in characters; longer ones "
     "are refused before tokenising"),
    ("--max-batch-size", "max_batch_size", positive_int,
     "most items in one GenerateBatch call"),
    ("--max-n", "max_n", positive_int, "most completions per request"),
    ("--max-top-logprobs", "max_top_logprobs", non_negative_int,
     "most top_logprobs per token"),
    ("--max-stop-sequences", "max_stop_sequences", non_negative_int,
     "most stop sequences per request"),
)
_STRUCTURED_FLAGS: Flags = (  # StructuredConfig (unless --no-structured-output)
    ("--structured-compile-timeout", "compile_timeout_s", float,
     "seconds a grammar may take to compile before INVALID_ARGUMENT"),
    ("--structured-max-spec-bytes", "max_spec_bytes", int,
     "largest schema / regex / grammar accepted"),
    ("--structured-max-whitespace", "max_consecutive_whitespace", int,
     "most consecutive whitespace characters a JSON output may contain"),
    ("--structured-cache-size", "cache_size", int, "compiled grammars kept (LRU)"),
    ("--structured-whitespace", "default_whitespace", WHITESPACE_MODES,
     "free whitespace in JSON outputs for requests that do not choose; the default "
     "gave the most finished valid outputs in the coverage bench"),
    ("--structured-compile-workers", "compile_workers", int,
     "worker processes compiling xgrammar / lm-format-enforcer grammars"),
    ("--structured-compile-max-rss-mb", "compile_max_rss_mb", int,
     "a compile worker using more memory than this is killed"),
    ("--structured-accelerate-after", "accelerate_after", int,
     "auto: requests of one spec before xgrammar builds it in the background (0 = never)"),
)
_SPEC_FLAGS: Flags = (  # SpeculativeConfig (and --spec-off-by-default)
    ("--spec-method", "method", ("ngram", "draft"),
     "speculative decoding proposer (default: off)"),
    ("--spec-draft-model", "draft_model", str,
     "draft model for --spec-method draft: HF directory, .gguf file, 'default', or "
     "'self:N' (the target's first N layers and its head)"),
    ("--num-spec-tokens", "num_spec_tokens", positive_int,
     "tokens proposed per sequence per step (k)"),
    ("--spec-ngram-min", "ngram_min", positive_int,
     "shortest n-gram the prompt-lookup proposer matches"),
    ("--spec-ngram-max", "ngram_max", positive_int,
     "longest n-gram the prompt-lookup proposer matches (tried first)"),
    ("--spec-disable-batch-size", "disable_batch_size", positive_int,
     "speculation turns off for a step when more sequences run than this"),
    ("--spec-scorer", "scorer", ("batch_expansion", "multi_token"),
     "how the target scores proposals: k+1 single-token queries per sequence in one "
     "batched attention, or one k+1-token query each"),
)


def _add_flags(p: argparse.ArgumentParser, defaults: object, flags: Flags) -> None:
    for flag, field, kind, help_ in flags:
        default = getattr(defaults, field)
        # a switch on by default, or auto (None), can be turned off: --no-...
        how = ({"action": argparse.BooleanOptionalAction if default is not False
                else "store_true"}
               if kind is bool else
               {"choices": kind} if isinstance(kind, tuple) else {"type": kind})
        p.add_argument(flag, default=default, help=help_, **how)


def _flag_values(args: argparse.Namespace, flags: Flags) -> dict[str, Any]:
    return {field: getattr(args, flag.lstrip("-").replace("-", "_"))
            for flag, field, _, _ in flags}


class _LazySubcommands(argparse._SubParsersAction):
    """Subcommands whose flags are added only once the command is chosen on the command
    line: ``serve``'s defaults come from classes whose modules import torch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deferred: dict[str, Callable[[argparse.ArgumentParser], None]] = {}

    def defer(self, name: str, add_arguments: Callable[[argparse.ArgumentParser], None]) -> None:
        self._deferred[name] = add_arguments

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        add_arguments = self._deferred.pop(values[0], None)
        if add_arguments is not None:
            add_arguments(self._name_parser_map[values[0]])
        super().__call__(parser, namespace, values, option_string)


def _serve_parser(sub) -> None:
    """``serve``; its flags are added now, or when chosen if ``sub`` defers them."""
    p = sub.add_parser("serve", help="run the gRPC server",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    if isinstance(sub, _LazySubcommands):
        sub.defer("serve", _serve_args)
    else:
        _serve_args(p)


def _serve_args(p: argparse.ArgumentParser) -> None:
    from service.limits import ServiceLimits
    from structured.config import StructuredConfig

    e, limits = EngineConfig(), ServiceLimits()
    p.add_argument("--config", default=None, metavar="FILE",
                   help="YAML file of settings (flag names as keys, e.g. max-num-seqs: 32); "
                        "precedence: flag > GENSERVE_<FLAG> environment variable > file > "
                        "default")
    p.add_argument("--model", default=e.model,
                   help="HF model directory, .gguf file, Hugging Face hub id (org/name: the "
                        "local HF cache, downloaded when HF_HUB_OFFLINE is unset), or "
                        "'default' (embedded SmolLM2-135M)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients see (GetModelInfo.model_id, metrics' "
                        "model_name label); default: the model's own id")
    p.add_argument("--seed", type=non_negative_int, default=None,
                   help="seed of the seeds the server picks for sampled requests without "
                        "one (and of torch's global RNG): a restarted server replays the "
                        "same sequence of calls identically; default: random")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=non_negative_int, default=50051, help="0 = any free port")
    _add_flags(p, e, _ENGINE_FLAGS)
    _add_flags(p, limits, _LIMIT_FLAGS)
    p.add_argument("--disable-prompt-logprobs", action="store_true",
                   help="refuse prompt logprobs (native output.prompt_logprobs); TGIS "
                        "input_tokens then carry text only")
    p.add_argument("--fmaas", action=argparse.BooleanOptionalAction, default=True,
                   help="also serve the TGIS API (fmaas.GenerationService) on the same port")
    p.add_argument("--default-include-stop-seqs", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="TGIS API: include the matched stop sequence in the output text when "
                        "a request leaves include_stop_sequence unset")
    p.add_argument("--drain-grace-seconds", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight calls may take to finish")
    p.add_argument("--no-structured-output", action="store_true",
                   help="disable structured output (skips building the backends at start-up)")
    _add_flags(p, StructuredConfig(), _STRUCTURED_FLAGS)
    p.add_argument("--processor-plugin", action="append", default=[], metavar="MODULE:CLASS",
                   help="register a logits-processor plugin (repeatable); banned_phrases and "
                        "no_repeat_window are built in")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                   help="text, or json: one JSON object per line (time, level, logger, "
                        "message, request_id, ...)")
    p.add_argument("--metrics-port", type=non_negative_int, default=9400,
                   help="Prometheus metrics over HTTP on --host at this port; 0 = off")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export an OpenTelemetry span per generation request over OTLP/gRPC "
                        "to this collector (e.g. http://localhost:4317), continuing the "
                        "caller's traceparent; default: off")
    p.add_argument("--health-port", type=non_negative_int, default=None,
                   help="also serve grpc.health.v1 alone, plaintext, on this port (for "
                        "Kubernetes gRPC probes when --tls-cert is set); default: off")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="server certificate chain: serve TLS (needs --tls-key)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None, metavar="PEM",
                   help="CA bundle for client certificates: require and verify them (mTLS)")
    _spec_args(p)


def _spec_args(p) -> None:
    _add_flags(p, SpeculativeConfig(), _SPEC_FLAGS)
    p.add_argument("--spec-off-by-default", action="store_true",
                   help="speculate only for requests that set speculative.enabled=true")


def _spec_config(args) -> SpeculativeConfig:
    if args.spec_method == "draft" and not args.spec_draft_model:
        raise SystemExit("--spec-method draft needs --spec-draft-model (a model or self:N)")
    if args.spec_ngram_min > args.spec_ngram_max:
        raise SystemExit("--spec-ngram-min must be <= --spec-ngram-max")
    return SpeculativeConfig(**_flag_values(args, _SPEC_FLAGS),
                             enabled_by_default=not args.spec_off_by_default)


def _json_spec(text: str) -> str:
    """--json-schema: inline JSON (starts with '{'), or a file holding it."""
    import json

    spec, where = text, "inline JSON"
    if not text.lstrip().startswith("{"):
        try:
            with open(text) as f:
                spec, where = f.read(), f"the file {text!r}"
        except OSError as e:
            raise argparse.ArgumentTypeError(
                f"neither inline JSON nor a readable file: {text!r} ({e.strerror or e})"
            ) from None
    try:
        json.loads(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{where} is not valid JSON: {e}") from None
    return spec


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _generate_parser(sub) -> None:
    p = sub.add_parser(
        "generate", help="call a running server (built on genserve.client)",
        description="Generate text with a running genserve server and print it. A failed "
                    "call prints 'genserve generate: error: ...' on stderr and exits 1 "
                    "(2 for bad flags or unreadable files).")
    p.add_argument("prompt", help="the prompt; '-' reads it from standard input")
    p.add_argument("--address", default="localhost:50051",
                   help="host:port or a gRPC target, e.g. dns:///genserve-headless.NS.svc"
                        ".cluster.local:50051 (calls spread over every address, round_robin); "
                        "default: %(default)s")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user chat message (the model's chat template)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64,
                   help="default: %(default)s")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (the default)")
    p.add_argument("--top-p", type=float, default=None, help="(0, 1]; default: off")
    p.add_argument("--top-k", type=non_negative_int, default=None, help="default: off")
    p.add_argument("--seed", type=non_negative_int, default=None,
                   help="makes sampling (--temperature > 0) reproducible")
    p.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=None,
                   help="turn speculative decoding on or off for this request (default: "
                        "the server's setting)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop sequence, not included in the output (repeatable)")
    structured = p.add_argument_group("structured output (at most one)") \
        .add_mutually_exclusive_group()
    structured.add_argument("--json-schema", type=_json_spec, metavar="FILE|JSON",
                            help="output valid JSON for this schema (a file or inline JSON)")
    structured.add_argument("--json-object", action="store_true",
                            help="output any JSON object")
    structured.add_argument("--regex", metavar="REGEX", help="output matching this regex")
    structured.add_argument("--choice", action="append", metavar="TEXT",
                            help="output exactly one of these (repeat: --choice a --choice b)")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--json", action="store_true",
                   help="print the full response as JSON (with --stream: one JSON object "
                        "per chunk and line)")
    p.add_argument("--timeout", type=_positive_float, default=120.0,
                   help="deadline in seconds, of the whole stream with --stream; default: "
                        "%(default)s")
    tls = p.add_argument_group("TLS (default: plaintext)")
    tls.add_argument("--tls", action="store_true",
                     help="TLS, trusting the system's root certificates")
    tls.add_argument("--tls-ca", metavar="PEM",
                     help="TLS, trusting this CA bundle (implies --tls)")
    tls.add_argument("--tls-cert", metavar="PEM",
                     help="client certificate for mTLS (needs --tls-key)")
    tls.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    tls.add_argument("--tls-server-name", metavar="NAME",
                     help="the name to verify the server's certificate against")


# libgomp spins an idle OpenMP worker GOMP_SPINCOUNT times (default 300000: milliseconds
# here) before it sleeps. Behind llama.cpp that worker spins on a core after every step,
# just when the engine thread, the event loop and the streams' clients want that core:
# at 32 streaming clients on 2 cores each step then waited 2.7 ms (median) to start, 0.1 ms
# with 10000 spins, and steps ran ~3% faster. ggml's barriers inside a step still spin
# long enough to stay on their cores. (The torch runner read no better with it: unchanged.)
LLAMACPP_GOMP_SPINCOUNT = "10000"


def openmp_settings(runner: str, model: str, device: str,
                    environ: Mapping[str, str]) -> dict[str, str]:
    """Environment to add before libgomp loads (torch's import loads it, and llama.cpp
    shares that copy) when the llama.cpp runner may run: ``--runner llamacpp``, or ``auto``
    with a .gguf (the default model is one) on the CPU. A user's own OpenMP settings win."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return {}
    gguf = model in ("", "default") or model.endswith(".gguf")
    maybe_llama = runner == "llamacpp" or (
        runner == "auto" and gguf and device in ("auto", "cpu")
        and importlib.util.find_spec("llama_cpp") is not None)
    return {"GOMP_SPINCOUNT": LLAMACPP_GOMP_SPINCOUNT} if maybe_llama else {}


def _run_serve(args) -> int:
    os.environ.update(openmp_settings(args.runner, args.model, args.device, os.environ))
    from service.limits import ServiceLimits
    from service.server import ServerConfig, exit_status, serve
    from service.tgis_params import TgisOptions
    from structured.config import StructuredConfig

    engine = EngineConfig(model=args.model, **_flag_values(args, _ENGINE_FLAGS))
    limit_values = _flag_values(args, _LIMIT_FLAGS)
    limit_values["default_max_new_tokens"] = min(args.default_max_new_tokens,
                                                 args.max_new_tokens)
    try:
        limits = ServiceLimits(**limit_values, prompt_logprobs=not args.disable_prompt_logprobs)
        config = ServerConfig(
            host=args.host, port=args.port, drain_grace_s=args.drain_grace_seconds,
            limits=limits, engine=engine, speculative=_spec_config(args),
            processor_plugins=args.processor_plugin,
            structured=None if args.no_structured_output
            else StructuredConfig(**_flag_values(args, _STRUCTURED_FLAGS)),
            metrics_port=args.metrics_port or None, tls_cert=args.tls_cert,
            tls_key=args.tls_key, tls_client_ca=args.tls_client_ca, fmaas=args.fmaas,
            tgis=TgisOptions(default_include_stop_seqs=args.default_include_stop_seqs),
            served_model_name=args.served_model_name, seed=args.seed,
            health_port=args.health_port, otlp_traces_endpoint=args.otlp_traces_endpoint)
        server = asyncio.run(serve(config))
    except ValueError as e:
        # A bad flag, or a refusal at start (a model feature the runner cannot honour, a
        # budget larger than the machine): the message names it; the traceback is for
        # whoever debugs genserve itself.
        logging.getLogger("genserve").debug("start-up refused", exc_info=True)
        print(f"genserve serve: error: {e}", file=sys.stderr)
        return 2
    except Exception:
        logging.getLogger("genserve").exception("the server failed")
        return 1
    # Non-zero when a tensor-parallel worker was lost (so an orchestrator restarts it);
    # ends the process here while a compile thread runs.
    return exit_status(server, server.exit_code if server is not None else 0)


def _run_generate(args: argparse.Namespace) -> int:
    """``genserve generate``: one call through genserve.client; 0 on success, 1 when the
    call fails, 2 for a bad flag combination or unreadable TLS files."""
    import json

    from genserve.client import Client, GenerateOptions, GenserveError

    def fail(message: str, code: int) -> int:
        print(f"genserve generate: error: {message}", file=sys.stderr)
        return code

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    options: GenerateOptions = {"max_new_tokens": args.max_new_tokens,
                                "temperature": args.temperature}
    for name in ("top_p", "top_k", "seed", "speculative", "json_schema", "regex", "choice"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.stop:
        options["stop"] = args.stop
    if args.json_object:
        options["json_object"] = True
    if bool(args.tls_cert) != bool(args.tls_key):
        return fail("--tls-cert and --tls-key go together", 2)
    try:
        client = Client(args.address, timeout=args.timeout, tls=args.tls,
                        root_certificates=args.tls_ca, certificate_chain=args.tls_cert,
                        private_key=args.tls_key, server_name=args.tls_server_name)
    except (OSError, ValueError) as e:
        return fail(str(e), 2)
    text_prompt: str | list[dict[str, str]] = (
        [{"role": "user", "content": prompt}] if args.chat else prompt)
    with client:
        try:
            if not args.stream:
                result = client.generate(text_prompt, **options)
                print(json.dumps(result.to_dict(), ensure_ascii=False, indent=2) if args.json
                      else result.text)
                return 0
            with client.generate_stream(text_prompt, **options) as stream:
                try:
                    for chunk in stream:
                        if args.json:
                            print(json.dumps(chunk.to_dict(), ensure_ascii=False), flush=True)
                        else:
                            print(chunk.text, end="", flush=True)
                finally:
                    if not args.json:
                        print(flush=True)  # end the line, also before an error
            return 0
        except GenserveError as e:
            return fail(str(e), 1)
        except KeyboardInterrupt:
            return fail("interrupted", 130)


def _worker_parser(sub) -> None:
    p = sub.add_parser(
        "worker", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="run a non-leader node's tensor-parallel ranks (multi-node serving)",
        description="Joins the tensor-parallel group of a 'genserve serve --tensor-parallel-"
                    "size N --tp-nnodes M' on node 0 through torch.distributed's env:// "
                    "rendezvous (MASTER_ADDR, MASTER_PORT in the environment); the model "
                    "and every engine setting come from the leader. Exits 0 when the "
                    "leader stops, non-zero when the group breaks.")
    env_rank = os.environ.get("GENSERVE_TP_NODE_RANK") or os.environ.get("LWS_WORKER_INDEX")
    p.add_argument("--tensor-parallel-size", type=positive_int, required=True)
    p.add_argument("--tp-nnodes", type=positive_int, required=True)
    p.add_argument("--tp-node-rank", type=positive_int,
                   default=int(env_rank) if env_rank else None,
                   required=env_rank is None,
                   help="this node's index, 1..nnodes-1 (default: GENSERVE_TP_NODE_RANK "
                        "or LeaderWorkerSet's LWS_WORKER_INDEX)")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda (one GPU per rank)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text")


def _run_worker(args: argparse.Namespace) -> int:
    from engine.runners.torch.tp_worker import run_node

    try:
        return run_node(args.tensor_parallel_size, args.tp_nnodes, args.tp_node_rank,
                        args.device)
    except ValueError as e:
        print(f"genserve worker: error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="genserve")
    sub = parser.add_subparsers(dest="command", required=True, action=_LazySubcommands)
    _serve_parser(sub)
    _generate_parser(sub)
    _worker_parser(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command == "serve":
        from service.settings import apply_env_and_file

        serve = sub._name_parser_map["serve"]
        try:
            args = apply_env_and_file(serve, argv[argv.index("serve") + 1:], args)
        except ValueError as e:
            serve.error(str(e))
    setup_logging(getattr(args, "log_level", "INFO"), getattr(args, "log_format", "text"))
    if args.command == "serve":
        return _run_serve(args)
    if args.command == "worker":
        return _run_worker(args)
    return _run_generate(args)


if __name__ == "__main__":
    sys.exit(main())
