"""Where each scheduled sequence's tokens and logits rows sit in one step's forward.

Every scheduled sequence contributes ``1 + m`` logits rows (``m`` = its speculative
proposals; 0 for plain decodes and sampled prefill chunks) or none (a prefill chunk that
does not reach its last token). The runner returns decode rows first, then prefill rows;
the layout is built once per step and answers every later question by row range.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.outputs import TokenLogprob
from engine.runners.base import DecodeRow, PrefillWork
from engine.sampler import LogprobTable, token_logprobs
from engine.scheduler import ScheduledSeq
from engine.sequence import Request, Sequence
from engine.speculation import Speculator


@dataclass
class RowView:
    """One logits row as processors and penalties see it: the sequence, with the ``j``
    proposals before this row appended to its output."""

    seq: Sequence
    output_token_ids: list[int]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.prompt_token_ids


@dataclass
class Entry:
    seq: Sequence
    num_tokens: int  # computed this step
    proposals: list[int]
    rows: range = field(default_factory=lambda: range(0))  # its logits rows


@dataclass
class PromptRows:
    """Logits rows of a prompt-logprob request's prefill chunk: positions ``positions``
    (each scoring the prompt token after it), returned after the step's sampled rows."""

    request: Request
    positions: range


@dataclass
class StepLayout:
    entries: list[Entry]  # in logits-row order; entries without rows last
    decodes: list[DecodeRow]
    prefills: list[PrefillWork]
    views: list[RowView]  # one per logits row
    prompt_rows: list[PromptRows] = field(default_factory=list)  # rows after ``views``

    @classmethod
    def build(cls, scheduled: list[ScheduledSeq], proposals: dict[int, list[int]],
              speculator: Speculator | None) -> StepLayout:
        decoded: list[tuple[Entry, int]] = []
        prefilled: list[tuple[Entry, int]] = []
        unsampled: list[Entry] = []
        decodes: list[DecodeRow] = []
        prefills: list[PrefillWork] = []
        prompt_rows: list[PromptRows] = []
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            entry = Entry(seq, s.num_tokens, proposals.get(seq.seq_id, []))
            if entry.proposals:
                assert speculator is not None
                d, p = speculator.score_work(seq, entry.proposals)
                for drow in d:  # the target's verify rows run the request's adapter
                    drow.adapter_slot = seq.request.adapter_slot
                for work in p:
                    work.adapter_slot = seq.request.adapter_slot
                decodes.extend(d)
                prefills.extend(p)
                (decoded if d else prefilled).append((entry, len(entry.proposals) + 1))
            elif s.samples and s.num_tokens == 1:
                decodes.append(DecodeRow(seq.token_at(start), start, seq.block_table,
                                         seq.seq_id, seq.request.adapter_slot))
                decoded.append((entry, 1))
            else:
                work = PrefillWork(seq.tokens(start, start + s.num_tokens), start,
                                   seq.block_table, s.samples, seq_id=seq.seq_id,
                                   adapter_slot=seq.request.adapter_slot,
                                   seq_len=seq.num_tokens)
                positions = _prompt_positions(seq, start, start + s.num_tokens)
                if positions:
                    work.prompt_rows = range(positions.start - start, positions.stop - start)
                    prompt_rows.append(PromptRows(seq.request, positions))
                prefills.append(work)
                if s.samples:
                    prefilled.append((entry, 1))
                else:
                    unsampled.append(entry)
        entries: list[Entry] = []
        views: list[RowView] = []
        row = 0
        for entry, n in decoded + prefilled:
            entry.rows = range(row, row + n)
            row += n
            entries.append(entry)
            out = entry.seq.output_token_ids
            views.extend(RowView(entry.seq, out + entry.proposals[:j] if j else out)
                         for j in range(n))
        return cls(entries + unsampled, decodes, prefills, views, prompt_rows)

    @property
    def sampled(self) -> list[Entry]:
        return [e for e in self.entries if e.rows]

    def record_prompt_logprobs(self, logits: torch.Tensor) -> None:
        """Append each prompt-logprob chunk's tokens to its request (``logits``: the rows
        after ``views``, in ``prompt_rows`` order), one device copy for the step."""
        targets = [r.request.prompt_token_ids[p + 1] for r in self.prompt_rows
                   for p in r.positions]
        k = max(r.request.params.prompt_logprobs or 0 for r in self.prompt_rows)
        table = token_logprobs(logits, torch.tensor(targets), k)
        row = 0
        for r in self.prompt_rows:
            kk = r.request.params.prompt_logprobs or 0
            out = r.request.prompt_logprobs
            assert out is not None
            for _ in r.positions:
                out.append(_token_logprob(targets[row], table, row, kk))
                row += 1

    @staticmethod
    def logprobs(entries: list[Entry], emitted: list[list[int]], logits: torch.Tensor
                 ) -> list[list[TokenLogprob] | None]:
        """Logprobs of every emitted token under the row that chose it (after the
        processors, before penalties), for the requests that ask; one device copy."""
        out: list[list[TokenLogprob] | None] = [None] * len(entries)
        want = [i for i, e in enumerate(entries)
                if e.seq.request.params.logprobs or e.seq.request.params.top_logprobs]
        if not want:
            return out
        rows = [r for i in want for r in entries[i].rows[:len(emitted[i])]]
        k = max(entries[i].seq.request.params.top_logprobs for i in want)
        table = token_logprobs(logits[torch.tensor(rows, device=logits.device)],
                               torch.tensor([t for i in want for t in emitted[i]]), k)
        r = 0
        for i in want:
            kk = entries[i].seq.request.params.top_logprobs
            lps = out[i] = []
            for t in emitted[i]:
                lps.append(_token_logprob(t, table, r, kk))
                r += 1
        return out


def _token_logprob(token_id: int, table: LogprobTable, row: int, k: int) -> TokenLogprob:
    return TokenLogprob(token_id, table.chosen[row],
                        list(zip(table.top_ids[row][:k], table.top_lps[row][:k], strict=True)),
                        table.ranks[row])


def _prompt_positions(seq: Sequence, start: int, end: int) -> range:
    """Positions of a prefill chunk ``[start, end)`` whose logits score a prompt token not
    yet recorded (the first sequence of a request that asked for prompt logprobs)."""
    req = seq.request
    if req.prompt_logprobs is None or seq.index != 0:
        return range(0)
    first = max(start, len(req.prompt_logprobs))
    last = min(end, len(req.prompt_token_ids) - 1)
    return range(first, max(first, last))
