"""Tensor parallelism over torch.distributed: rank 0 drives, ranks 1..N-1 follow.

Rationale: a model or its KV may outgrow one device; each rank then holds 1/N of the heads,
so 1/N of the weights of every layer and 1/N of the KV bytes, in a page pool of its own.

Approach: the scheduler runs once, on rank 0, against rank 0's KV cache. Every call it makes
that changes a KV cache (admit, ensure_mapped, commit, fork, release, swap, sleep, ...) is
recorded (`RecordedKV`) with a snapshot of the sequence it names; each step rank 0 broadcasts
those calls and the step's flat batch, and every worker replays the calls on its own cache
before running the same forward pass. All ranks' caches have the same geometry (rows of 1/N
of the bytes, the same page size and page count), so the same calls make the same decisions:
the pools stay in lockstep, page id for page id, and the slots and block tables rank 0 puts
in the batch are right on every rank (the tests audit that). Row-parallel projections are
all-reduced inside the model (engine/models/llama.py); only rank 0 computes logits and samples.

Failure: before each step rank 0 checks that every worker is alive, and the process group has
a timeout, so a dead worker fails the step (the engine then fails its requests; the server
answers 503) instead of hanging; closing the engine stops the others.

Multi-host is the same code: `distributed_init="tcp://HOST:PORT"` names rank 0's rendezvous;
with `tensor_parallel_workers="external"` rank 0 spawns nothing and waits there for ranks
1..N-1, each started with `vkv tp-worker --rank R` and the same engine flags on any host. Only
spawned workers can be watched for liveness; an external one that dies surfaces as the next
collective's error (or the group's timeout).
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.models.config import ModelConfig
from engine.sequence import Sequence

log = logging.getLogger("vkv.parallel")
TIMEOUT = datetime.timedelta(seconds=60)
# KV-cache calls that change state; the rest (reads, and calls these make internally) are not sent.
MUTATORS = ("admit", "ensure_mapped", "commit", "fork", "release", "swap_out", "swap_in", "reclaim",
            "map_ahead", "sleep", "wake_up")


class WorkerDied(RuntimeError):
    pass


def check_divisible(cfg: ModelConfig, world: int) -> None:
    """N must divide the query heads, the KV heads and the MLP width (KV heads are not replicated)."""
    for name, value in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                        ("intermediate_size", cfg.intermediate_size)):
        if value % world:
            raise ValueError(f"tensor_parallel_size {world} must divide the model's {name} ({value})")


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The shape one rank's KV cache holds: 1/N of the heads."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world)


@dataclasses.dataclass(eq=False)
class SeqState:
    """What a KV cache reads of a sequence, as it was when the call was made."""
    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int
    cache_salt: str | None

    def __len__(self) -> int:
        return len(self.token_ids)


def _snapshot(arg):
    if isinstance(arg, Sequence):
        return SeqState(arg.seq_id, list(arg.token_ids), arg.num_computed_tokens, arg.num_prompt_tokens,
                        arg.cache_salt)
    return arg


class RecordedKV:
    """Rank 0's KV cache, recording the state-changing calls made on it for the workers."""

    def __init__(self, kv):
        self._kv, self.calls = kv, []

    def __getattr__(self, name):
        attr = getattr(self._kv, name)
        if name not in MUTATORS:
            return attr

        def recorded(*args, **kwargs):
            self.calls.append((name, [_snapshot(a) for a in args], kwargs))
            return attr(*args, **kwargs)
        return recorded

    def __setattr__(self, name, value):
        if name in ("_kv", "calls"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._kv, name, value)

    def take_calls(self) -> list:
        calls, self.calls = self.calls, []
        return calls


def replay(kv, calls: list, seqs: dict[int, SeqState]) -> None:
    """Make the same calls on a worker's cache; one SeqState object per sequence, as rank 0 has
    one Sequence (the caches key their state by seq_id)."""
    for name, args, kwargs in calls:
        live = []
        for arg in args:
            if isinstance(arg, SeqState):
                if arg.seq_id in seqs:
                    arg = _update(seqs[arg.seq_id], arg)
                else:
                    seqs[arg.seq_id] = arg
            live.append(arg)
        getattr(kv, name)(*live, **kwargs)
        if name == "release":
            seqs.pop(live[0].seq_id, None)


def _update(mine: SeqState, now: SeqState) -> SeqState:
    mine.token_ids, mine.num_computed_tokens, mine.num_prompt_tokens = \
        now.token_ids, now.num_computed_tokens, now.num_prompt_tokens
    return mine


def pool_state(kv) -> tuple:
    """What must be equal on every rank: each page's count, the free queue, each sequence's place."""
    places = getattr(kv, "slots", None) or getattr(kv, "tables", {})
    return list(kv.pool.ref_counts), list(kv.pool.free_ids), dict(places)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workers:
    """Ranks 1..N-1 as processes; rank 0 (this process) joins the group too."""

    def __init__(self, config, world: int, engine_class):
        """engine_class(config, tp_rank=r) builds rank r's engine in its process (LLMEngine)."""
        self.world = world
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share the cores
        self.init = config.distributed_init or f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        spawn = config.tensor_parallel_workers == "spawn"  # else started by `vkv tp-worker`, anywhere
        self.procs = [ctx.Process(target=worker_main, args=(engine_class, config, rank, world, self.init), daemon=True,
                                  name=f"vkv-tp-{rank}") for rank in range(1, world) if spawn]
        for p in self.procs:
            p.start()
        dist.init_process_group("gloo", init_method=self.init, rank=0, world_size=world, timeout=TIMEOUT)
        self.closed = False

    def check_alive(self) -> None:
        dead = [p for p in self.procs if not p.is_alive()]
        if dead:
            raise WorkerDied(f"tensor-parallel worker {dead[0].name} exited with code {dead[0].exitcode}")

    def send(self, calls: list, step: tuple | None) -> None:
        """The KV calls since the last send, and the step to run (None: calls only)."""
        self.check_alive()
        dist.broadcast_object_list([("step", calls, step)], src=0)

    def pool_states(self) -> list:
        """Every worker audits its KV cache and reports its pool (reference counts, free pages in
        order) and where sequences live: to be compared with rank 0's, for tests."""
        self.check_alive()
        dist.broadcast_object_list([("audit", None, None)], src=0)
        states = [None] * self.world
        dist.gather_object(None, states, dst=0)
        return states[1:]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.is_alive() for p in self.procs):
                dist.broadcast_object_list([("stop", None, None)], src=0)
        except Exception:  # a worker is gone: the others are stopped below
            pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()


def worker_main(engine_class, config, rank: int, world: int, init: str) -> None:
    """A worker: the model's share and a KV cache like rank 0's, then steps as told."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=TIMEOUT)
    engine = engine_class(config, tp_rank=rank)
    seqs: dict[int, SeqState] = {}
    try:
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0)
            kind, calls, step = message[0]
            if kind == "stop":
                break
            if kind == "audit":
                engine.kv.audit()
                dist.gather_object(pool_state(engine.kv), None, dst=0)
                continue
            replay(engine.kv, calls, seqs)
            if step is not None:
                engine.runner.forward(*step)
    finally:
        engine.kv.close()
        dist.destroy_process_group()
