"""``python -m bench.cuda_roofline --tokenizer DIR``: the torch runner on a Llama-3-8B-shaped
model (random weights, bf16) on one GPU, against the memory roofline and HF ``generate``.

Made for a lent GPU machine (issue 29): batch-1 decode as a fraction of the HBM roofline
(weight bytes read per token / the device-to-device copy bandwidth measured in the same
run), 64 concurrent sequences against HF static batch 64, and time to first token for a
2,048-token prompt against HF. The weights are random (speed does not depend on their
values) and every run is forced to its full length. ``--layers``/``--hidden`` shrink the
shape for a smoke run (``--allow-cpu`` runs that on a machine without CUDA).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import torch

from bench.measure import engine_offline, hf_static
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.runners.select import torch_runner
from engine.runners.torch import stock_transformers
from engine.sampling_params import SamplingParams


def llama3_8b_config(vocab: int, layers: int, hidden: int, bos: int, eos: int):
    """Llama-3-8B's shape (GQA 32/8 heads of 128, SwiGLU 3.5x, 128k vocab, rope 500k)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=hidden * 7 // 2, num_hidden_layers=layers,
                       num_attention_heads=hidden // 128, num_key_value_heads=hidden // 512,
                       head_dim=128, max_position_embeddings=8192,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                       rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=bos,
                       eos_token_id=eos, dtype="bfloat16")


def build(tokenizer_dir: Path, out: Path, layers: int, hidden: int,
          device: torch.device) -> Path:
    """Random weights of the shape, made on the device (fast) and saved as bf16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = llama3_8b_config(128256, layers, hidden, tok.bos_token_id, tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    return out


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes per second a device-to-device copy moves, counting bytes read and written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    reps = 10
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - t0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Every weight is read once per decode step except the input embedding (one row)."""
    emb = cast(Any, model).get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if p is not emb)


def engine_decode_tok_s(engine: LLMEngine, new: int) -> float:
    """Batch-1 decode rate after the first token (prefill excluded)."""
    params = SamplingParams(max_new_tokens=new, min_new_tokens=new)
    engine.add_request("b1", engine.tokenizer("The capital of France is")["input_ids"], params)
    produced = 0
    while produced == 0:
        produced = sum(len(d.token_ids) for o in engine.step() for d in o.deltas)
    t0 = time.perf_counter()
    while engine.has_work:
        engine.step()
    return (new - produced) / (time.perf_counter() - t0)


def graph_step_ms(engine: LLMEngine, reps: int = 100) -> float | None:
    """The batch-1 CUDA graph replayed back to back (inputs copied in, no host work
    between steps): what a step costs the GPU. Its gap to ``1 / engine_decode_tok_s`` is
    the time the GPU waits on the host each token. None without CUDA graphs."""
    from engine.runners.torch.decode_inputs import flat_decode_inputs

    graphs = torch_runner(engine.runner).decode_graphs
    if graphs is None or graphs.device.type != "cuda" or not graphs.covers(1):
        return None
    key = min((k for k in graphs._cuda_steps if k[0] == 1), default=None)
    if key is None:
        return None
    step = graphs._cuda_steps[key]
    inputs = flat_decode_inputs([], graphs.block_size, graphs.scratch_block, 1, key[1])
    with torch.inference_mode():
        for _ in range(5):
            step(inputs)
        sync(graphs.device)
        t0 = time.perf_counter()
        for _ in range(reps):
            step(inputs)
        sync(graphs.device)
    return (time.perf_counter() - t0) / reps * 1e3


def hf_decode_tok_s(engine: LLMEngine, new: int) -> float:
    """HF ``generate`` batch 1: (new - 1) tokens over (total - time of a 1-token run)."""
    model = torch_runner(engine.runner).model
    ids = engine.tokenizer("The capital of France is", return_tensors="pt").to(model.device)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(**ids, max_new_tokens=1, do_sample=False)
        sync(model.device)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(**ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        sync(model.device)
        total = time.perf_counter() - t0
    return (new - 1) / (total - first)


def long_prompt(engine: LLMEngine, n: int) -> list[int]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def engine_ttft(engine: LLMEngine, ids: list[int]) -> float:
    engine.add_request(f"ttft{time.monotonic_ns()}", ids,
                       SamplingParams(max_new_tokens=1, min_new_tokens=1))
    t0 = time.perf_counter()
    while engine.has_work:
        engine.step()
    return time.perf_counter() - t0


def hf_ttft(engine: LLMEngine, ids: list[int]) -> float:
    model = torch_runner(engine.runner).model
    x = torch.tensor([ids], device=model.device)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=1,
                       do_sample=False)
        sync(model.device)
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--allow-cpu", action="store_true", help="smoke run without CUDA")
    ap.add_argument("--out", type=Path, default=Path("bench/results/cuda_roofline.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit("bench.cuda_roofline needs a CUDA device")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model_dir = build(args.tokenizer, Path(tempfile.mkdtemp()), args.layers, args.hidden,
                      device)
    build_s = time.perf_counter() - t0
    new = args.new_tokens
    common = dict(model=str(model_dir), runner="torch", dtype="bfloat16",
                  max_num_seqs=args.batch, kv_cache_memory=8 << 30 if device.type == "cuda"
                  else 256 << 20, max_model_len=4096)
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(**common))  # type: ignore[arg-type]
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm = engine.runner.warmup()
    warm_s = time.perf_counter() - t0
    # 512-token prefill chunks: the budget CUDA had before it became 2048.
    chunked = LLMEngine(EngineConfig(**common, max_num_batched_tokens=512),  # type: ignore[arg-type]
                        share_weights=engine)
    hf_model = torch_runner(engine.runner).model
    bw = copy_bandwidth(device)
    wbytes = weight_bytes_per_token(hf_model)
    roofline = bw / wbytes

    engine_offline(engine, 4, 8)  # warm-up: allocator, kernels' autotuning
    with stock_transformers(hf_model):
        hf_static(engine, 4, 8)
    b1 = [engine_decode_tok_s(engine, new) for _ in range(3)]
    replay_ms = graph_step_ms(engine)
    with stock_transformers(hf_model):
        hf_b1 = [hf_decode_tok_s(engine, new) for _ in range(2)]
    ours64, hf64 = [], []
    for _ in range(2):
        ours64.append(engine_offline(engine, args.batch, new).tok_s)
        with stock_transformers(hf_model):
            hf64.append(hf_static(engine, args.batch, new).tok_s)
    engine_ttft(engine, long_prompt(engine, 64))
    # A new prompt length each round (as in serving): a kernel that plans per shape pays
    # every round. Different tokens each round: prefix caching must not serve them.
    lengths = [args.prompt_tokens - 16 * i for i in range(4)]
    ttft, ttft_512, ttft_hf, ttft_hf_cudnn, ttft_cudnn = [], [], [], [], []
    for i, n in enumerate(lengths):
        ids = [t + i for t in long_prompt(engine, n)]
        ttft.append(engine_ttft(engine, ids))
        ttft_512.append(engine_ttft(chunked, [t + 7 for t in ids]))
        with stock_transformers(hf_model):
            ttft_hf.append(hf_ttft(engine, ids))
            if device.type == "cuda":  # torch's own default, which the runner turns off
                torch.backends.cuda.enable_cudnn_sdp(True)
                ttft_hf_cudnn.append(hf_ttft(engine, [t + 3 for t in ids]))
                ttft_cudnn.append(engine_ttft(engine, [t + 5 for t in ids]))
                torch.backends.cuda.enable_cudnn_sdp(False)
    med = statistics.median
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "shape": f"Llama-3-8B ({args.layers} layers, hidden "
        f"{args.hidden})", "params_b": sum(p.numel() for p in hf_model.parameters()) / 1e9,
        "build_s": build_s, "load_s": load_s, "warmup_s": warm_s, "graphs": warm.ready,
        "copy_bandwidth_gb_s": bw / 1e9, "weight_bytes_per_token": wbytes,
        "roofline_tok_s": roofline, "b1_tok_s": b1, "b1_fraction": med(b1) / roofline,
        "b1_step_ms": 1e3 / med(b1), "b1_graph_replay_ms": replay_ms,
        "hf_b1_tok_s": hf_b1, f"batch{args.batch}_tok_s": ours64,
        f"hf_static{args.batch}_tok_s": hf64,
        f"batch{args.batch}_x_hf": med(ours64) / med(hf64),
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "ttft_lengths": lengths, "ttft_s": ttft, "ttft_512_chunks_s": ttft_512,
        "ttft_cudnn_s": ttft_cudnn, "hf_ttft_s": ttft_hf, "hf_ttft_cudnn_s": ttft_hf_cudnn,
        "ttft_x_hf": med(ttft) / med(ttft_hf), "ttft_512_x_hf": med(ttft_512) / med(ttft_hf),
    }
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
