"""Tensor parallelism over torch.distributed: rank 0 drives, ranks 1..N-1 follow.

Rationale: a model or its KV may outgrow one device; each rank then holds 1/N of the heads,
so 1/N of the weights of every layer and 1/N of the KV bytes, in a page pool of its own.

Approach: the scheduler runs once, on rank 0, against rank 0's KV cache. Every call it makes
that changes a KV cache (admit, ensure_mapped, commit, fork, release, swap, sleep, ...) is
logged (`RecordedKV`) as an operation (`KVOp`: the verb, from one list of them, with snapshots of
the sequences it names); each step rank 0 broadcasts the log and the step's flat batch, and every
worker applies the operations to its own cache before running the same forward pass. All ranks' caches have the same geometry (rows of 1/N
of the bytes, the same page size and page count), so the same calls make the same decisions:
the pools stay in lockstep, page id for page id, and the slots and block tables rank 0 puts
in the batch are right on every rank (the tests audit that). Row-parallel projections are
all-reduced inside the model (engine/models/llama.py); only rank 0 computes logits and samples.

Workers: each local rank is a fresh interpreter running this module (`python -m
engine.worker.parallel`, as `vkv tp-worker` runs it on another host), never multiprocessing's spawn,
which re-imports the user's main module (a script on standard input, or one without a main
guard, would kill every worker at import). It builds its rank itself (engine/worker/rank.py); the
config comes on its standard input. A worker says "ready" before it joins the group, so one
that dies on the way fails the engine at once with the worker's own error.

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
import pickle
import select
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.worker.model_runner import ModelRunner
from engine.models import load_config
from engine.worker.rank import Rank, build_rank, check_divisible
from engine.request.sequence import Sequence

log = logging.getLogger("vkv.parallel")
TIMEOUT = datetime.timedelta(seconds=60)
READY = b"vkv-tp-ready\n"


class WorkerDied(RuntimeError):
    pass


@dataclasses.dataclass(eq=False)
class SeqState:
    """What a KV cache reads of a sequence, as it was when the call was made."""
    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int
    cache_salt: str | None
    scores_prompt: bool = False  # prompt_logprobs: admitted without its cached prefix
    adapter_digest: str | None = None  # names its pages (TP > 1 refuses LoRA today; kept for the names' sake)
    adapter_name: str | None = None  # announced with its pages (KV events)
    kv: object = None  # the worker's KV cache keeps its handle here, as rank 0's keeps it on the Sequence

    def __len__(self) -> int:
        return len(self.token_ids)

    @classmethod
    def of(cls, seq: Sequence) -> SeqState:
        return cls(seq.seq_id, list(seq.token_ids), seq.num_computed_tokens, seq.num_prompt_tokens, seq.cache_salt,
                   seq.scores_prompt, seq.adapter_digest, seq.adapter_name)

    def live(self, seqs: dict[int, SeqState]) -> SeqState:
        """The worker's one object for this sequence (the caches key their state by seq_id),
        brought up to this snapshot."""
        mine = seqs.setdefault(self.seq_id, self)
        mine.token_ids, mine.num_computed_tokens, mine.num_prompt_tokens = \
            self.token_ids, self.num_computed_tokens, self.num_prompt_tokens
        return mine


# -- the operations: a call of one of the KV cache's verbs that change state ----------------
# The verbs the workers replay, per object (the KV manager, the engine's KVMemory), in one table:
# a new state-changing verb of either joins here.
MUTATING = {"kv": ("admit", "ensure_mapped", "map_ahead", "commit", "fork", "release", "swap_out", "swap_in",
                   "reclaim"),
            "memory": ("sleep", "wake_up")}


@dataclasses.dataclass(frozen=True, eq=False)
class KVOp:
    """One call of a MUTATING verb as rank 0 made it, its sequences as snapshots (SeqState),
    for each worker to make on its own cache."""
    target: str  # "kv" or "memory" (MUTATING)
    verb: str
    args: tuple
    kwargs: dict

    def apply(self, parts: Rank, seqs: dict[int, SeqState]):
        args = [a.live(seqs) if isinstance(a, SeqState) else a for a in self.args]
        result = getattr(getattr(parts, self.target), self.verb)(*args, **self.kwargs)
        if self.verb == "release":  # the worker forgets the sequence with its handle
            seqs.pop(self.args[0].seq_id, None)
        return result


class RecordedKV:
    """Rank 0's KV manager (target "kv") or KVMemory ("memory"): the MUTATING verbs are logged
    as KVOps for the workers, both objects into one log (`ops`, shared) in the order they were
    made (calls the cache makes inside them are not: the workers' caches make them too); the
    rest reads through."""

    def __init__(self, obj, target: str = "kv", ops: list | None = None):
        self._obj, self._target, self.ops = obj, target, ops if ops is not None else []

    def __getattr__(self, name):
        attr = getattr(self._obj, name)
        if name not in MUTATING[self._target]:
            return attr

        def recorded(*args, **kwargs):
            snapshot = tuple(SeqState.of(a) if isinstance(a, Sequence) else a for a in args)
            self.ops.append(KVOp(self._target, name, snapshot, kwargs))
            return attr(*args, **kwargs)
        return recorded

    def take_ops(self) -> list:
        ops = list(self.ops)
        self.ops.clear()
        return ops


def pool_state(kv) -> tuple:
    """What must be equal on every rank: each page's count, the free queue, each sequence's place."""
    return list(kv.pool.ref_counts), list(kv.pool.free_ids), {h.seq_id: h.place for h in kv.handles}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)  # the ranks share the cores


class Worker:
    """One local rank: a fresh interpreter running this module; its errors go to a file, so a
    death can be reported with them."""

    def __init__(self, config: EngineConfig, rank: int, world: int, init: str):
        self.rank, self.errors = rank, tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.worker.parallel", str(rank), str(world), init],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors)
        self.proc.stdin.write(pickle.dumps(config))
        self.proc.stdin.close()

    def wait_ready(self, deadline: float) -> None:
        """Until it says it is ready; WorkerDied, with its own error, if it exits first."""
        out = self.proc.stdout
        while time.monotonic() < deadline:
            if select.select([out], [], [], 0.1)[0]:
                line = out.readline()
                if line == READY:
                    return
                if not line:  # it closed its output: it is gone
                    self.proc.wait(timeout=10)
                    break
        raise WorkerDied(self.why())

    def why(self) -> str:
        code = self.proc.poll()
        self.errors.seek(0)
        tail = self.errors.read().decode(errors="replace").strip().splitlines()[-12:]
        state = f"exited with code {code}" if code is not None else "did not start in time"
        return f"tensor-parallel worker {self.rank} {state}" + (":\n" + "\n".join(tail) if tail else "")


class Workers:
    """Ranks 1..N-1; rank 0 (this process) joins the group too."""

    def __init__(self, config: EngineConfig, world: int):
        self.world, self.closed = world, False
        torch.set_num_threads(_threads(world))
        self.init = config.distributed_init or f"tcp://127.0.0.1:{free_port()}"
        spawn = config.tensor_parallel_workers == "spawn"  # else started by `vkv tp-worker`, anywhere
        self.procs = [Worker(config, rank, world, self.init) for rank in range(1, world)] if spawn else []
        try:
            deadline = time.monotonic() + TIMEOUT.total_seconds()
            for worker in self.procs:
                worker.wait_ready(deadline)
            dist.init_process_group("gloo", init_method=self.init, rank=0, world_size=world, timeout=TIMEOUT)
            if differ := agree(config):
                dist.destroy_process_group()
                raise disagreement(differ)
        except BaseException:
            self._stop_all()
            raise

    def check_alive(self) -> None:
        dead = [w for w in self.procs if w.proc.poll() is not None]
        if dead:
            raise WorkerDied(dead[0].why())

    def blame(self, error: Exception, grace: float = 5.0) -> None:
        """After a collective failed: WorkerDied with the dead worker's own error (the traceback
        that says why), if one is gone or goes within `grace` seconds; else nothing."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and all(w.proc.poll() is None for w in self.procs):
            time.sleep(0.05)
        try:
            self.check_alive()
        except WorkerDied as died:
            raise died from error

    def send(self, ops: list, step: tuple | None) -> None:
        """The KV operations since the last send, and the step to run (None: operations only)."""
        self.check_alive()
        dist.broadcast_object_list([("step", ops, step)], src=0)

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
            if all(w.proc.poll() is None for w in self.procs):
                dist.broadcast_object_list([("stop", None, None)], src=0)
        except Exception:  # a worker is gone: the others are stopped below
            pass
        self._stop_all()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _stop_all(self) -> None:
        """Each worker ends, asked or not: terminated after 10 s, killed after 5 more (a stopped
        or hung process never acts on SIGTERM, and close() must still end the process group)."""
        for w in self.procs:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.proc.terminate()
                try:
                    w.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    w.proc.kill()
                    w.proc.wait()


def start_ranks(c: EngineConfig, model=None, pool=None) -> tuple[Rank, Workers | None]:
    """Rank 0, in this process (over `model` when its weights are already loaded; in `pool`, a
    share of a physical pool several models draw from, when given), and with
    tensor_parallel_size N > 1 the Workers running ranks 1..N-1. On failure nothing is left
    running."""
    tp = c.tensor_parallel_size
    if tp > 1 and model is not None:
        raise ValueError("an engine with tensor_parallel_size > 1 loads its own weight shards")
    if pool is not None and (tp > 1 or c.kv_layout == "paged"):
        raise ValueError("a shared KV pool needs a virtual kv_layout (interleaved or per_layer) and "
                         "tensor_parallel_size 1")
    if tp > 1:
        check_divisible(load_config(c.model), tp)
    workers = Workers(c, tp) if tp > 1 else None
    try:
        return build_rank(c, 0, model, pool), workers
    except BaseException:
        if workers:
            workers.close()
        raise


AGREED = ("model", "dtype", "kv_cache_dtype", "kv_layout", "kv_cache_memory", "page_size", "block_size",
          "max_model_len", "max_num_seqs", "max_num_batched_tokens", "seed", "tensor_parallel_size",
          "enable_lora", "max_loras", "max_lora_rank", "preemption_mode", "enable_prefix_caching")


def agree(config: EngineConfig) -> list[str]:
    """Every rank states the settings a step's lockstep depends on, and the weights' fingerprint;
    the names on which any rank differs from rank 0 (a `vkv tp-worker` started with other flags,
    or another checkpoint on its host, computed other tokens without a word)."""
    from engine.models import weights_fingerprint
    mine = {name: repr(getattr(config, name)) for name in AGREED}
    mine["weights"] = weights_fingerprint(config.model, config.seed).hex()
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, mine)
    return sorted({name for view in views[1:] for name in view if view[name] != views[0][name]})


def disagreement(names: list[str]) -> ValueError:
    return ValueError(f"tensor-parallel ranks disagree on {', '.join(names)}: start every `vkv tp-worker` "
                      f"with rank 0's engine flags and the same checkpoint")


def worker_main(config: EngineConfig, rank: int, world: int, init: str) -> None:
    """A worker: the model's share and a KV cache like rank 0's, then steps as told."""
    torch.set_num_threads(_threads(world))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=TIMEOUT)
    if differ := agree(config):
        dist.destroy_process_group()
        raise disagreement(differ)
    parts = build_rank(config, rank)
    runner = ModelRunner(parts.model, parts.kv, parts.attention, parts.max_model_len, config.device,
                         config.compute_dtype)
    seqs: dict[int, SeqState] = {}
    try:
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0)
            kind, ops, step = message[0]
            if kind == "stop":
                break
            if kind == "audit":
                parts.kv.audit()
                dist.gather_object(pool_state(parts.kv), None, dst=0)
                continue
            for op in ops:
                op.apply(parts, seqs)
            if step is not None:
                runner.forward(*step)
    finally:
        parts.kv.close()
        dist.destroy_process_group()


def _main() -> None:
    """`python -m engine.worker.parallel RANK WORLD INIT`, the pickled EngineConfig on standard input."""
    rank, world, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    config = pickle.loads(sys.stdin.buffer.read())
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    os.dup2(2, 1)  # anything printed later goes with the errors, never into a pipe nobody reads
    worker_main(config, rank, world, init)


if __name__ == "__main__":
    _main()
