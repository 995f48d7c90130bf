"""`vkv serve --data-parallel-size N`: N engine processes over one physical KV pool, one front door.

Note [Replicas over one pool]
-----------------------------
Rationale. One engine process uses a few cores well; a large host runs several. Replicas that
each keep a pool of their own compute every shared prefix once per replica, and a request
routed to the "wrong" replica pays the whole prefill. Over one physical pool (vmm/owner.py) a
page any replica computed is mapped by every other in place, so routing only balances load.

Approach. This process owns the pool (a `vmm.PoolOwner` on a thread) and starts N replicas
(here: `ReplicaSet`; its HTTP side, the front door, is engine/serving/dp/front_door.py),
each a whole `vkv serve` (so each request is checked, limited and answered exactly as by one
server) on a loopback port with `--kv-pool` and a key of its own that only this process knows;
the cores are split between them, and each is titled `vkv: rank R` for `ps`. The front door
checks the client's key and the body's size, then proxies the OpenAI routes:
  - routing: `X-data-parallel-rank: R` pins a replica (400 out of range, 503 if it is down);
    otherwise the replica the same prompt start went to before (a hash of its first 512 bytes),
    unless that replica has 2 more requests in flight than the least busy one, which then gets it.
    With one pool the prefix is there for every replica; affinity only spares the lookups.
  - prefill and decode (`--prefill-ranks K`): the first K replicas prefill only. A generation
    request is first sent to a prefill replica with max_tokens 1 (its prompt's pages are computed
    and published, its last partial page too, under a name of exactly its tokens), then whole to
    a decode replica, which maps those pages and takes the last one (the owner hands it over
    whole, so it is written on in place): no byte of KV is copied, and only the prompt's last
    token is computed again, for its logits.
  - failure: a request whose replica fails before anything reached the client (an answer not
    streamed, or a stream before its first chunk) is sent to the next replica, computed again
    there unseen; a stream already under way ends with an error event and [DONE]. A replica that exits is restarted,
    its pool references released by the owner the moment it died.
  - /metrics: every replica's series with a `rank` label, and the pool's (pages free, cached,
    named, processes, pages recovered from dead replicas), and `vkv:kv_handoff_pages_total`.
  - KV events (`--kv-events-config`): the pool's directory, what every replica can map, is
    announced by its owner here (engine/kv/pool_events.py) on the configured ports; the
    replicas announce nothing of their own.

Limitations. On a GPU every replica runs on the pool's one device (the owner creates the pages
shareable and exports them; each replica imports them): run on an H100 only as
tests/serving/test_replicas.py's GPU test (two replicas, 2026-11-26, through benchmarks/gpu_suite.py),
and no replica on another device. One model per replica set (several models: `--model NAME=SOURCE`
without -dp). The proxy adds a loopback hop (well under a millisecond against steps of tens).
The front door reads each body to route it (bounded by --max-body-bytes); adapters loaded at run
time go to one replica only, so they are refused here.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import httpx

import vmm
from engine.config import EngineConfig
from engine.kv.build import backend_for
from engine.kv.pool_events import PoolEvents
from engine.worker.parallel import free_port
from engine.serving.options import ServerOptions

log = logging.getLogger("vkv.server")
FRONT_DOOR_FLAGS = {"--port", "--host", "--api-key", "--data-parallel-size", "-dp", "--prefill-ranks", "--kv-pool",
                    "--replica-rank", "--data-parallel-rank", "--kv-events-config"}
AFFINITY_BYTES = 512  # the prompt start a request's affinity is hashed from
BUSIER = 2  # requests in flight past the least busy replica's before affinity gives way
RESTART_GAP = 5.0  # seconds at least between a replica's start and its restart


def replica_argv(argv: list[str]) -> list[str]:
    """The `vkv serve` arguments a replica gets: the user's, less the front door's own."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in FRONT_DOOR_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


@dataclass
class Replica:
    rank: int
    role: str  # "both", "prefill" or "decode"
    port: int = 0
    process: subprocess.Popen | None = None
    up: bool = False
    in_flight: int = 0
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class ReplicaSet:
    """The replicas and the pool under them; `supervise` (a thread) restarts those that exit."""

    def __init__(self, options: ServerOptions, config: EngineConfig, argv: list[str]):
        n, k = options.data_parallel_size, options.prefill_ranks
        if n < 2:
            raise ValueError(f"--data-parallel-size must be >= 2 for replicas, got {n}")
        if not 0 <= k < n or (k and n - k < 1):
            raise ValueError(f"--prefill-ranks must be in [0, {n - 1}], got {k}")
        if options.allow_runtime_lora_updating:
            raise ValueError("--allow-runtime-lora-updating with replicas is not wired: an adapter would load "
                             "on one replica only")
        self.options, self.key = options, secrets.token_hex(16)
        self.dir = tempfile.mkdtemp(prefix="vkv-pool-")
        backend = backend_for(config, shareable=True)  # the replicas' device: memfd or exported GPU pages
        events = config.kv_events_config
        announce = events is not None and events.publishes  # the pool's directory, announced by its owner
        self.owner = vmm.PoolOwner(backend, max(1, config.kv_budget_bytes(0) // backend.page_size),
                                   os.path.join(self.dir, "pool.sock"), announce).start()
        try:
            self.events = PoolEvents(self.owner, events) if announce else None
        except BaseException:  # its ports taken, say: the pool goes with it, nothing left behind
            self.owner.stop()
            os.rmdir(self.dir)
            raise
        self.argv = replica_argv(argv)
        self.threads = max(1, (os.cpu_count() or 1) // n)
        self.replicas = [Replica(r, "prefill" if r < k else ("decode" if k else "both")) for r in range(n)]
        self.stopping = threading.Event()
        self.supervisor: threading.Thread | None = None
        for replica in self.replicas:
            self._start(replica)

    def _start(self, replica: Replica) -> None:
        replica.port, replica.up, replica.started_at = free_port(), False, time.monotonic()
        # the key in the environment, not on a command line others can read; the front door's own
        # flags last, whatever the user abbreviated (a replica never starts replicas); every
        # connection comes from the front door's one address, so no per-peer cap below its total
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "VKV_API_KEY": self.key}
        cmd = [sys.executable, "-m", "engine.cli", "serve", *self.argv, "--host", "127.0.0.1",
               "--port", str(replica.port), "--kv-pool", self.owner.path, "--replica-rank", str(replica.rank),
               "--data-parallel-rank", str(replica.rank), "--data-parallel-size", "1", "--prefill-ranks", "0",
               "--max-connections-per-peer", str(self.options.limit_concurrency)]
        replica.process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Until every replica answers /health (the first start loads the model in each)."""
        deadline = time.monotonic() + timeout
        for replica in self.replicas:
            while not self._healthy(replica):
                if replica.process.poll() is not None:
                    raise RuntimeError(f"replica {replica.rank} exited with {replica.process.returncode} while "
                                       f"starting")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"replica {replica.rank} did not become healthy in {timeout:.0f} s")
                time.sleep(0.2)
            replica.up = True

    def _healthy(self, replica: Replica) -> bool:
        try:
            return httpx.get(replica.url + "/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def supervise(self) -> None:
        """Restart a replica that exited (at most every RESTART_GAP seconds), or whose engine died
        or stalled (/health 503 while its process lives); mark it up once it answers /health."""
        checked = 0.0
        while not self.stopping.wait(0.2):
            health = time.monotonic() - checked > 1.0
            checked = time.monotonic() if health else checked
            for replica in self.replicas:
                try:
                    self._watch(replica, health)
                except Exception:  # the supervisor must outlive whatever one replica does
                    log.exception("vkv: supervising replica %d", replica.rank)

    def _watch(self, replica: Replica, health: bool) -> None:
        if self.stopping.is_set():
            return
        if replica.process.poll() is not None:
            if time.monotonic() - replica.started_at < RESTART_GAP:
                return  # it died young: not restarted in a tight loop
            log.warning("vkv: replica %d exited with %s: restarting it", replica.rank, replica.process.returncode)
            replica.up = False
            replica.restarts += 1
            self._start(replica)
        elif not replica.up and self._healthy(replica):
            replica.up = True
            log.info("vkv: replica %d is up on port %d", replica.rank, replica.port)
        elif replica.up and health and self._failed(replica):
            log.warning("vkv: replica %d answers /health with an engine that died or stalled: stopping it", replica.rank)
            replica.up = False
            replica.process.terminate()

    def _failed(self, replica: Replica) -> bool:
        try:
            return httpx.get(replica.url + "/health", timeout=5.0).status_code == 503
        except httpx.HTTPError:
            return False  # busy or restarting: the process check decides

    def stop(self) -> None:
        self.stopping.set()
        if self.supervisor is not None:
            self.supervisor.join(timeout=10)
        for replica in self.replicas:
            if replica.process and replica.process.poll() is None:
                replica.process.terminate()
        for replica in self.replicas:
            if replica.process:
                try:
                    replica.process.wait(timeout=self.options.shutdown_timeout + 5)
                except subprocess.TimeoutExpired:
                    replica.process.kill()
        self.owner.stop()
        if self.events is not None:
            self.events.close()
        os.rmdir(self.dir)

    # -- routing ----------------------------------------------------------------------
    def order(self, pin: str | None, affinity: bytes, role: str) -> list[Replica]:
        """The replicas to try for a request, best first; ValueError / LookupError by name."""
        if pin is not None:
            if not pin.isdigit() or int(pin) >= len(self.replicas):
                raise ValueError(f"X-data-parallel-rank must be in [0, {len(self.replicas) - 1}], got {pin!r}")
            replica = self.replicas[int(pin)]
            if not replica.up:
                raise LookupError(f"replica {replica.rank} is down (restarting)")
            return [replica]
        live = [r for r in self.replicas if r.up and r.role in (role, "both")]
        if not live:
            raise LookupError(f"no {role} replica is up")
        preferred = live[int.from_bytes(hashlib.sha256(affinity).digest()[:4], "little") % len(live)]
        least = min(live, key=lambda r: r.in_flight)
        first = preferred if preferred.in_flight <= least.in_flight + BUSIER else least
        return [first] + sorted((r for r in live if r is not first), key=lambda r: r.in_flight)


def _prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()  # resolved here: nothing is loaded between fork and exec


def _die_with_parent() -> None:
    """(in the replica, before exec) SIGTERM when the front door dies, however it dies (Linux's
    PR_SET_PDEATHSIG), so no replica outlives it holding memory."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
