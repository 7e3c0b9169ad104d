"""Structured-output coverage on real-world schemas (issue 14): JSONSchemaBench, per backend.

    python -m bench.structured_coverage [--quick] [--backends xgrammar auto ...]
                                        [--whitespace MODE] [--e2e N]

For every backend the server builds (``StructuredOutputs.backends``) and for AUTO, over the
committed sample in ``bench/data/jsonschemabench`` (see its README), with the default
model's tokenizer:

* **served**: the manager's ``factory(spec)`` returned and the first bitmask was filled
  with at least one allowed token, within ``--limit`` seconds (default 10). A schema past
  the limit counts as not served: its worker process is killed and replaced, so a slow
  compile never holds the bench (nor a core) past the limit;
* **time to first mask** (TTFM): wall time from ``factory(spec)`` to the first filled
  bitmask, the compile included (CPU seconds of the worker alongside); percentiles over the
  schemas served or timed out, a timeout counting as the limit, as JSONSchemaBench does;
* **per-step mask time**: every ``fill_bitmask`` of the instance checks;
* **instance acceptance**, MaskBench's method (``maskbench/maskbench/runner.py`` in
  JSONSchemaBench's repository; the paper's "compliance" is about generated outputs
  validating, which ``--e2e`` measures): each test instance is serialised compactly
  (``json.dumps(separators=(",", ":"), ensure_ascii=False)``, which every whitespace mode
  admits), tokenised with the model's tokenizer and fed token by token: at each step the
  bitmask is filled and the token must be allowed by it and accepted by the grammar; at
  the end EOS must be allowed. A valid instance failing that is *over-constraint*; an
  invalid instance passing it is *under-constraint*. Grammars emit (and accept) object
  properties in the schema's declaration order, which JSON Schema does not require, and
  MaskBench rewrites its data files into the order llguidance accepts
  (``maskbench/creation/reorder.py``): so a refused *valid* instance is tried again with
  every object's keys in the order the grammar under test accepts (``in_grammar_order``),
  and that share is reported beside the strict one. Invalid instances are never
  reordered.

``--e2e N`` also sends N sampled schemas in one ``GenerateBatch`` through a real
``genserve serve`` process on the default model (192 new tokens, greedy, AUTO) and reports
the share finished (EOS, not length) and the share of finished outputs that validate
(``jsonschema``), per whitespace mode when the proto has ``StructuredOutput.whitespace``.

Each backend runs in its own worker process (no shared caches between backends; a killed
worker is restarted for the next schema), warmed up first as a server is before its first
request (every backend compiles a trivial schema once, so compile worker processes are up);
schemas are interleaved across backends so the machine's load drifts alike for all of
them. Results: a table on stdout and
``bench/results/structured_coverage.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "jsonschemabench"
RESULTS = Path(__file__).parent / "results"
AUTO = "auto"  # structured.spec.AUTO, without importing torch into the parent
ROOT = Path(os.path.abspath(__file__)).parent.parent  # not resolved: a symlinked tree stays itself

# ---------------------------------------------------------------------------------------
# Compliance: one instance through one grammar (pure; the unit tests drive it directly)
# ---------------------------------------------------------------------------------------


def serialise(instance: Any) -> str:
    """Compact JSON: no free whitespace, so every whitespace mode admits it."""
    return json.dumps(instance, ensure_ascii=False, separators=(",", ":"))


def bit(row, token: int) -> bool:
    """Whether ``token`` is allowed in one int32 bitmask row (numpy or a list of ints)."""
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


@dataclass
class InstanceCheck:
    valid: bool  # what the dataset says the instance is
    tokens: int
    accepted: int  # leading tokens the mask allowed and the grammar accepted
    can_end: bool  # after every token: EOS allowed (or the grammar already terminated)
    disagreement: int = -1  # first token where the mask and accept_tokens disagreed; -1 none
    mask_s: list[float] = field(default_factory=list, repr=False)

    @property
    def grammar_accepts(self) -> bool:
        return self.accepted == self.tokens and self.can_end

    @property
    def correct(self) -> bool:
        """Valid and accepted, or invalid and rejected somewhere (or left unfinished)."""
        return self.grammar_accepts == self.valid


def check_instance(grammar, ids: Sequence[int], valid: bool, eos_ids: Iterable[int],
                   words: int, clock: Callable[[], float] = time.perf_counter
                   ) -> InstanceCheck:
    """Feed ``ids`` to a fresh ``structured.grammar.Grammar``: at each step fill the
    bitmask (timed) and require the token to be allowed by it *and* accepted by
    ``accept_tokens`` (what generation needs); stop at the first refusal. At the end, the
    grammar must allow EOS (or have terminated)."""
    import torch

    bitmask = torch.zeros(1, words, dtype=torch.int32)
    row = bitmask.numpy()[0]
    res = InstanceCheck(valid, len(ids), 0, False)
    for i, t in enumerate(ids):
        bitmask.zero_()
        t0 = clock()
        grammar.fill_bitmask(bitmask, 0)
        res.mask_s.append(clock() - t0)
        allowed = bit(row, t)
        if allowed:
            ok = grammar.accept_tokens([t])
        else:
            ok = grammar.validate_tokens([t]) == 1  # state unchanged either way
        if ok != allowed and res.disagreement < 0:
            res.disagreement = i
        if not (ok and allowed):
            return res
        res.accepted = i + 1
    if grammar.is_terminated():
        res.can_end = True
    else:
        bitmask.zero_()
        grammar.fill_bitmask(bitmask, 0)
        res.can_end = any(bit(row, e) for e in eos_ids)
    return res


def in_grammar_order(grammar, encode: Callable[[str], list[int]], value: Any) -> Any | None:
    """``value`` with every object's keys in the order ``grammar`` accepts them, found as
    MaskBench reorders its data files (``maskbench/creation/reorder.py``): the value is fed
    to the grammar piece by piece and, at each object, the next key is the first remaining
    one whose ``"key":value`` (the value reordered the same way) the grammar accepts and
    after which every other key that could have come here still can. None when that
    greedy walk finds no order. ``grammar`` is a fresh
    ``structured.grammar.Grammar``, left advanced: discard it after. JSON Schema ignores key
    order, but grammars emit (and so accept) properties in the schema's declaration order:
    a valid instance refused only for its key order is an artefact of the instance, not a
    constraint a generation would meet."""
    found = _walk(grammar, encode, value)
    return None if found is None else found[0]


def _walk(grammar, encode: Callable[[str], list[int]], value: Any) -> tuple[Any, int] | None:
    """Feed ``value``, keys reordered as the grammar accepts: (the reordered value, tokens
    fed), or None with the grammar's state as it was."""
    fed = 0

    def feed(text: str) -> bool:
        nonlocal fed
        ids = encode(text)
        if not grammar.accept_tokens(ids):  # refused: no state change
            return False
        fed += len(ids)
        return True

    def take(v: Any) -> tuple[Any, int] | None:  # v fed, reordered; None: nothing fed
        nonlocal fed
        sub = _walk(grammar, encode, v)
        if sub is None:
            return None
        fed += sub[1]
        return sub

    def accepts(text: str) -> bool:  # state unchanged
        ids = encode(text)
        return grammar.validate_tokens(ids) == len(ids)

    if isinstance(value, dict):
        out: dict[str, Any] = {}
        ok = feed("{")
        while ok and len(out) < len(value):
            sep = "," if out else ""
            here = [k for k in value if k not in out and accepts(sep + serialise(k) + ":")]
            for k in here:
                before = fed
                if (feed(sep + serialise(k) + ":") and (sub := take(value[k])) is not None
                        # as reorder.py: every other key possible here may still follow
                        and all(accepts("," + serialise(k2) + ":") for k2 in here if k2 != k)):
                    out[k] = sub[0]
                    break
                grammar.rollback(fed - before)
                fed = before
            else:
                ok = False
        result: Any = out
        ok = ok and feed("}")
    elif isinstance(value, list):
        items: list[Any] = []
        ok = feed("[")
        for i, v in enumerate(value):
            sub = take(v) if ok and (i == 0 or feed(",")) else None
            if sub is None:
                ok = False
                break
            items.append(sub[0])
        result = items
        ok = ok and feed("]")
    else:
        result, ok = value, feed(serialise(value))
    if not ok:
        grammar.rollback(fed)
        return None
    return result, fed


def check_value(new_grammar: Callable[[], Any], encode: Callable[[str], list[int]],
                value: Any, valid: bool, eos_ids: Iterable[int], words: int
                ) -> tuple[InstanceCheck, bool | None]:
    """One test instance: ``check_instance`` of its compact serialisation on a fresh grammar
    (the strict verdict), and for a *valid* instance refused so, whether it is accepted with
    its keys in the grammar's order (None when not retried: accepted as is, or invalid, as
    invalid instances are never reordered)."""
    eos_ids = list(eos_ids)
    strict = check_instance(new_grammar(), encode(serialise(value)), valid, eos_ids, words)
    if not valid or strict.grammar_accepts:
        return strict, None
    ordered = in_grammar_order(new_grammar(), encode, value)
    if ordered is None or serialise(ordered) == serialise(value):
        return strict, False
    again = check_instance(new_grammar(), encode(serialise(ordered)), True, eos_ids, words)
    return strict, again.grammar_accepts


# ---------------------------------------------------------------------------------------
# The sample
# ---------------------------------------------------------------------------------------


@dataclass
class Item:
    file: str
    subset: str
    schema: Any
    tests: list[dict]

    @property
    def schema_text(self) -> str:
        # what a client typically sends: json.dumps with its default separators
        return json.dumps(self.schema)


def load_sample(data_dir: Path = DATA, n: int | None = None, seed: int = 0) -> list[Item]:
    """The committed sample; ``n`` files of it (seeded, stratified like the sample itself:
    round-robin over subsets in a seeded order) when ``n`` is given."""
    manifest = json.loads((data_dir / "manifest.json").read_text())
    items = []
    for f in manifest["files"]:
        doc = json.loads((data_dir / f["file"]).read_text())
        items.append(Item(f["file"], f["subset"], doc["schema"], doc.get("tests") or []))
    if n is None or n >= len(items):
        return items
    rng = random.Random(seed)
    by_subset: dict[str, list[Item]] = {}
    for it in items:
        by_subset.setdefault(it.subset, []).append(it)
    for lst in by_subset.values():
        rng.shuffle(lst)
    order = sorted(by_subset)
    rng.shuffle(order)
    picked: list[Item] = []
    while len(picked) < n:
        for s in order:
            if by_subset[s] and len(picked) < n:
                picked.append(by_subset[s].pop())
    return sorted(picked, key=lambda it: it.file)


# ---------------------------------------------------------------------------------------
# Worker process: one per backend; JSON lines in on stdin, out on (a private) stdout
# ---------------------------------------------------------------------------------------


def tokenizer_info(model: str):
    """The tokenizer, the model's vocab size (its logits width) and EOS ids, without
    loading the weights: what ``LLMEngine`` hands ``StructuredOutputs``."""
    from transformers import AutoConfig

    from engine.loading.model_loader import hf_source, load_tokenizer, resolve_model

    source = resolve_model(model)
    tok = load_tokenizer(source)
    directory = hf_source(source).directory
    eos: set[int] = set()
    vocab = len(tok)
    try:
        cfg = AutoConfig.from_pretrained(directory)
        text_cfg = getattr(cfg, "get_text_config", lambda: cfg)()
        vocab = int(getattr(text_cfg, "vocab_size", None) or vocab)
        srcs: list[Any] = [cfg]
        try:
            from transformers import GenerationConfig

            srcs.append(GenerationConfig.from_pretrained(directory))
        except (OSError, ValueError):
            pass
        for src in srcs:
            e = getattr(src, "eos_token_id", None)
            if isinstance(e, int):
                eos.add(e)
            elif e:
                eos.update(e)
    except (OSError, ValueError):
        pass
    if tok.eos_token_id is not None:
        eos.add(tok.eos_token_id)
    return tok, vocab, sorted(eos)


def worker_main(args: argparse.Namespace) -> int:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to the log, not into the protocol

    def send(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")

    import asyncio
    import dataclasses

    import numpy as np
    import torch

    from structured.grammar import bitmask_words
    from structured.manager import StructuredConfig, StructuredOutputs
    from structured.spec import StructuredSpec

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    tok, vocab, eos = tokenizer_info(args.model)
    config = StructuredConfig()
    if args.max_spec_bytes:
        config.max_spec_bytes = args.max_spec_bytes
    so = StructuredOutputs(tok, vocab, eos, config)
    words = bitmask_words(vocab)
    has_ws = "whitespace" in {f.name for f in dataclasses.fields(StructuredSpec)}
    send({"ready": True, "setup_s": time.perf_counter() - t0, "backends": list(so.backends),
          "vocab_size": vocab, "eos": eos, "config": dataclasses.asdict(config),
          "whitespace_field": has_ws})
    loop = asyncio.new_event_loop()
    for line in sys.stdin:
        task = json.loads(line)
        if task.get("warmup"):
            # what a server has done before its first request: every backend's lazy set-up
            # (compile worker processes included) run once on a trivial schema
            w0, errors = time.perf_counter(), {}
            for name in so.backends:
                schema = json.dumps({"type": "object", "description": f"warm-up {name}"})
                try:
                    f = loop.run_until_complete(so.factory(StructuredSpec(
                        "json_schema", schema, name)))
                    f.create().grammar.fill_bitmask(torch.zeros(1, words, dtype=torch.int32), 0)
                except Exception as e:
                    errors[name] = f"{type(e).__name__}: {e}"[:300]
            send({"warm": True, "seconds": time.perf_counter() - w0, "errors": errors})
            continue
        extra = {"whitespace": task["whitespace"]} if has_ws and task["whitespace"] else {}
        spec = StructuredSpec("json_schema", task["schema"], task["backend"], **extra)
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            factory = loop.run_until_complete(so.factory(spec))
            proc = factory.create()
            bitmask = torch.zeros(1, words, dtype=torch.int32)
            proc.grammar.fill_bitmask(bitmask, 0)
        except Exception as e:  # ValueError: refused; anything else: a backend failure
            msg = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            send({"refused": msg[:1000], "seconds": time.perf_counter() - w0,
                  "exception": type(e).__name__})
            continue
        ttfm, cpu = time.perf_counter() - w0, time.process_time() - c0
        allowed = int(np.unpackbits(bitmask.numpy().view(np.uint8)).sum())
        factory.release(proc)
        def encode(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)

        send({"served": True, "backend": factory.backend, "ttfm_s": ttfm, "cpu_s": cpu,
              "first_allowed": allowed,
              "lenient": bool(getattr(factory, "lenient", False))})
        for k, test in enumerate(task["tests"]):
            procs: list[Any] = []  # every grammar this instance used, released after
            new_grammar = functools.partial(_fresh_grammar, factory, procs)
            try:
                r, reordered = check_value(new_grammar, encode, test["data"],
                                           bool(test["valid"]), eos, words)
                res = {"k": k, "valid": r.valid, "tokens": r.tokens, "accepted": r.accepted,
                       "can_end": r.can_end, "disagreement": r.disagreement,
                       "mask_us": [round(s * 1e6, 1) for s in r.mask_s],
                       "reordered_accepted": reordered}  # only the strict check is timed
            except Exception as e:  # a backend crash mid-instance: counted, not fatal
                res = {"k": k, "valid": bool(test["valid"]),
                       "tokens": len(encode(serialise(test["data"]))),
                       "error": f"{type(e).__name__}: {e}"[:500]}
            finally:
                for p in procs:
                    with contextlib.suppress(Exception):
                        factory.release(p)
            send({"instance": res})
        send({"done": True})
    return 0


def _fresh_grammar(factory, procs: list[Any]) -> Any:
    procs.append(factory.create())
    return procs[-1].grammar


class Worker:
    """A worker process and a reader thread that queues its lines."""

    def __init__(self, args: argparse.Namespace, log) -> None:
        cmd = [sys.executable, "-m", "bench.structured_coverage", "--worker",
               "--model", args.model]
        if args.max_spec_bytes:
            cmd += ["--max-spec-bytes", str(args.max_spec_bytes)]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
        # its own process group: the manager may run compiles in child processes of the
        # worker, and killing the worker must end them too
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log, text=True, bufsize=1, cwd=ROOT, env=env,
                                     start_new_session=True)
        self.lines: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self.recv(600)
        if not ready or not ready.get("ready"):
            self.kill()
            raise RuntimeError("a bench worker failed to start (see the worker log)")
        self.ready = ready
        self.send({"warmup": True})
        self.warm = self.recv(300) or {"warm": False, "seconds": None, "errors": {}}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        self.lines.put(None)

    def send(self, obj: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float) -> dict | None:
        """The next line, or None on timeout or exit."""
        try:
            return self.lines.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this worker leads
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


# ---------------------------------------------------------------------------------------
# The parent: drive the workers, aggregate
# ---------------------------------------------------------------------------------------


@dataclass
class SchemaResult:
    file: str
    subset: str
    status: str  # served | timeout | refused | crashed | too_big
    backend: str | None = None  # which backend served it (AUTO picks one)
    ttfm_s: float | None = None
    cpu_s: float | None = None
    error: str | None = None
    lenient: bool = False
    valid_total: int = 0
    valid_ok: int = 0
    valid_ok_reordered: int = 0  # valid_ok + refused ones accepted, keys in grammar order
    invalid_total: int = 0
    invalid_ok: int = 0
    untested: int = 0  # instances not checked (instance time limit, crash)
    disagreements: int = 0
    failures: list[dict] = field(default_factory=list)


def classify_refusal(msg: str) -> str:
    if "took longer than" in msg or "took too long" in msg:
        return "timeout"
    if "bytes; the limit" in msg:
        return "too_big"
    if "compiling used more than" in msg:
        return "memory_limit"
    return "refused"


def run_one(worker: Worker, item: Item, backend: str, args: argparse.Namespace,
            mask_us: list[float]) -> tuple[SchemaResult, bool]:
    """One schema on one backend's worker; returns the result and whether the worker is
    still usable."""
    res = SchemaResult(item.file, item.subset, "served")
    worker.send({"schema": item.schema_text, "backend": backend,
                 "whitespace": args.whitespace, "tests": item.tests})
    # the worker times the compile itself; the slack covers pipes and a busy machine
    msg = worker.recv(args.limit + 2.0)
    if msg is None:
        res.status, res.ttfm_s = ("timeout" if worker.proc.poll() is None else "crashed",
                                  args.limit)
        res.error = f"no first mask within {args.limit:g}s" if res.status == "timeout" \
            else f"worker exited with {worker.proc.returncode}"
        res.untested = len(item.tests)
        return res, False
    if "refused" in msg:
        res.status, res.error = classify_refusal(msg["refused"]), msg["refused"]
        res.untested = len(item.tests)
        if res.status == "timeout":
            res.ttfm_s = max(args.limit, msg["seconds"])
            return res, False  # the manager's compile thread may still be running: restart
        return res, True
    res.backend, res.ttfm_s, res.cpu_s = msg["backend"], msg["ttfm_s"], msg["cpu_s"]
    res.lenient = msg.get("lenient", False)
    if res.ttfm_s > args.limit:
        res.status, res.error = "timeout", f"first mask after {res.ttfm_s:.1f}s"
        res.untested = len(item.tests)
        # it did finish: drain its instance results without counting them
        deadline = time.monotonic() + args.instance_limit
        while (m := worker.recv(deadline - time.monotonic())) is not None and "done" not in m:
            pass
        return res, m is not None
    if msg["first_allowed"] == 0:
        res.status, res.error = "refused", "the first mask allows no token"
    deadline = time.monotonic() + args.instance_limit
    seen = 0
    while True:
        m = worker.recv(deadline - time.monotonic())
        if m is None:
            res.untested = len(item.tests) - seen
            res.error = (res.error or "") + f"instances: time limit {args.instance_limit:g}s"
            return res, False
        if "done" in m:
            return res, True
        r = m["instance"]
        seen += 1
        if "error" in r:
            res.untested += 1
            res.failures.append({"k": r["k"], "valid": r["valid"], "error": r["error"]})
            continue
        mask_us.extend(r["mask_us"])
        accepted = r["accepted"] == r["tokens"] and r["can_end"]
        if r["disagreement"] >= 0:
            res.disagreements += 1
        if r["valid"]:
            res.valid_total += 1
            res.valid_ok += accepted
            res.valid_ok_reordered += accepted or bool(r.get("reordered_accepted"))
        else:
            res.invalid_total += 1
            res.invalid_ok += not accepted
        if accepted != r["valid"]:
            res.failures.append({"k": r["k"], "valid": r["valid"], "tokens": r["tokens"],
                                 "accepted": r["accepted"], "can_end": r["can_end"],
                                 "reordered_accepted": r.get("reordered_accepted")})


def pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarise(backend: str, rows: list[SchemaResult], mask_us: list[float],
              limit: float) -> dict:
    n = len(rows)
    served = [r for r in rows if r.status == "served"]
    timed = [r.ttfm_s for r in rows if r.status in ("served", "timeout") and r.ttfm_s is not None]
    timed = [min(t, limit) for t in timed]
    by_status: dict[str, int] = {}
    for r in rows:
        by_status[r.status] = by_status.get(r.status, 0) + 1
    by_backend: dict[str, int] = {}
    for r in served:
        key = (r.backend or "?") + (" (lenient)" if r.lenient else "")
        by_backend[key] = by_backend.get(key, 0) + 1
    vt = sum(r.valid_total for r in served)
    it = sum(r.invalid_total for r in served)
    tested = [r for r in served if r.valid_total + r.invalid_total and not r.untested]
    return {
        "backend": backend, "schemas": n, "served": len(served),
        "served_share": len(served) / n if n else 0.0, "status": by_status,
        "served_by": by_backend,
        "ttfm_s": {"p50": pct(timed, 0.5), "p95": pct(timed, 0.95), "p99": pct(timed, 0.99),
                   "max": max(timed) if timed else None, "over_1s": sum(t > 1 for t in timed),
                   "n": len(timed)},
        "ttfm_cpu_s_p50": pct([r.cpu_s for r in served if r.cpu_s is not None], 0.5),
        "mask_us": {"p50": pct(mask_us, 0.5), "p95": pct(mask_us, 0.95),
                    "p99": pct(mask_us, 0.99), "max": max(mask_us) if mask_us else None,
                    "mean": statistics.fmean(mask_us) if mask_us else None,
                    "steps": len(mask_us)},
        "valid": {"total": vt, "accepted": sum(r.valid_ok for r in served),
                  "share": sum(r.valid_ok for r in served) / vt if vt else None,
                  "accepted_in_grammar_order": sum(r.valid_ok_reordered for r in served),
                  "share_in_grammar_order": sum(r.valid_ok_reordered for r in served) / vt
                  if vt else None},
        "invalid": {"total": it, "rejected": sum(r.invalid_ok for r in served),
                    "share": sum(r.invalid_ok for r in served) / it if it else None},
        "schemas_over_constrained": sum(r.valid_ok < r.valid_total for r in served),
        "schemas_under_constrained": sum(r.invalid_ok < r.invalid_total for r in served),
        "schemas_fully_compliant": sum(r.valid_ok == r.valid_total
                                       and r.invalid_ok == r.invalid_total for r in tested),
        "untested_instances": sum(r.untested for r in served),
        "mask_accept_disagreements": sum(r.disagreements for r in served),
    }


def fmt_s(x: float | None, limit: float) -> str:
    if x is None:
        return "-"
    if x >= limit:
        return f">={limit:g}s"
    return f"{x * 1000:.0f}ms" if x < 10 else f"{x:.1f}s"


def fmt_share(num: int, den: int) -> str:
    return f"{num}/{den} {num / den:6.1%}" if den else "-"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def print_table(summaries: list[dict], limit: float) -> None:
    print(f"\n{'backend':20} {'served':>13} {'t/o':>4} {'TTFM p50':>9} {'p95':>8} {'p99':>8} "
          f"{'max':>8} {'>1s':>4} {'mask p50':>9} {'p99':>8}  {'valid accepted':>16} "
          f"{'(grammar key order)':>19}  {'invalid rejected':>16}  {'full':>4}")
    for s in summaries:
        t, m = s["ttfm_s"], s["mask_us"]
        mk = ("-" if m["p50"] is None else f"{m['p50']:.0f}us",
              "-" if m["p99"] is None else f"{m['p99']:.0f}us")
        print(f"{s['backend']:20} {fmt_share(s['served'], s['schemas']):>13} "
              f"{s['status'].get('timeout', 0):4} {fmt_s(t['p50'], limit):>9} "
              f"{fmt_s(t['p95'], limit):>8} {fmt_s(t['p99'], limit):>8} "
              f"{fmt_s(t['max'], limit):>8} {t['over_1s']:4} {mk[0]:>9} {mk[1]:>8}  "
              f"{fmt_share(s['valid']['accepted'], s['valid']['total']):>16} "
              f"{fmt_share(s['valid']['accepted_in_grammar_order'], s['valid']['total']):>19}  "
              f"{fmt_share(s['invalid']['rejected'], s['invalid']['total']):>16}  "
              f"{s['schemas_fully_compliant']:4}")
    for s in summaries:
        extra = ", ".join(f"{k} {v}" for k, v in sorted(s["status"].items()) if k != "served")
        by = ", ".join(f"{k} {v}" for k, v in sorted(s["served_by"].items()))
        print(f"  {s['backend']}: served by {by or '-'}; not served: {extra or 'none'}; "
              f"{s['schemas_over_constrained']} schemas over-constrained, "
              f"{s['schemas_under_constrained']} under-constrained; "
              f"{s['mask_accept_disagreements']} mask/accept disagreements; "
              f"{s['untested_instances']} instances untested")


def targets(summaries: list[dict]) -> dict[str, bool]:
    auto = next((s for s in summaries if s["backend"] == AUTO), None)
    if auto is None:
        return {}
    t = auto["ttfm_s"]
    return {
        "AUTO serves >= 98% of sampled schemas": auto["served_share"] >= 0.98,
        "AUTO p99 time to first mask <= 1 s": t["p99"] is not None and t["p99"] <= 1.0,
        # fed as MaskBench feeds its data: keys in the order the grammar accepts
        "AUTO accepts >= 99% of valid instances (keys in the grammar's order)":
            (auto["valid"]["share_in_grammar_order"] or 0) >= 0.99,
    }


def coverage(args: argparse.Namespace, items: list[Item]) -> dict:
    RESULTS.mkdir(parents=True, exist_ok=True)
    log_path = RESULTS / "structured_coverage.worker.log"
    with log_path.open("w") as log:
        first = Worker(args, log)
        available = first.ready["backends"] + [AUTO]
        backends = args.backends or available
        unknown = [b for b in backends if b not in available]
        if unknown:
            first.kill()
            raise SystemExit(f"unknown backend(s) {unknown}; this tree has {available}")
        workers: dict[str, Worker | None] = dict.fromkeys(backends)
        workers[backends[0]] = first
        rows: dict[str, list[SchemaResult]] = {b: [] for b in backends}
        masks: dict[str, list[float]] = {b: [] for b in backends}
        restarts = dict.fromkeys(backends, 0)
        warmups: dict[str, list] = {b: [] for b in backends}
        warmups[backends[0]].append(first.warm)
        t_start = time.perf_counter()
        try:
            for i, item in enumerate(items):
                for b in backends:
                    w = workers[b]
                    if w is None:
                        w = workers[b] = Worker(args, log)
                        warmups[b].append(w.warm)
                    res, usable = run_one(w, item, b, args, masks[b])
                    rows[b].append(res)
                    if not usable:  # killed: the next schema starts a fresh worker
                        w.kill()
                        workers[b] = None
                        restarts[b] += 1
                if args.verbose or (i + 1) % 20 == 0:
                    line = ", ".join(f"{b} {sum(r.status == 'served' for r in rows[b])}"
                                     for b in backends)
                    print(f"[{i + 1}/{len(items)} {time.perf_counter() - t_start:.0f}s] "
                          f"served: {line}", file=sys.stderr, flush=True)
        finally:
            for w in workers.values():
                if w is not None:
                    w.kill()
    summaries = [summarise(b, rows[b], masks[b], args.limit) for b in backends]
    for s in summaries:
        s["worker_kills"] = restarts[s["backend"]]
        s["worker_warmups"] = warmups[s["backend"]]
    return {"summaries": summaries, "schemas": {b: [asdict(r) for r in rows[b]]
                                                for b in backends},
            "worker": {k: first.ready[k] for k in ("vocab_size", "eos", "config",
                                                    "whitespace_field", "setup_s")},
            "seconds": time.perf_counter() - t_start}


# ---------------------------------------------------------------------------------------
# End to end: GenerateBatch through a real server
# ---------------------------------------------------------------------------------------

PROMPT = ("Give one realistic example of a JSON value that matches this JSON schema. "
          "Answer with the JSON only.\nSchema: {schema}")
MAX_PROMPT_SCHEMA_CHARS = 4000


def e2e_prompt(schema_text: str) -> str:
    if len(schema_text) > MAX_PROMPT_SCHEMA_CHARS:  # the grammar carries the whole schema
        schema_text = schema_text[:MAX_PROMPT_SCHEMA_CHARS] + " ... (truncated)"
    return PROMPT.format(schema=schema_text)


def validation_error(schema: Any, text: str) -> str | None:
    """None when ``text`` is JSON valid against ``schema`` (formats checked), else why."""
    import jsonschema

    try:
        value = json.loads(text)
        cls = jsonschema.validators.validator_for(schema)
        cls(schema, format_checker=cls.FORMAT_CHECKER).validate(value)
        return None
    except jsonschema.ValidationError as e:
        return f"{e.message[:200]} at {list(e.absolute_path)[:8]}"
    except ValueError as e:
        return f"not JSON: {e}"
    except Exception as e:  # a schema jsonschema cannot handle (bad $ref...)
        return f"{type(e).__name__}: {e}"[:200]


def e2e(args: argparse.Namespace, items: list[Item]) -> dict:
    import grpc

    from bench.server import free_port, start_server_process
    from genserve.v1 import generation_pb2 as pb
    from genserve.v1 import generation_pb2_grpc as pb_grpc

    chosen = load_sample(n=args.e2e, seed=args.seed + 1)  # drawn from the whole sample
    has_ws = "whitespace" in pb.StructuredOutput.DESCRIPTOR.fields_by_name
    # (label, value to set): the server's default only, unless the proto has the field
    modes: list[tuple[str, Any]] = [("default", None)]
    if has_ws:
        field_ = pb.StructuredOutput.DESCRIPTOR.fields_by_name["whitespace"]
        if field_.enum_type is not None:  # an enum: every named mode, unset = default
            modes = [(v.name, v.number) for v in field_.enum_type.values]
        else:  # a string
            modes = [("default", None)] + [(m, m) for m in ("compact", "single", "flexible")]
        if args.e2e_whitespace:  # e.g. ["compact", "single", "flexible"]: skip the unset one
            modes = [(label, v) for label, v in modes
                     if any(label.lower().endswith(w.lower()) for w in args.e2e_whitespace)]
    RESULTS.mkdir(parents=True, exist_ok=True)
    port = free_port()
    # eager: the decode step's background compile would take minutes of this CPU and does
    # not change what the grammar lets through
    server = start_server_process(args.model, port, RESULTS / "structured_coverage.server.log",
                                  "torch", ["--enforce-eager"])
    out: dict[str, Any] = {"schemas": [it.file for it in chosen], "new_tokens": args.e2e_tokens,
                           "modes": {}, "whitespace_field": has_ws}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            for mode, value in modes:
                reqs = []
                for it in chosen:
                    so = pb.StructuredOutput(json_schema=it.schema_text)
                    if value is not None:
                        # by name: the field is newer than this bench
                        setattr(so, "whitespace", value)  # noqa: B010
                    reqs.append(pb.GenerateRequest(
                        chat=pb.ChatMessages(messages=[pb.ChatMessage(
                            role="user", content=e2e_prompt(it.schema_text))],
                            add_generation_prompt=True),
                        stopping=pb.StoppingCriteria(max_new_tokens=args.e2e_tokens),
                        structured_output=so))
                t0 = time.perf_counter()
                resp = stub.GenerateBatch(pb.GenerateBatchRequest(requests=reqs), timeout=3600)
                seconds = time.perf_counter() - t0
                rows = []
                for r in resp.results:
                    it = chosen[r.index]
                    if r.WhichOneof("outcome") == "error":
                        rows.append({"file": it.file, "outcome": "error",
                                     "error": r.error.message[:300]})
                        continue
                    c = r.response.completions[0]
                    reason = pb.FinishReason.Name(c.finish_reason)
                    why = (validation_error(it.schema, c.text)
                           if c.finish_reason == pb.FINISH_REASON_EOS else None)
                    rows.append({"file": it.file, "outcome": reason,
                                 "backend": getattr(r.response, "structured_backend", ""),
                                 "error": c.error[:300],
                                 "tokens": r.response.usage.completion_tokens,
                                 "valid": why is None
                                 if c.finish_reason == pb.FINISH_REASON_EOS else None,
                                 "invalid_because": why, "text": c.text})
                n = len(rows)
                fin = [r for r in rows if r["outcome"] == "FINISH_REASON_EOS"]
                outcomes: dict[str, int] = {}
                for r in rows:
                    outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
                served_by: dict[str, int] = {}
                for r in rows:
                    if r.get("backend"):
                        served_by[r["backend"]] = served_by.get(r["backend"], 0) + 1
                out["modes"][mode] = {
                    "requests": n, "seconds": seconds, "outcomes": outcomes,
                    "served_by": served_by,
                    "errors": sum(r["outcome"] == "error" for r in rows),
                    "length": sum(r["outcome"] == "FINISH_REASON_LENGTH" for r in rows),
                    "finished": len(fin), "finished_share": len(fin) / n if n else 0.0,
                    "valid_of_finished": (sum(bool(r["valid"]) for r in fin) / len(fin))
                    if fin else None,
                    "rows": rows}
    finally:
        server.proc.terminate()
        try:
            server.proc.wait(60)
        except subprocess.TimeoutExpired:
            server.proc.kill()
    return out


def print_e2e(res: dict) -> None:
    print(f"\nend to end (GenerateBatch of {len(res['schemas'])} schemas, "
          f"{res['new_tokens']} new tokens, AUTO, greedy):")
    for mode, m in res["modes"].items():
        v = m["valid_of_finished"]
        other = {k: c for k, c in m["outcomes"].items()
                 if k not in ("FINISH_REASON_EOS", "FINISH_REASON_LENGTH", "error")}
        print(f"  whitespace {mode:36}: {m['finished']}/{m['requests']} finished "
              f"({m['finished_share']:.0%}), {m['length']} cut by length, {m['errors']} refused"
              f"{'; other ' + str(other) if other else ''}; valid among finished "
              f"{'-' if v is None else f'{v:.0%}'} ({m['seconds']:.0f}s)"
              f"{'; served by ' + str(m['served_by']) if m['served_by'] else ''}")
    for mode, m in res["modes"].items():
        for r in m["rows"]:
            if r["outcome"] == "error":
                print(f"    {mode} refused {r['file']}: {r['error'][:160]}")
            elif r.get("invalid_because"):
                print(f"    {mode} INVALID {r['file']}: {r['invalid_because'][:160]}")


# ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a seeded, stratified 30 schemas and shorter limits (smoke run)")
    ap.add_argument("--n", type=int, default=None, help="schemas to use (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backends", nargs="+", default=None,
                    help="backends to run (default: every one the server builds, and auto)")
    ap.add_argument("--whitespace", default=None,
                    help="StructuredSpec.whitespace for the grammar part (default: the "
                         "spec's default)")
    ap.add_argument("--limit", type=float, default=10.0,
                    help="seconds a schema may take to its first mask (killed past it)")
    ap.add_argument("--instance-limit", type=float, default=60.0,
                    help="seconds for one schema's instance checks")
    ap.add_argument("--max-spec-bytes", type=int, default=None,
                    help="override StructuredConfig.max_spec_bytes (default: the server's)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--e2e", type=int, default=0, metavar="N",
                    help="also run N sampled schemas through a real server (GenerateBatch)")
    ap.add_argument("--e2e-tokens", type=int, default=192)
    ap.add_argument("--e2e-whitespace", nargs="+", default=None, metavar="MODE",
                    help="whitespace modes for --e2e (default: every one, and unset)")
    ap.add_argument("--e2e-only", action="store_true",
                    help="skip the grammar part (with --e2e)")
    ap.add_argument("--out", type=Path, default=RESULTS / "structured_coverage.json")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.n = args.n or 30
        args.instance_limit = min(args.instance_limit, 20.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    run(args)
    return 0


def run(args: argparse.Namespace | list[str]) -> dict:
    """The whole bench (``make bench`` calls it with ``["--quick"]``); prints and writes the
    results, and returns them."""
    if not isinstance(args, argparse.Namespace):
        args = parse_args(args)
    items = load_sample(n=args.n, seed=args.seed)
    load = os.getloadavg()
    print(f"structured coverage: {len(items)} JSONSchemaBench schemas "
          f"({sum(len(i.tests) for i in items)} instances), limit {args.limit:g}s to first "
          f"mask; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on "
          f"{os.cpu_count()} cores", file=sys.stderr)
    res: dict[str, Any] = (coverage(args, items) if not args.e2e_only
                           else {"summaries": [], "seconds": 0.0})
    res.update({"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "schemas_n": len(items), "limit_s": args.limit,
                "instance_limit_s": args.instance_limit, "whitespace": args.whitespace,
                "load_before": load, "load_after": os.getloadavg(),
                "cpu_count": os.cpu_count(), "versions": versions()})
    print(f"\nJSONSchemaBench coverage: {len(items)} schemas, "
          f"{sum(len(i.tests) for i in items)} instances; whitespace "
          f"{args.whitespace or 'default'}; load {load[0]:.2f} before, "
          f"{res['load_after'][0]:.2f} after ({res['seconds']:.0f}s)")
    if res["summaries"]:
        print_table(res["summaries"], args.limit)
    res["targets"] = targets(res["summaries"])
    if args.e2e:
        res["e2e"] = e2e(args, items)
        print_e2e(res["e2e"])
    for name, ok in res["targets"].items():
        print(f"  [{'met' if ok else 'MISSED'}] {name}")
    for s in res["summaries"]:
        if s["backend"] == AUTO and s["valid"]["total"]:
            print(f"  (AUTO, valid instances strictly, keys as the data orders them: "
                  f"{fmt_share(s['valid']['accepted'], s['valid']['total'])})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"\nwrote {args.out}")
    return res


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("xgrammar", "llguidance", "lm-format-enforcer", "transformers", "torch"):
        with contextlib.suppress(PackageNotFoundError):
            out[pkg] = version(pkg)
    return out


if __name__ == "__main__":
    sys.exit(main())
