"""Prefix caching in ``make bench``: a ``genserve serve`` with caching on against one with
it off (``--no-enable-prefix-caching``), same runner, all up at once and measured in
alternating rounds (each ratio the median over rounds of that round's pair), for the
llama.cpp runner (the default on a CPU) and the torch runner:

- a 1,500-token shared system prompt followed by distinct 20-token questions: time to the
  first token on a hit (the system prompt cached) against a miss (a system prompt not seen
  before), one client; and 16 concurrent clients over that workload, tokens/s with caching
  on against off;
- an 8-turn chat (``chat`` messages; each turn resends the whole history with the previous
  answers): total time with caching on against off;
- traffic with no shared prefix at all (every prompt differs from its first token): 16
  concurrent clients, tokens/s with caching on against off (what caching costs when it
  never hits), beside an A/A control: a second caching-off server against the first, in
  the same rounds (two identical servers have differed by 6-9% here, more than this row's
  3% target; the control says how much of a miss is that);
- beside them, llama.cpp's own prompt reuse (``Llama.generate`` keeps the longest common
  prefix of its one context's previous tokens): TTFT on a hit against a miss.

Every round uses prompts no earlier round used (a session number leads each one), so the
caching server never hits on a previous round's work. ``python -m bench.prefix [--quick]
[--runner llamacpp|torch]``; ``make bench`` runs both runners.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from bench.measure import RESULTS
from bench.server import _timed_clients, free_port, start_server_process
from engine.loading.model_loader import load_tokenizer, resolve_model
from engine.runners.llamacpp import default_threads
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc

RULES = [
    "Greet the customer by name when it is known, and keep the answer short.",
    "Name the aisle of every product you mention; aisles are numbered from the entrance.",
    "Never promise a delivery date; say that the warehouse confirms it by e-mail.",
    "Paint is mixed to order at the counter in aisle 4 and takes ten minutes.",
    "Refunds need the receipt and are paid to the card that paid for the goods.",
    "Power tools can be rented by the day; a deposit of fifty pounds is taken.",
    "When you do not know, say so and offer to call a member of staff.",
    "Opening hours are eight to six on weekdays and nine to four on Saturdays.",
]
TOPICS = ["hammers", "blue paint", "garden hoses", "screws", "ladders", "drills", "glue",
          "light bulbs", "tiles", "sandpaper", "brushes", "rope", "nails", "saws", "tape",
          "gloves"]


@dataclass
class Sizes:
    system: int = 1500  # tokens of the shared system prompt
    question: int = 20
    clients: int = 16
    per_client: int = 2  # requests each client sends in a round of the shared workload
    new: int = 32  # tokens each request generates
    turns: int = 8
    chat_system: int = 300  # the chat's own system prompt
    chat_new: int = 48  # tokens of each chat answer
    unshared: int = 200  # tokens of each prompt of the no-sharing workload
    rounds: int = 3
    ttft_samples: int = 5  # hit/miss pairs for the TTFT ratio

    @classmethod
    def quick(cls) -> Sizes:
        return cls(system=200, clients=4, per_client=1, new=8, turns=3, chat_system=60,
                   chat_new=12, unshared=40, rounds=1, ttft_samples=2)


class Prompts:
    """Token ids of the workloads; ``session`` makes a prompt differ from its first
    token, so no two sessions share a cached block."""

    def __init__(self, tokenizer, sizes: Sizes) -> None:
        self.tok = tokenizer
        self.sizes = sizes
        self._sessions = itertools.count(1)

    def session(self) -> int:
        return next(self._sessions)

    def _exactly(self, text: str, n: int) -> list[int]:
        ids: list[int] = self.tok(text, add_special_tokens=False)["input_ids"]
        while len(ids) < n:
            ids += ids
        return ids[:n]

    def rules_text(self, session: int, n: int) -> str:
        lines = [f"Session {session}. You are the assistant of a hardware shop."]
        lines += [f"Rule {i + 1}: {RULES[i % len(RULES)]}" for i in range(n // 8)]
        return "\n".join(lines)

    def system(self, session: int) -> list[int]:
        return self._exactly(self.rules_text(session, self.sizes.system),
                             self.sizes.system)

    def question(self, session: int, j: int) -> list[int]:
        return self._exactly(f"\nQuestion {session}.{j}: where do I find "
                             f"{TOPICS[j % len(TOPICS)]}, and what do they cost? Answer:",
                             self.sizes.question)

    def unshared(self, session: int, j: int) -> list[int]:
        return self._exactly(f"{session * 1000 + j}. " + self.rules_text(
            session, self.sizes.unshared), self.sizes.unshared)


def _request(ids: list[int], new: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids),
                              stopping=pb.StoppingCriteria(max_new_tokens=new,
                                                           min_new_tokens=new))


def ttft(stub: pb_grpc.GenerationServiceStub, req: pb.GenerateRequest) -> tuple[float, int]:
    """Seconds to the first streamed token, and the request's cached prompt tokens."""
    t0 = time.perf_counter()
    first = None
    cached = 0
    for msg in stub.GenerateStream(pb.GenerateStreamRequest(request=req), timeout=900):
        if first is None and msg.token_ids:
            first = time.perf_counter() - t0
        if msg.HasField("usage"):
            cached = msg.usage.cached_prompt_tokens
    assert first is not None, "the stream produced no tokens"
    return first, cached


def hit_vs_miss(address: str, prompts: Prompts) -> dict:
    """TTFT of a new system prompt (miss) and of the same one with another question (hit),
    one request at a time."""
    miss, hit, cached = [], [], []
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        for _ in range(prompts.sizes.ttft_samples):
            s = prompts.session()
            system = prompts.system(s)
            miss.append(ttft(stub, _request(system + prompts.question(s, 0), 1))[0])
            t, c = ttft(stub, _request(system + prompts.question(s, 1), 1))
            hit.append(t)
            cached.append(c)
    return {"ttft_miss_p50": statistics.median(miss), "ttft_hit_p50": statistics.median(hit),
            "hit_cached_tokens": min(cached), "ratio": statistics.median(hit) /
            statistics.median(miss)}


def concurrent(address: str, clients: int, per_client: int, new: int,
               prompt: Callable[[int, int], list[int]]) -> float:
    """Tokens/s of ``clients`` streaming clients, each sending ``per_client`` requests
    ``prompt(client, k)`` one after another."""

    def run(stub: pb_grpc.GenerationServiceStub, c: int) -> None:
        for k in range(per_client):
            ttft(stub, _request(prompt(c, k), new))

    dt = _timed_clients(address, clients, run)
    return clients * per_client * new / dt


def shared_system(address: str, prompts: Prompts, session: int) -> float:
    """16 clients over one system prompt with distinct questions (the system prompt sent
    once before the clock starts: the steady state of an application's traffic)."""
    sz = prompts.sizes
    system = prompts.system(session)
    with grpc.insecure_channel(address) as ch:
        ttft(pb_grpc.GenerationServiceStub(ch), _request(system + prompts.question(session, 999),
                                                         1))
    return concurrent(address, sz.clients, sz.per_client, sz.new,
                      lambda c, k: system + prompts.question(session, c * sz.per_client + k))


def unshared(address: str, prompts: Prompts, session: int) -> float:
    sz = prompts.sizes
    return concurrent(address, sz.clients, sz.per_client, sz.new,
                      lambda c, k: prompts.unshared(session, c * sz.per_client + k))


def chat(address: str, prompts: Prompts, session: int) -> float:
    """Seconds for an ``turns``-turn chat; each turn sends the whole history as ``chat``
    messages (the previous answers as the assistant's), as a chat client does."""
    sz = prompts.sizes
    system = prompts.tok.decode(prompts._exactly(prompts.rules_text(session, sz.chat_system),
                                                 sz.chat_system))
    messages = [pb.ChatMessage(role="system", content=system)]
    t0 = time.perf_counter()
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        for turn in range(sz.turns):
            messages.append(pb.ChatMessage(role="user", content=(
                f"Turn {turn + 1}: where do I find {TOPICS[turn % len(TOPICS)]}, and is "
                f"there anything I should know before I buy them?")))
            out = stub.Generate(pb.GenerateRequest(
                chat=pb.ChatMessages(messages=messages, add_generation_prompt=True),
                stopping=pb.StoppingCriteria(max_new_tokens=sz.chat_new,
                                             min_new_tokens=sz.chat_new)), timeout=900)
            messages.append(pb.ChatMessage(role="assistant",
                                           content=out.completions[0].text))
    return time.perf_counter() - t0


def prefix_info(address: str) -> dict:
    with grpc.insecure_channel(address) as ch:
        info = pb_grpc.GenerationServiceStub(ch).GetModelInfo(pb.GetModelInfoRequest())
    p = info.prefix_cache
    return {"runner": info.runner, "enabled": p.enabled, "queries": p.queries,
            "hits": p.hits, "cached_blocks": p.cached_blocks}


@contextmanager
def servers(model: str, runner: str, threads: int) -> Iterator[dict[str, str]]:
    """Three ``genserve serve`` processes: caching on, off, and off again (``off2``, the
    A/A control); yields their addresses."""
    extra = ["--metrics-port", "0"] + (["--threads", str(threads)] if runner == "llamacpp"
                                      else [])
    procs = {}
    RESULTS.mkdir(parents=True, exist_ok=True)
    try:
        for name, flag in (("on", "--enable-prefix-caching"),
                           ("off", "--no-enable-prefix-caching"),
                           ("off2", "--no-enable-prefix-caching")):
            port = free_port()
            procs[name] = (start_server_process(
                model, port, RESULTS / f"server-prefix-{runner}-{name}.log", runner,
                [*extra, flag]), f"127.0.0.1:{port}")
        yield {name: address for name, (_, address) in procs.items()}
    finally:
        for server, _ in procs.values():
            server.stop()


def paired(rounds: int, measure: Callable[[str, int], float],
           addresses: dict[str, str], prompts: Prompts) -> dict:
    """``measure(address, session)`` on each server, ``rounds`` times, the order rotated
    every round; each round a fresh session for each server. ``ratio``: on against off,
    the median over rounds; with an ``off2`` server, ``aa_ratio``: off2 against off."""
    names = list(addresses)
    runs: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            runs[name].append(measure(addresses[name], prompts.session()))

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(runs[a], runs[b], strict=True))

    out: dict = {**runs, "ratio": ratio("on", "off")}
    if "off2" in runs:
        out["aa_ratio"] = ratio("off2", "off")
    return out


def measure_runner(model: str, runner: str, sizes: Sizes, threads: int) -> dict:
    prompts = Prompts(load_tokenizer(resolve_model(model)), sizes)
    with servers(model, runner, threads) as addr:
        for address in addr.values():  # warm-up: a request through each server
            concurrent(address, 1, 1, 4, lambda c, k: prompts.unshared(0, 0))
        pair = {name: addr[name] for name in ("on", "off")}
        res = {
            "ttft": {name: hit_vs_miss(address, prompts) for name, address in pair.items()},
            "shared_16": paired(sizes.rounds, lambda a, s: shared_system(a, prompts, s),
                                pair, prompts),
            "chat": paired(sizes.rounds, lambda a, s: chat(a, prompts, s), pair, prompts),
            "unshared_16": paired(sizes.rounds, lambda a, s: unshared(a, prompts, s),
                                  addr, prompts),
        }
        res["info"] = {name: prefix_info(address) for name, address in pair.items()}
    assert res["info"]["on"]["enabled"] and not res["info"]["off"]["enabled"], res["info"]
    return res


def llama_own(model: str, sizes: Sizes, threads: int) -> dict:
    """llama.cpp's own prompt reuse: ``Llama.generate`` keeps the common prefix of the
    previous prompt in its single context (no reuse across several prompts)."""
    import llama_cpp

    from bench.llamacpp import gguf_path

    prompts = Prompts(load_tokenizer(resolve_model(model)), sizes)
    llm = llama_cpp.Llama(gguf_path(model), n_ctx=sizes.system + 256, n_threads=threads,
                          n_threads_batch=threads, verbose=False)

    def first_token(ids: list[int]) -> float:
        t0 = time.perf_counter()
        next(llm.generate(ids, temp=0.0, reset=True))
        return time.perf_counter() - t0

    miss, hit = [], []
    try:
        for _ in range(sizes.ttft_samples):
            s = prompts.session()
            system = prompts.system(s)
            miss.append(first_token(system + prompts.question(s, 0)))
            hit.append(first_token(system + prompts.question(s, 1)))
    finally:
        llm.close()
    return {"ttft_miss_p50": statistics.median(miss), "ttft_hit_p50": statistics.median(hit),
            "ratio": statistics.median(hit) / statistics.median(miss)}


def measure(model: str = "default", quick: bool = False, runners: tuple[str, ...] = (
        "llamacpp", "torch"), threads: int | None = None) -> dict:
    sizes = Sizes.quick() if quick else Sizes()
    threads = threads or default_threads()
    out: dict = {"sizes": sizes.__dict__, "threads": threads, "runners": {}}
    for runner in runners:
        out["runners"][runner] = measure_runner(model, runner, sizes, threads)
    if "llamacpp" in runners:
        out["llama_cpp_own"] = llama_own(model, sizes, threads)
    return out


def report(res: dict) -> None:
    sz = res["sizes"]
    print(f"\nprefix caching ({sz['system']}-token shared system prompt, {sz['clients']} "
          f"clients, {sz['turns']}-turn chat; caching on vs off, {sz['rounds']} paired rounds)")
    for runner, r in res["runners"].items():
        t = r["ttft"]["on"]
        print(f"  {runner}: TTFT p50 miss {t['ttft_miss_p50']:.3f} s, hit "
              f"{t['ttft_hit_p50']:.3f} s ({t['ratio']:.2f}x, {t['hit_cached_tokens']} "
              f"tokens cached); caching off: {r['ttft']['off']['ratio']:.2f}x")
        for key, what, unit in (("shared_16", "clients sharing the system prompt", "tok/s"),
                                ("chat", "-turn chat", "s"),
                                ("unshared_16", "clients, no shared prefix", "tok/s")):
            p = r[key]
            label = (f"{sz['turns']}{what}" if key == "chat" else f"{sz['clients']} {what}")
            aa = (f"; A/A, a second caching-off server against the first: "
                  f"{p['aa_ratio']:.2f}x" if "aa_ratio" in p else "")
            print(f"  {runner}: {label}: on {statistics.median(p['on']):.2f} {unit}, off "
                  f"{statistics.median(p['off']):.2f} {unit} ({p['ratio']:.2f}x){aa}")
        print(f"  {runner}: server with caching on: {r['info']['on']}")
    if "llama_cpp_own" in res:
        o = res["llama_cpp_own"]
        print(f"  llama.cpp's own Llama.generate (one context, previous prompt's prefix "
              f"reused): TTFT p50 miss {o['ttft_miss_p50']:.3f} s, hit {o['ttft_hit_p50']:.3f}"
              f" s ({o['ratio']:.2f}x)")


def targets(res: dict) -> dict[str, bool]:
    sz = res["sizes"]
    out = {}
    for runner, r in res["runners"].items():
        ttft_r = r["ttft"]["on"]["ratio"]
        shared = r["shared_16"]["ratio"]
        chat_r = r["chat"]["ratio"]
        unshared_r = r["unshared_16"]["ratio"]
        aa = r["unshared_16"].get("aa_ratio")
        aa_note = f"; A/A {aa:.2f}x" if aa is not None else ""
        out.update({
            f"{runner}: TTFT on a shared-system-prompt hit <= 0.2x a miss ({ttft_r:.2f}x)":
                ttft_r <= 0.2,
            f"{runner}: {sz['clients']} clients sharing a system prompt >= 2x caching off "
            f"({shared:.2f}x)": shared >= 2.0,
            f"{runner}: {sz['turns']}-turn chat total time <= 0.5x caching off "
            f"({chat_r:.2f}x)": chat_r <= 0.5,
            f"{runner}: no shared prefixes, >= 0.97x caching off's throughput "
            f"({unshared_r:.2f}x{aa_note})": unshared_r >= 0.97,
        })
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--runner", choices=("llamacpp", "torch"), action="append",
                    help="runner(s) to measure (default: both)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = ap.parse_args(argv)
    res = measure(args.model, args.quick, tuple(args.runner or ("llamacpp", "torch")),
                  args.threads)
    report(res)
    marks = targets(res)
    for name, ok in marks.items():
        print(f"  [{'met' if ok else 'MISSED'}] {name}")
    res["targets"] = marks
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "prefix.json").write_text(json.dumps(res, indent=2))
    print(f"\nwrote {RESULTS / 'prefix.json'}")


if __name__ == "__main__":
    main()
