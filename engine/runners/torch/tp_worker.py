"""Tensor-parallel ranks: rank 0's launch (in the serving process), the worker processes it
spawns on its node, and the loop every worker runs.

A worker joins the group, receives rank 0's ``EngineConfig`` (so every rank loads the same
model the same way), builds its shard's runner and then does what each message says:
``step`` (the same forward as rank 0, on its shard; the logits stay with rank 0),
``warmup`` (build the compiled decode step in lockstep), ``adapter`` (write a LoRA
adapter's share into the slot rank 0 loaded it into), ``ping``, ``stop``. Local workers
are separate processes (``python -m engine.runners.torch.tp_worker``) in their own session,
so a terminal's Ctrl-C reaches only the server, which stops them; they die with it
(they watch their parent) if it is killed. On another node, ``genserve worker`` runs that
node's ranks.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import torch

from engine.config import EngineConfig
from engine.runners.torch.tp_group import Rendezvous, TPGroup, tp_device

log = logging.getLogger(__name__)

DEVICE_ENV = "GENSERVE_TP_DEVICE"  # the config's --device, for a worker to pick its backend
DEFAULT_MASTER_PORT = 29500


def _exit_with_parent() -> None:
    """A thread: end this worker when the process that spawned it is gone (reparented).
    Not PR_SET_PDEATHSIG: that fires when the spawning *thread* ends, and rank 0 loads
    the model in a thread that ends once the engine is built."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        log.error("tensor-parallel worker: the leader (pid %d) is gone; exiting", parent)
        os._exit(1)

    threading.Thread(target=watch, name="genserve-tp-parent", daemon=True).start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_local(first: Rendezvous, device: str) -> list[subprocess.Popen]:
    """The node's other ranks (``first`` is this process's), one process each."""
    procs = []
    for local in range(1, first.local_world_size):
        rdzv = Rendezvous(first.master_addr, first.master_port, first.rank + local,
                          first.world_size, local, first.local_world_size)
        env = {**os.environ, **rdzv.env(), DEVICE_ENV: device}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "engine.runners.torch.tp_worker"], env=env,
            start_new_session=True))
    return procs


def leader_address() -> str:
    """MASTER_ADDR, else LeaderWorkerSet's LWS_LEADER_ADDRESS (set in every pod of a group)."""
    return os.environ.get("MASTER_ADDR") or os.environ.get("LWS_LEADER_ADDRESS") or ""


def node_layout(size: int, nnodes: int) -> int:
    """Ranks per node; ValueError naming the flags when they do not fit."""
    if size < 1 or nnodes < 1:
        raise ValueError("--tensor-parallel-size and --tp-nnodes must be >= 1")
    if size % nnodes:
        raise ValueError(f"--tensor-parallel-size {size} does not divide over --tp-nnodes "
                         f"{nnodes} (every node runs the same number of ranks)")
    return size // nnodes


def launch_leader(config: EngineConfig) -> TPGroup:
    """Rank 0: start this node's workers, join the group (waiting for the other nodes'
    ``genserve worker``), and hand every worker the config."""
    size, nnodes = config.tensor_parallel_size, config.tp_nnodes
    per_node = node_layout(size, nnodes)
    if torch.distributed.is_initialized():
        raise RuntimeError("this process already belongs to a tensor-parallel group (one "
                           "per process): close the other runner first")
    if nnodes == 1:  # a fresh port: an inherited MASTER_PORT may be an earlier group's
        addr, port = "127.0.0.1", _free_port()
    else:
        addr = leader_address()
        if not addr:
            raise ValueError(f"--tp-nnodes {nnodes} needs MASTER_ADDR (this node's address "
                             f"the workers reach; or LWS_LEADER_ADDRESS) and MASTER_PORT in "
                             f"the environment")
        port = int(os.environ.get("MASTER_PORT") or DEFAULT_MASTER_PORT)
    rdzv = Rendezvous(addr, port, 0, size, 0, per_node)
    workers = spawn_local(rdzv, config.device)
    log.info("tensor parallel: %d ranks over %d node(s); rendezvous %s:%d; local workers "
             "%s", size, nnodes, addr, port, [p.pid for p in workers])
    try:
        group = TPGroup.join(rdzv, tp_device(config.device, 0), workers)
        group.broadcast(config)
    except BaseException:
        for p in workers:
            p.kill()
            p.wait()
        raise
    return group


def serve_worker(rdzv: Rendezvous, device: str) -> int:
    """One worker rank until rank 0 says stop (0) or the group breaks (1)."""
    from engine.runners.torch.model_runner import ModelRunner

    group = TPGroup.join(rdzv, tp_device(device, rdzv.local_rank))
    try:
        config: EngineConfig = group.broadcast()
        runner = ModelRunner(config, tp=group)
        while True:
            message = group.broadcast()
            kind = message[0]
            if kind == "step":
                runner.run_step(message[1], message[2])
            elif kind == "warmup":
                runner.follow_warmup(message[1], message[2])
            elif kind == "adapter":
                runner.follow_adapter(message[1], message[2])
            elif kind == "stop":
                log.info("tensor parallel: rank %d stopping", rdzv.rank)
                return 0
    except Exception:
        log.exception("tensor-parallel rank %d failed", rdzv.rank)
        return 1
    finally:
        group.close()


def run_node(size: int, nnodes: int, node_rank: int, device: str) -> int:
    """``genserve worker``: this node's ranks of a group whose rank 0 serves on node 0."""
    per_node = node_layout(size, nnodes)
    if not 0 < node_rank < nnodes:
        raise ValueError(f"--tp-node-rank must be 1..{nnodes - 1} (node 0 runs genserve "
                         f"serve); got {node_rank}")
    addr, port = leader_address(), os.environ.get("MASTER_PORT", "")
    if not addr:
        raise ValueError("genserve worker needs MASTER_ADDR (the leader's address; or "
                         "LWS_LEADER_ADDRESS) and MASTER_PORT in the environment")
    rdzv = Rendezvous(addr, int(port or DEFAULT_MASTER_PORT), node_rank * per_node, size,
                      0, per_node)
    others = spawn_local(rdzv, device)
    code = serve_worker(rdzv, device)
    for p in others:
        try:
            code = code or (p.wait(timeout=30) and 1)
        except subprocess.TimeoutExpired:
            p.kill()
            code = 1
    return code


def main() -> int:
    logging.basicConfig(level=os.environ.get("GENSERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s [tp worker] %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the leader stops us; Ctrl-C is its
    _exit_with_parent()
    torch.set_grad_enabled(False)
    return serve_worker(Rendezvous.from_env(), os.environ.get(DEVICE_ENV, "auto"))


if __name__ == "__main__":
    sys.exit(main())
