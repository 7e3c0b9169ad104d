"""Runs one packed forward per step: every scheduled prefill chunk and decode row at once."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import ATTN_NAME, AttentionMetadata, PrefillChunk
from engine.config import EngineConfig
from engine.kv_cache import KVCache, KVCacheSpec
from engine.model_loader import (
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 4096


@dataclass
class DecodeRow:
    """One query token at ``position`` attending to the first ``position + 1`` cache slots."""

    token_id: int
    position: int
    block_table: list[int]


@dataclass
class PrefillWork:
    token_ids: list[int]
    start_pos: int  # tokens of the sequence already cached
    block_table: list[int]
    sample: bool  # does the last token's logits row get sampled?
    num_logits: int = 1  # with ``sample``: logits rows of the last tokens returned


class ModelRunner:
    def __init__(self, config: EngineConfig, share_weights: ModelRunner | None = None,
                 num_blocks: int | None = None) -> None:
        """``share_weights``: reuse another runner's loaded model and tokenizer (with a KV
        cache of this config's own size) instead of loading the weights again; anything
        with the same five attributes will do (a self-draft passes a truncated model).
        ``num_blocks`` sizes the KV cache in blocks instead of ``kv_cache_memory``."""
        if share_weights is None:
            source = resolve_model(config.model)
            self.device = resolve_device(config.device)
            self.dtype = resolve_dtype(config.dtype, self.device)
            self.tokenizer = load_tokenizer(source)
            self.model = load_model(source, self.dtype, self.device, ATTN_NAME)
            self.model_id = source.model_id
        else:
            for name in ("device", "dtype", "tokenizer", "model", "model_id"):
                setattr(self, name, getattr(share_weights, name))
        text_cfg = self.model.config.get_text_config()
        n_heads = text_cfg.num_attention_heads
        n_kv = getattr(text_cfg, "num_key_value_heads", None) or n_heads
        head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // n_heads
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        model_max = getattr(text_cfg, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN)
        wanted = config.max_model_len or DEFAULT_MAX_MODEL_LEN
        self.max_model_len = min(model_max, wanted)
        if config.max_model_len and config.max_model_len > model_max:
            log.warning("max_model_len %d exceeds the model's %d; using %d",
                        config.max_model_len, model_max, model_max)
        self.block_size = config.block_size
        spec = KVCacheSpec(text_cfg.num_hidden_layers, n_kv, head_dim, config.block_size,
                           self.dtype)
        if num_blocks is None:
            num_blocks = config.kv_cache_memory // spec.bytes_per_block
        if num_blocks < 2:
            raise ValueError(
                f"kv_cache_memory={config.kv_cache_memory} bytes holds fewer than 2 blocks "
                f"({spec.bytes_per_block} bytes each)"
            )
        self.kv_cache = KVCache(spec, num_blocks, self.device)
        self.num_blocks = num_blocks  # the scheduler's BlockAllocator hands these out
        self.max_rows_per_seq = 1  # decode rows one sequence may add (the engine sets k + 1)
        log.info("KV cache: %d blocks of %d tokens (%.0f MiB, %d tokens)", num_blocks,
                 config.block_size, num_blocks * spec.bytes_per_block / 2**20,
                 num_blocks * config.block_size)

    def eos_token_ids(self) -> list[int]:
        ids: set[int] = set()
        for src in (self.model.generation_config, self.model.config):
            eos = getattr(src, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif eos:
                ids.update(eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    @torch.inference_mode()
    def execute(self, decodes: list[DecodeRow], prefills: list[PrefillWork]) -> torch.Tensor:
        """Logits ``[rows, vocab]``: one row per decode row, then ``num_logits`` per sampled
        prefill."""
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        keep: list[int] = []
        for i, row in enumerate(decodes):
            token_ids.append(row.token_id)
            positions.append(row.position)
            slots.extend(self._slots(row.block_table, row.position, row.position + 1))
            keep.append(i)
        meta_prefills: list[PrefillChunk] = []
        for work in prefills:
            start = len(token_ids)
            n = len(work.token_ids)
            end_pos = work.start_pos + n
            token_ids.extend(work.token_ids)
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

        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, device=self.device),
            num_decode=len(decodes),
            prefills=meta_prefills,
        )
        if decodes:
            max_blocks = max(-(-(r.position + 1) // bs) for r in decodes)
            tables = torch.zeros(len(decodes), max_blocks, dtype=torch.long)
            for i, r in enumerate(decodes):
                blocks = r.block_table[:max_blocks]
                tables[i, :len(blocks)] = torch.tensor(blocks)
            ctx = torch.tensor([r.position + 1 for r in decodes])
            mask = torch.arange(max_blocks * bs)[None, :] < ctx[:, None]
            meta.decode_block_tables = tables.to(self.device)
            meta.decode_mask = mask[:, None, None, :].to(self.device)

        input_ids = torch.tensor([token_ids], device=self.device)
        position_ids = torch.tensor([positions], device=self.device)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=torch.tensor(keep, dtype=torch.long, device=self.device),
            genserve_meta=meta,
        )
        return out.logits[0]
