"""``genserve serve`` (the server) and ``genserve generate`` (a small client)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import sys

from engine.config import EngineConfig
from service.validation import ServiceLimits
from structured.manager import StructuredConfig

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


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the gRPC server",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    e, limits = EngineConfig(), ServiceLimits()
    p.add_argument("--model", default=e.model,
                   help="HF model directory, .gguf file, or 'default' (embedded SmolLM2-135M)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=non_negative_int, default=50051, help="0 = any free port")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context length (default: min(model's, 4096))")
    p.add_argument("--max-num-seqs", type=positive_int, default=e.max_num_seqs,
                   help="sequences running in one step")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=e.max_num_batched_tokens,
                   help="token budget of one step (longer prompts are prefilled in chunks)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=e.kv_cache_memory,
                   help="memory for the KV cache, e.g. 2GiB")
    p.add_argument("--block-size", type=positive_int, default=e.block_size,
                   help="tokens per KV block")
    p.add_argument("--dtype", default=e.dtype, help="auto|float32|bfloat16|float16")
    p.add_argument("--device", default=e.device, help="auto|cpu|cuda|cuda:N")
    p.add_argument("--max-waiting", type=positive_int, default=e.max_waiting,
                   help="waiting-queue bound; beyond it calls get RESOURCE_EXHAUSTED")
    p.add_argument("--default-max-new-tokens", type=positive_int,
                   default=limits.default_max_new_tokens,
                   help="max_new_tokens when a request leaves it unset")
    p.add_argument("--max-batch-size", type=positive_int, default=limits.max_batch_size,
                   help="most items in one GenerateBatch call")
    p.add_argument("--max-n", type=positive_int, default=limits.max_n,
                   help="most completions per request")
    p.add_argument("--max-top-logprobs", type=non_negative_int, default=limits.max_top_logprobs)
    p.add_argument("--max-stop-sequences", type=non_negative_int, default=limits.max_stop_sequences)
    p.add_argument("--drain-grace-seconds", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight calls may take to finish")
    sc = StructuredConfig()
    p.add_argument("--no-structured-output", action="store_true",
                   help="disable structured output (skips building the backends at start-up)")
    p.add_argument("--structured-compile-timeout", type=float, default=sc.compile_timeout_s,
                   help="seconds a grammar may take to compile before INVALID_ARGUMENT")
    p.add_argument("--structured-max-spec-bytes", type=int, default=sc.max_spec_bytes,
                   help="largest schema / regex / grammar accepted")
    p.add_argument("--structured-max-whitespace", type=int,
                   default=sc.max_consecutive_whitespace,
                   help="most consecutive whitespace characters a JSON output may contain")
    p.add_argument("--structured-cache-size", type=int, default=sc.cache_size,
                   help="compiled grammars kept (LRU)")
    p.add_argument("--processor-plugin", action="append", default=[], metavar="MODULE:CLASS",
                   help="register a logits-processor plugin (repeatable); banned_phrases and "
                        "no_repeat_window are built in")
    p.add_argument("--log-level", default="INFO")


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="call a running server")
    p.add_argument("prompt")
    p.add_argument("--address", default="localhost:50051")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")


def _run_serve(args) -> int:
    from service.server import ServerConfig, serve

    engine = EngineConfig(
        model=args.model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory, block_size=args.block_size, dtype=args.dtype,
        device=args.device, max_waiting=args.max_waiting,
        max_top_logprobs=args.max_top_logprobs)
    limits = ServiceLimits(
        default_max_new_tokens=args.default_max_new_tokens, max_batch_size=args.max_batch_size,
        max_n=args.max_n, max_top_logprobs=args.max_top_logprobs,
        max_stop_sequences=args.max_stop_sequences)
    config = ServerConfig(host=args.host, port=args.port,
                          drain_grace_s=args.drain_grace_seconds, limits=limits, engine=engine,
                          processor_plugins=args.processor_plugin,
                          structured=None if args.no_structured_output else StructuredConfig(
                              max_spec_bytes=args.structured_max_spec_bytes,
                              compile_timeout_s=args.structured_compile_timeout,
                              cache_size=args.structured_cache_size,
                              max_consecutive_whitespace=args.structured_max_whitespace))
    try:
        asyncio.run(serve(config))
    except Exception:
        logging.getLogger("genserve").exception("the server failed")
        return 1
    return 0


def _run_generate(args) -> int:
    import grpc

    from genserve.v1 import generation_pb2 as pb
    from genserve.v1 import generation_pb2_grpc as pb_grpc

    req = pb.GenerateRequest(
        prompt=args.prompt,
        sampling=pb.SamplingParameters(temperature=args.temperature),
        stopping=pb.StoppingCriteria(max_new_tokens=args.max_new_tokens))
    with grpc.insecure_channel(args.address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        try:
            if args.stream:
                for msg in stub.GenerateStream(pb.GenerateStreamRequest(request=req),
                                               timeout=args.timeout):
                    print(msg.text, end="", flush=True)
                print()
            else:
                resp = stub.Generate(req, timeout=args.timeout)
                print(resp.completions[0].text)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="genserve")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _generate_parser(sub)
    args = parser.parse_args(argv)
    level = getattr(args, "log_level", "INFO").upper()
    logging.basicConfig(level=level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return _run_serve(args)
    return _run_generate(args)


if __name__ == "__main__":
    sys.exit(main())
