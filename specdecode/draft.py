"""A draft model proposes k tokens per sequence by running k single-token steps itself.

The draft is any HF causal LM with the target's vocabulary, loaded with the same paged
attention, with its own KV cache of as many blocks as the target's: it reuses each
sequence's block table (the scheduler reserved blocks for the proposals before asking), so
the draft owns no blocks and keeps only how much of each sequence it has cached. ``self:N``
builds it from the target's own first N decoder layers plus its final norm and head: no
extra weights, only a KV cache of N layers.

Each round first catches the draft cache up with the sequence (the tokens accepted since
the last round, or the whole prompt the first time) in one packed forward that also yields
the first proposal, then runs k - 1 decode steps. Proposals are drawn from the draft's
distribution q under the request's own sampling treatment (argmax for greedy requests). A
seeded row draws them by inverse CDF from the very uniforms the target will use at those
output positions, so verification accepts exactly the proposals plain sampling would emit
and the output stays the seed's; an unseeded sampled row draws them from a stream of its
own, and its q is returned for exact rejection sampling (the better acceptance). Draft KV
of rejected proposals is overwritten later.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from engine.config import EngineConfig
from engine.counter_rng import DRAFT
from engine.runners.base import DecodeRow, PrefillWork, Runner
from engine.runners.torch import ModelRunner
from engine.sampler import SamplingMetadata, compute_probs, row_argmax, sample_from_probs
from engine.sequence import Sequence
from specdecode.config import SpeculativeConfig

log = logging.getLogger(__name__)


@dataclass
class _DraftSeq:
    epoch: int  # the sequence's preemption count: its blocks were refilled since
    num_computed: int = 0  # leading tokens of the sequence (+ proposals) in the draft cache
    base: int = 0  # the sequence's length when the last proposals were made
    proposals: list[int] = field(default_factory=list)


def samples_freely(seq: Sequence) -> bool:
    """Whether the draft samples this sequence's proposals with randomness of its own (an
    unseeded sampled request) rather than from the target's own per-position draws."""
    params = seq.request.params
    return params.temperature > 0 and params.seed is None


def truncated_model(model: Any, num_layers: int) -> Any:
    """The target's first ``num_layers`` decoder layers under its own norm and head, as a
    model object sharing every weight with the target (shallow copies, no tensor copied)."""
    inner = model.get_decoder()
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"self-draft: cannot find the decoder layers of {type(model).__name__}")
    if not 1 <= num_layers < len(layers):
        raise ValueError(f"self:N needs 1 <= N < {len(layers)} (the target's layers), "
                         f"got {num_layers}")
    config = copy.copy(model.config)
    config.num_hidden_layers = num_layers
    draft_inner = copy.copy(inner)
    draft_inner._modules = dict(inner._modules)
    draft_inner.layers = torch.nn.ModuleList(list(layers)[:num_layers])
    draft_inner.config = config
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    for name, module in model._modules.items():
        if module is inner:
            draft._modules[name] = draft_inner
    draft.config = config
    return draft


def _draft_runner(target: Runner, spec: SpeculativeConfig) -> ModelRunner:
    name = spec.draft_model or ""
    config = EngineConfig(model=name, max_model_len=target.max_model_len,
                          block_size=target.block_size, device=str(target.device),
                          dtype=str(target.dtype).removeprefix("torch."))
    num_blocks = target.num_blocks
    if name.startswith("self:"):
        try:
            n = int(name.removeprefix("self:"))
        except ValueError:
            raise ValueError(f"--spec-draft-model {name!r}: expected self:N with N an "
                             f"integer number of layers") from None
        if not isinstance(target, ModelRunner):
            raise ValueError(f"--spec-draft-model {name}: a self-draft runs the target's own "
                             f"torch layers; the {target.name} runner has none (use --runner "
                             f"torch, --spec-method ngram, or a separate draft model)")
        if target.tp is not None:
            raise ValueError(f"--spec-draft-model {name}: a self-draft would run the "
                             f"target's sharded layers on rank 0 alone; with "
                             f"--tensor-parallel-size use --spec-method ngram or a separate "
                             f"draft model (it runs unsharded on rank 0)")
        shared = SimpleNamespace(device=target.device, dtype=target.dtype,
                                 tokenizer=target.tokenizer, model_id=f"{target.model_id}[:{n}]",
                                 model=truncated_model(target.model, n),
                                 _forward_lock=target._forward_lock)  # its layers' adapter writes
        return ModelRunner(config, shared, num_blocks=num_blocks)  # type: ignore[arg-type]
    runner = ModelRunner(config, num_blocks=num_blocks)
    if runner.vocab_size != target.vocab_size:
        raise ValueError(f"draft model {name!r} has a vocabulary of {runner.vocab_size} "
                         f"tokens; the target has {target.vocab_size}")
    if runner.max_model_len < target.max_model_len:
        log.warning("draft model %s has a shorter context (%d) than the target (%d): "
                    "sequences past it are not speculated", name, runner.max_model_len,
                    target.max_model_len)
    return runner


class DraftProposer:
    def __init__(self, target: Runner, spec: SpeculativeConfig) -> None:
        self.runner = _draft_runner(target, spec)
        self.states: dict[int, _DraftSeq] = {}
        log.info("draft model %s ready", self.runner.model_id)

    def release(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)

    def _state(self, seq: Sequence) -> _DraftSeq:
        """The sequence's draft state, trimmed to what is still right in the draft cache."""
        st = self.states.get(seq.seq_id)
        if st is None or st.epoch != seq.num_preemptions:
            st = self.states[seq.seq_id] = _DraftSeq(seq.num_preemptions)
        if st.proposals:
            actual = seq.tokens(st.base, min(seq.num_tokens, st.base + len(st.proposals)))
            same = next((i for i, (a, b) in enumerate(zip(actual, st.proposals, strict=False))
                         if a != b), len(actual))
            st.num_computed = min(st.num_computed, st.base + same)
            st.proposals = []
        return st

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_tokens: list[int]
                ) -> tuple[list[list[int]], dict[int, torch.Tensor]]:
        """Proposals per sequence and, by batch index, the ``[k, vocab]`` draft
        distributions of the ones sampled freely (``samples_freely``)."""
        out: list[list[int]] = [[] for _ in seqs]
        budget = [min(m, self.runner.max_model_len - s.num_tokens)
                  for s, m in zip(seqs, max_tokens, strict=True)]
        active = [(i, seq, self._state(seq)) for i, seq in enumerate(seqs) if budget[i] > 0]
        if not active:
            return out, {}
        k = max(budget[i] for i, _, _ in active)
        free = [i for i, seq, _ in active if samples_freely(seq)]
        q = (torch.zeros(len(seqs), k, self.runner.vocab_size, device=self.runner.device)
             if free else None)
        # Step 0: catch up (decode rows for one missing token, prefill chunks for more).
        decodes, prefills, decode_rows, prefill_rows = [], [], [], []
        for i, seq, st in active:
            missing = seq.tokens(st.num_computed, seq.num_tokens)
            if len(missing) == 1:
                decodes.append(DecodeRow(missing[0], st.num_computed, seq.block_table))
                decode_rows.append((i, seq, st))
            else:
                prefills.append(PrefillWork(missing, st.num_computed, seq.block_table, True))
                prefill_rows.append((i, seq, st))
        rows = decode_rows + prefill_rows  # the order of the logits rows
        logits = self.runner.execute(decodes, prefills)
        for j in range(k):
            tokens = self._draw(rows, out, logits, q, j)
            for (i, _, _), t in zip(rows, tokens, strict=True):
                out[i].append(t)
            rows = [r for r in rows if len(out[r[0]]) < budget[r[0]]]
            if not rows or j == k - 1:
                break
            decodes = [DecodeRow(out[i][-1], seq.num_tokens + j, seq.block_table)
                       for i, seq, _ in rows]
            logits = self.runner.execute(decodes, [])
        for i, seq, st in active:
            st.base = seq.num_tokens
            st.proposals = list(out[i])
            st.num_computed = seq.num_tokens + len(out[i]) - 1
        return out, {i: q[i] for i in free} if q is not None else {}

    def _draw(self, rows, out: list[list[int]], logits: torch.Tensor, q: torch.Tensor | None,
              j: int) -> list[int]:
        """One token per row from the draft's distribution under the request's sampling
        treatment (penalties over the prefix so far), at the row's next output position;
        greedy rows take the argmax."""
        seqs = [seq for _, seq, _ in rows]
        if all(s.request.params.temperature == 0 for s in seqs):
            return row_argmax(logits).tolist()
        meta = SamplingMetadata.build(
            [s.request.params for s in seqs], [s.prompt_token_ids for s in seqs],
            [s.output_token_ids + out[i] for i, s, _ in rows],
            [s.sampling_key for s in seqs], [[] for _ in seqs], logits.device)
        probs = compute_probs(logits, meta)
        u = meta.uniforms()
        free = [r for r, s in enumerate(seqs) if samples_freely(s)]
        if free:
            assert q is not None
            u[free] = meta.uniforms(free, DRAFT)
            where = torch.tensor([rows[r][0] for r in free], device=q.device)
            q[where, j] = probs[torch.tensor(free, device=probs.device)]
        return sample_from_probs(probs, u).tolist()
