"""Runs one packed forward per step: every scheduled prefill chunk and decode row at once."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable

import torch

from engine.adapters import AdapterError, LoraAdapter
from engine.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from engine.kv_cache import BlockKeeper
from engine.loading.model_loader import (
    config_dtype,
    load_config,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model,
)
from engine.loading.rope_scaling import fix_rotary
from engine.runners.base import (
    DEFAULT_MAX_MODEL_LEN,
    DecodeRow,
    PrefillWork,
    WarmupReport,
    config_eos_ids,
)
from engine.runners.torch import native_gemm
from engine.runners.torch.attention import (
    ATTN_NAME,
    AttentionMetadata,
    PrefillChunk,
    probe_step,
)
from engine.runners.torch.compiled_step import DecodeGraphs, cap_buckets
from engine.runners.torch.decode_inputs import build_decode_inputs
from engine.runners.torch.fused_linear import fuse_siblings
from engine.runners.torch.kv_tensors import KVCache, KVCacheSpec
from engine.runners.torch.lora import LoraLayers
from engine.runners.torch.model_check import check_config, check_probe
from engine.runners.torch.packed_linear import can_pack, pack_linears
from engine.runners.torch.tp_group import TPGroup
from engine.runners.torch.tp_shard import drop_head, reduce_row_parallel, shard_model

log = logging.getLogger(__name__)

class ModelRunner:
    name = "torch"
    # Extra rows of a step are nearly free here: on the CPU the packed fp32 matmuls are
    # bandwidth bound (nine rows cost ~1.5 one-row steps), on CUDA far more so.
    row_cost = 0.0
    supports_prefix_caching = True  # attention reads each row's blocks through its table
    block_keeper: BlockKeeper | None = None  # the block table is the KV: it keeps itself
    supports_mixed_adapters = True  # per-row LoRA (engine/runners/torch/lora.py)
    prefers_gguf_adapters = False  # a GGUF is read back into PEFT's layout: PEFT is exact

    def __init__(self, config: EngineConfig, share_weights: ModelRunner | None = None,
                 num_blocks: int | None = None, tp: TPGroup | None = None) -> None:
        """``share_weights``: reuse another runner's loaded model and tokenizer (with a KV
        cache of this config's own size) instead of loading the weights again; anything
        with the same five attributes will do (a self-draft passes a truncated model).
        ``num_blocks`` sizes the KV cache in blocks instead of ``kv_cache_memory``.
        ``tp``: this process's tensor-parallel group; the runner holds its rank's shard
        (rank 0: ``execute`` sends each step to the workers first)."""
        self.tp = tp
        if share_weights is None:
            source = resolve_model(config.model, config.revision)
            self.device = tp.device if tp else resolve_device(config.device)
            self.dtype = resolve_dtype(config.dtype, self.device, config_dtype(source))
            self.tokenizer = load_tokenizer(source, config.trust_remote_code,
                                            config.chat_template)
            check_config(load_config(source, config.trust_remote_code))  # before the weights
            # Sharded on the CPU, then moved: a rank's device holds only its shard.
            self.model = load_model(source, self.dtype,
                                    torch.device("cpu") if tp else self.device, ATTN_NAME,
                                    config.trust_remote_code)
            if tp is not None:
                shard_model(self.model, tp.rank, tp.world_size)
                if tp.rank:
                    drop_head(self.model)
                self.model.to(self.device)
            self.model_id = source.model_id
            if not config.adapter_cache and os.environ.get("GENSERVE_FUSE_PROJECTIONS") != "0":
                # q/k/v and gate/up as one product each (not with adapter slots, which
                # hook and fold into each layer); packed below as one layer each
                fuse_siblings(self.model)
            if config.pack_weights and can_pack(self.device, self.dtype):
                pack_linears(self.model)
            elif self.device.type == "cpu" and self.dtype == torch.float32:
                native_gemm.available()  # the decode attention's kernel: built at load,
                # not in the first step (packing above builds it otherwise)
            if tp is not None:
                reduce_row_parallel(self.model)
        else:
            for name in ("device", "dtype", "tokenizer", "model", "model_id"):
                setattr(self, name, getattr(share_weights, name))
        text_cfg = self.model.config.get_text_config()
        n_heads = text_cfg.num_attention_heads
        n_kv = getattr(text_cfg, "num_key_value_heads", None) or n_heads
        if tp is not None:
            n_kv //= tp.world_size  # this rank's heads only
        head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // n_heads
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.quantization = str(self.dtype).removeprefix("torch.")  # weights as they run
        model_max = getattr(text_cfg, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN)
        wanted = config.max_model_len or DEFAULT_MAX_MODEL_LEN
        self.max_model_len = min(model_max, wanted)
        if config.max_model_len and config.max_model_len > model_max:
            log.warning("max_model_len %d exceeds the model's %d; using %d",
                        config.max_model_len, model_max, model_max)
        if share_weights is None:  # RoPE that transformers picks per forward: fixed here
            for level, note in fix_rotary(self.model, self.max_model_len):
                log.log(level, "%s", note)
        self.block_size = config.block_size
        spec = KVCacheSpec(text_cfg.num_hidden_layers, n_kv, head_dim, config.block_size,
                           self.dtype)
        budget = DEFAULT_KV_CACHE_MEMORY if config.kv_cache_memory is None \
            else config.kv_cache_memory
        if num_blocks is None:
            num_blocks = budget // spec.bytes_per_block
        if num_blocks < 2:
            raise ValueError(
                f"kv_cache_memory={budget} bytes holds fewer than 2 blocks "
                f"({spec.bytes_per_block} bytes each)"
            )
        # One block more than the scheduler hands out: the scratch block that padded rows of
        # a compiled decode step write to and read from.
        self.kv_cache = KVCache(spec, num_blocks + 1, self.device)
        self.num_blocks = num_blocks  # the scheduler's BlockAllocator hands these out
        self.scratch_block = num_blocks
        self.config = config
        # Rows one sequence may add to a decode step (speculative batch expansion: k + 1);
        # the engine raises it when it is given a speculator (EngineConfig has no spec knobs).
        self.max_rows_per_seq = 1
        self.decode_graphs: DecodeGraphs | None = None  # built by warmup()
        # LoRA adapter slots (engine/runners/torch/lora.py); a runner sharing another's
        # weights (a self-draft) runs the base model only
        self.lora: LoraLayers | None = None
        # adapter slot writes vs forwards (run_step); one lock with a self-draft's layers
        self._forward_lock: threading.Lock = (
            threading.Lock() if share_weights is None
            else share_weights._forward_lock)
        self.max_loras = 0
        if config.adapter_cache and share_weights is None:
            self.lora = LoraLayers(self.model, config.max_loras, config.max_lora_rank,
                                   self.device, self.dtype)
            self.max_loras = config.max_loras
        log.info("KV cache: %d blocks of %d tokens (%.0f MiB, %d tokens)", num_blocks,
                 config.block_size, num_blocks * spec.bytes_per_block / 2**20,
                 num_blocks * config.block_size)
        if share_weights is None:
            self._probe()

    @torch.inference_mode()
    def _probe(self) -> None:
        """One forward of a few tokens into the scratch block through a recording
        attention: refuses (``UnsupportedModelFeature``) a model whose layers ask the
        attention for a feature it lacks or bypass it."""
        n = min(4, self.block_size)
        bs = self.block_size
        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.arange(self.scratch_block * bs, self.scratch_block * bs + n,
                                      device=self.device),
            prefills=[PrefillChunk(0, n, 0, torch.tensor([self.scratch_block],
                                                         device=self.device), None)])
        probe = probe_step(meta)
        self.model(input_ids=torch.zeros(1, n, dtype=torch.long, device=self.device),
                   position_ids=torch.arange(n, device=self.device)[None], use_cache=False,
                   logits_to_keep=1, genserve_meta=probe)
        check_probe(self.model.config, probe.layers)

    def eos_token_ids(self) -> list[int]:
        ids = config_eos_ids(self.model.generation_config, self.model.config)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    def release(self, seq_id: int) -> None:
        """Nothing kept per sequence: its KV lives in the blocks the scheduler frees."""

    def _lora_of(self, adapter: LoraAdapter) -> LoraLayers:
        if self.lora is None:
            raise AdapterError(adapter.adapter_id, "this runner was started without adapter "
                               "slots (--adapter-cache)")
        return self.lora

    def check_adapter(self, adapter: LoraAdapter) -> None:
        self._lora_of(adapter).check(1, adapter)

    def load_adapter(self, slot: int, adapter: LoraAdapter) -> None:
        """Checked here against the full model first (``AdapterError``, nothing written);
        with tensor parallelism rank 0 then sends the adapter's tensors to every worker
        in the step stream (so a worker needs no adapter cache of its own and writes
        exactly what rank 0 checked), and each rank writes its share of every layer."""
        lora = self._lora_of(adapter)
        adapter = lora.check(slot, adapter)  # a GGUF file: read back, sent as tensors
        if self.tp is None:
            with self._forward_lock:
                lora.write(slot, adapter)
            return
        with self.tp.leading(("adapter", slot, adapter)), self._forward_lock:
            lora.write(slot, adapter)

    def follow_adapter(self, slot: int, adapter: LoraAdapter) -> None:
        """A worker's half of rank 0's ``load_adapter``: the same slot, this rank's share.
        Rank 0 checked the adapter; a failure here is a bug and ends the worker (the
        group fails: NOT_SERVING)."""
        assert self.lora is not None, "adapter sent to a worker without adapter slots"
        self.lora.load(slot, adapter)

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    # ---- compiled decode step ----------------------------------------------------------

    def warmup(self, buckets: list[int] | None = None,
               budget_s: float | None = None) -> WarmupReport:
        """Build the compiled decode step; call once at start-up, before serving (and
        after setting ``max_rows_per_seq``: the largest step is ``max_num_seqs`` times it).

        ``buckets``/``budget_s`` default to the config's. Graphs not built within the
        budget, and steps no built graph covers, run eagerly. With ``enforce_eager``
        nothing is built (an empty report).
        """
        if self.config.enforce_eager:
            log.info("enforce_eager: decode steps run eagerly (nothing compiled)")
            return WarmupReport()
        if self.tp is not None and self.device.type == "cuda":
            # Unverified: NCCL collectives inside captured CUDA graphs; never served wrong.
            log.warning("tensor parallel on CUDA: decode steps run eagerly (CUDA graphs "
                        "are not captured with --tensor-parallel-size > 1)")
            return WarmupReport()
        wanted = cap_buckets(self.config.decode_buckets if buckets is None else buckets,
                             self.config.max_num_seqs * self.max_rows_per_seq)
        budget = self.config.compile_budget_s if budget_s is None else budget_s
        if self.tp is None:
            return self._build_graphs(wanted, budget)
        with self.tp.leading(("warmup", wanted, budget)):
            return self._build_graphs(wanted, budget, self.tp.broadcast)

    def follow_warmup(self, wanted: list[int], budget: float) -> WarmupReport:
        """A worker's half of rank 0's ``warmup``: the same builds, in lockstep (rank 0
        decides which to skip, and each rank's warm-up forwards meet in the all-reduces)."""
        assert self.tp is not None
        tp = self.tp
        return self._build_graphs(wanted, budget, lambda _go: tp.broadcast())

    def _build_graphs(self, wanted: list[int], budget: float,
                      agree: Callable[[bool], bool] | None = None) -> WarmupReport:
        graphs = DecodeGraphs(self.model, self.kv_cache, self.block_size, self.scratch_block,
                              -(-self.max_model_len // self.block_size), self.device,
                              self.lora, self.config.compile_cuda_graphs,
                              allow_native=self.tp is None)
        report = graphs.build(wanted, budget, agree)
        self.decode_graphs = graphs if graphs.max_rows else None
        return report

    # ---- one step ----------------------------------------------------------------------

    def execute(self, decodes: list[DecodeRow], prefills: list[PrefillWork]) -> torch.Tensor:
        """Logits ``[rows, vocab]``: one row per decode row, then ``num_logits`` per sampled
        prefill, then each prefill's ``prompt_rows``. With tensor parallelism the step goes
        to the workers first (one broadcast), and every rank runs it on its shard."""
        if not decodes and not prefills:
            return torch.empty(0, self.vocab_size, dtype=self.dtype, device=self.device)
        if self.tp is None:
            return self.run_step(decodes, prefills)
        with self.tp.leading(("step", decodes, prefills)):
            return self.run_step(decodes, prefills)

    @property
    def failure(self) -> str | None:
        """Why the tensor-parallel group can run no more steps (None: it can)."""
        return self.tp.failure if self.tp is not None else None

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one device)."""
        if self.tp is not None:
            self.tp.close()

    @torch.inference_mode()
    def run_step(self, decodes: list[DecodeRow], prefills: list[PrefillWork]) -> torch.Tensor:
        """This rank's forward of the step (a worker's logits are empty: rank 0 has the
        head). Holds ``_forward_lock``: an adapter load (on its request's thread) re-packs
        the layers it adapts, which must not happen inside a forward or beside another
        load (a step read half-packed weights: wrong tokens, then a shape error)."""
        with self._forward_lock:
            return self._run_step(decodes, prefills)

    def _run_step(self, decodes: list[DecodeRow], prefills: list[PrefillWork]
                  ) -> torch.Tensor:
        if not prefills:
            if self.decode_graphs is not None:
                logits = self.decode_graphs.run(decodes)
                if logits is not None:
                    return logits
            return self._execute_decodes(decodes)
        bs = self.block_size
        adapter_slots: list[int] = [r.adapter_slot for r in decodes]
        token_ids: list[int] = [r.token_id for r in decodes]
        positions: list[int] = [r.position for r in decodes]
        slots: list[int] = [r.block_table[r.position // bs] * bs + r.position % bs
                            for r in decodes]
        keep: list[int] = list(range(len(decodes)))
        extra: list[int] = []  # prompt-logprob rows, after the sampled ones
        meta_prefills: list[PrefillChunk] = []
        for work in prefills:
            start = len(token_ids)
            n = len(work.token_ids)
            end_pos = work.start_pos + n
            token_ids.extend(work.token_ids)
            adapter_slots.extend([work.adapter_slot] * n)
            positions.extend(range(work.start_pos, end_pos))
            slots.extend(self._slots(work.block_table, work.start_pos, end_pos))
            mask = None
            if work.start_pos:
                mask = torch.ones(n, end_pos, dtype=torch.bool).tril(diagonal=work.start_pos)
                mask = mask.to(self.device)
            n_blocks = -(-end_pos // bs)
            block_ids = torch.tensor(work.block_table[:n_blocks], device=self.device)
            meta_prefills.append(PrefillChunk(start, n, work.start_pos, block_ids, mask))
            if work.sample:
                keep.extend(range(start + n - work.num_logits, start + n))
            extra.extend(start + r for r in work.prompt_rows)

        packed = torch.tensor([token_ids, positions, slots], dtype=torch.long,
                              device=self.device)
        meta = AttentionMetadata(kv_cache=self.kv_cache, slot_mapping=packed[2],
                                 num_decode=len(decodes), prefills=meta_prefills)
        if decodes:
            dec = build_decode_inputs(decodes, bs, self.scratch_block, self.device)
            meta.decode_block_tables = dec.block_tables
            meta.decode_mask = dec.mask(bs)
            meta.decode_groups = dec.groups
            meta.decode_seq_lens = dec.seq_lens
        with self._adapters(adapter_slots):
            out = self.model(
                input_ids=packed[0:1],
                position_ids=packed[1:2],
                use_cache=False,
                logits_to_keep=torch.tensor(keep + extra, dtype=torch.long,
                                            device=self.device),
                genserve_meta=meta,
            )
        return out.logits[0]

    def _adapters(self, slots: list[int]) -> contextlib.AbstractContextManager[None]:
        """Token ``i`` of the forward runs adapter slot ``slots[i]``."""
        return self.lora.step(slots) if self.lora is not None else contextlib.nullcontext()

    def _execute_decodes(self, decodes: list[DecodeRow]) -> torch.Tensor:
        """Eager decode-only step: every row is sampled, so no ``logits_to_keep`` gather."""
        inputs = build_decode_inputs(decodes, self.block_size, self.scratch_block,
                                     self.device)
        with self._adapters([r.adapter_slot for r in decodes]):
            out = self.model(
                input_ids=inputs.input_ids,
                position_ids=inputs.positions,
                use_cache=False,
                genserve_meta=inputs.metadata(self.kv_cache, self.block_size),
            )
        return out.logits[0]
