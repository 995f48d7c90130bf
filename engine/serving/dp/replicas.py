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
  - routing: `X-data-parallel-rank: R` pins a replica (400, in our words, for a header that is
    not a replica's number, sent twice, or a prefill-only replica; 503 if it is down);
    otherwise the replica the same prompt start went to before (a hash of its first 512 bytes),
    unless that replica has 2 more requests in flight than the least busy one, which then gets it.
    With one pool the prefix is there for every replica; affinity only spares the lookups.
  - prefill and decode (`--prefill-ranks K`): the first K replicas prefill only. A generation
    request is first sent to a prefill replica with max_tokens 1 (its prompt's pages are computed
    and published, its last partial page too, under a name of exactly its tokens), then whole to
    a decode replica, which maps those pages and takes the last one (the owner hands it over
    whole, so it is written on in place): no byte of KV is copied, and only the prompt's last
    token is computed again, for its logits.
  - failure: every replica is probed twice a second, each probe with a one-second deadline: one
    that misses it is out of rotation at once, and one silent for --replica-hang-seconds (or
    whose engine died or stalled) is killed and started again, as is a start that is not healthy
    within --replica-start-timeout (`ReplicaSet`). A request whose replica fails or goes out of
    rotation before anything reached the client (an answer not streamed, or a stream before its
    first chunk) is sent to another replica, computed again there unseen; a stream already
    under way ends with an error event and [DONE]; every forward has deadlines (connect, then
    --request-timeout end to end). The owner releases a dead replica's pool references at once.
  - roles: /health is 200 while every role (prefill, decode) has an up replica, else 503; while
    one role has none the survivors serve whole requests (a decode replica prefills, a prefill
    replica decodes), counted in vkv:replica_role_fallbacks_total, instead of 503s.
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
import glob
import hashlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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
RESTART_GAP = 1.0  # seconds before an exited replica starts again (doubled for each that died young)
MAX_BACKOFF = 30.0  # seconds at most between starts of a replica that keeps dying young
YOUNG = 10.0  # a replica that exits sooner than this after its start died young
PROBE_PERIOD = 0.5  # seconds between health probes of each replica
PROBE_TIMEOUT = 1.0  # seconds a probe waits for its answer: a replica that misses it is out of rotation
KILL_GRACE = 2.0  # seconds between TERM and KILL for a replica being stopped
PID_FILE = "front-door.pid"


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
    """One replica as the supervisor sees it. Who writes what: the supervisor thread writes its
    process, state and timings; the front door reads `up` and counts `in_flight`, and may take a
    replica out of rotation (`up = False`) when a request to it fails; the supervisor decides
    whether it comes back."""
    rank: int
    role: str  # "both", "prefill" or "decode"
    port: int = 0
    process: subprocess.Popen | None = None
    state: str = "starting"  # "starting" (not healthy yet), "up", "silent" (its probes unanswered), "stopping"
    in_flight: int = 0
    restarts: int = 0
    kills: int = 0  # killed for hanging, or for a start that passed its deadline
    started_at: float = field(default_factory=time.monotonic)
    silent_since: float | None = None
    stop_at: float = 0.0  # when a TERM sent goes unanswered: KILL
    next_start: float = 0.0  # when an exited replica may start again (backoff)
    backoff: float = RESTART_GAP
    generation: int = 0  # one more at each start: a request sent before knows it met another process

    @property
    def up(self) -> bool:
        return self.state == "up"

    @up.setter
    def up(self, value: bool) -> None:  # (the front door: a request to it failed; the probes decide again)
        if not value and self.state == "up":
            self.state, self.silent_since = "silent", time.monotonic()
        elif value:
            self.state, self.silent_since = "up", None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class ReplicaSet:
    """The replicas and the pool under them; `supervise` (a thread) keeps them serving:

      a probe of /health every PROBE_PERIOD, each with a PROBE_TIMEOUT deadline, all at once;
      a replica that misses one is out of rotation at once ("silent"); one silent for
      replica_hang_seconds is sent TERM, and KILL after KILL_GRACE (a stopped process takes
      only KILL); one whose engine died or stalled (/health 503) is stopped the same way;
      a start that is not healthy within replica_start_timeout is killed too; an exited
      replica starts again after its backoff (RESTART_GAP, doubled for each start that died
      young, up to MAX_BACKOFF); the pool's owner, a thread here, is started again if it dies
      (its replicas then exit, engine/serving/api/server.py OwnerWatch, and are started again)."""

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
        remove_stale_pool_dirs()
        self.dir = tempfile.mkdtemp(prefix="vkv-pool-")
        with open(os.path.join(self.dir, PID_FILE), "w") as f:  # whose it is, for the next start's cleanup
            f.write(str(os.getpid()))
        self.backend = backend_for(config, shareable=True)  # the replicas' device: memfd or exported GPU pages
        self.num_pages = max(1, config.kv_budget_bytes(0) // self.backend.page_size)
        events = config.kv_events_config
        self.announce = events is not None and events.publishes  # the pool's directory, announced by its owner
        self.owner = self._start_owner()
        self.owner_restarts = 0
        try:
            self.events = PoolEvents(self.owner, events) if self.announce else None
        except BaseException:  # its ports taken, say: the pool goes with it, nothing left behind
            self.owner.stop()
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.argv = replica_argv(argv)
        self.threads = max(1, (os.cpu_count() or 1) // n)
        self.replicas = [Replica(r, "prefill" if r < k else ("decode" if k else "both")) for r in range(n)]
        self.stopping = threading.Event()
        self.supervisor: threading.Thread | None = None
        self.probes = ThreadPoolExecutor(max_workers=n, thread_name_prefix="vkv-probe")
        for replica in self.replicas:
            self._start(replica)

    def _start_owner(self) -> vmm.PoolOwner:
        return vmm.PoolOwner(self.backend if not hasattr(self, "owner") else backend_like(self.backend),
                             self.num_pages, os.path.join(self.dir, "pool.sock"), self.announce).start()

    def _start(self, replica: Replica) -> None:
        replica.port, replica.state, replica.silent_since = free_port(), "starting", None
        replica.started_at, replica.generation = time.monotonic(), replica.generation + 1
        # the key in the environment, not on a command line others can read; the front door's own
        # flags last, whatever the user abbreviated (a replica never starts replicas); every
        # connection comes from the front door's one address, so no per-peer cap below its total
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "VKV_API_KEY": self.key}
        cmd = [sys.executable, "-m", "engine.cli", "serve", *self.argv, "--host", "127.0.0.1",
               "--port", str(replica.port), "--kv-pool", self.owner.path, "--replica-rank", str(replica.rank),
               "--data-parallel-rank", str(replica.rank), "--data-parallel-size", "1", "--prefill-ranks", "0",
               "--max-connections-per-peer", str(self.options.limit_concurrency)]
        replica.process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Until every replica answers /health (the first start loads the model in each)."""
        deadline = time.monotonic() + (timeout or self.options.replica_start_timeout)
        for replica in self.replicas:
            while self._probe(replica) != 200:
                if replica.process.poll() is not None:
                    raise RuntimeError(f"replica {replica.rank} exited with {replica.process.returncode} while "
                                       f"starting")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"replica {replica.rank} did not become healthy in "
                                       f"{timeout or self.options.replica_start_timeout:.0f} s")
                time.sleep(0.2)
            replica.state = "up"

    def _probe(self, replica: Replica) -> int | None:
        """Its /health status, or None when it does not answer within PROBE_TIMEOUT."""
        try:
            return httpx.get(replica.url + "/health", timeout=PROBE_TIMEOUT).status_code
        except httpx.HTTPError:
            return None

    def supervise(self) -> None:
        """The loop of the class's note, until stop()."""
        probed = 0.0
        while not self.stopping.wait(0.1):
            now = time.monotonic()
            try:
                self._watch_owner()
                if now - probed >= PROBE_PERIOD:
                    probed = now
                    live = [r for r in self.replicas if r.process.poll() is None and r.state != "stopping"]
                    for replica, status in zip(live, self.probes.map(self._probe, live)):
                        self._judge(replica, status, time.monotonic())
                for replica in self.replicas:
                    self._tend(replica, time.monotonic())
            except Exception:  # the supervisor must outlive whatever one replica does
                log.exception("vkv: supervising the replicas")

    def _judge(self, replica: Replica, status: int | None, now: float) -> None:
        """What one probe says of a live replica."""
        if self.stopping.is_set() or replica.state == "stopping":
            return
        if status == 200:
            if replica.state != "up":
                log.info("vkv: replica %d is up on port %d", replica.rank, replica.port)
            replica.state, replica.silent_since, replica.backoff = "up", None, RESTART_GAP
        elif status == 503:
            log.warning("vkv: replica %d answers /health with an engine that died or stalled: stopping it",
                        replica.rank)
            self._terminate(replica, now)
        elif replica.state == "starting":
            if now - replica.started_at > self.options.replica_start_timeout:
                log.warning("vkv: replica %d is not healthy %.0f s after its start: killing it", replica.rank,
                            now - replica.started_at)
                replica.kills += 1
                self._terminate(replica, now)
        else:  # up or silent: a probe unanswered
            if replica.state == "up":
                log.warning("vkv: replica %d did not answer its health probe within %.1f s: out of rotation",
                            replica.rank, PROBE_TIMEOUT)
                replica.up = False
            elif now - replica.silent_since > self.options.replica_hang_seconds:
                log.warning("vkv: replica %d has answered nothing for %.1f s: killing it", replica.rank,
                            now - replica.silent_since)
                replica.kills += 1
                self._terminate(replica, now)

    def _terminate(self, replica: Replica, now: float) -> None:
        replica.state, replica.stop_at = "stopping", now + KILL_GRACE
        replica.process.terminate()

    def _tend(self, replica: Replica, now: float) -> None:
        """KILL what TERM did not stop; start again what exited, after its backoff."""
        if self.stopping.is_set():
            return
        if replica.process.poll() is None:
            if replica.state == "stopping" and now > replica.stop_at:
                replica.process.kill()  # (a stopped process takes no TERM)
            return
        if replica.state != "down":
            died_young = now - replica.started_at < YOUNG
            replica.backoff = min(MAX_BACKOFF, replica.backoff * 2) if died_young else RESTART_GAP
            replica.next_start = now + replica.backoff
            replica.state = "down"
            log.warning("vkv: replica %d exited with %s: starting it again in %.0f s", replica.rank,
                        replica.process.returncode, replica.backoff)
        if now >= replica.next_start:
            replica.restarts += 1
            self._start(replica)

    def _watch_owner(self) -> None:
        """The pool's owner serves on a thread here; if it ever dies, a new one takes the socket
        (the pages are gone with the old: every replica's KV) and the replicas start again."""
        if self.stopping.is_set() or self.owner.serving:
            return
        log.error("vkv: the KV pool's owner stopped: starting a new pool; every replica starts again")
        old = self.owner
        old.stop()
        self.owner = self._start_owner()
        self.owner_restarts += 1
        if self.events is not None:
            self.events.owner = self.owner

    def stop(self) -> None:
        self.stopping.set()
        if self.supervisor is not None:
            self.supervisor.join(timeout=10)
        self.probes.shutdown(wait=False)
        for replica in self.replicas:
            if replica.process and replica.process.poll() is None:
                if replica.state == "silent" or replica.state == "stopping":
                    replica.process.kill()  # (hung or stopped: TERM would wait out its grace for nothing)
                else:
                    replica.process.terminate()
        for replica in self.replicas:
            if replica.process:
                try:
                    replica.process.wait(timeout=self.options.shutdown_timeout + 5)
                except subprocess.TimeoutExpired:
                    replica.process.kill()
                    replica.process.wait(timeout=10)
        self.owner.stop()
        if self.events is not None:
            self.events.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- routing ----------------------------------------------------------------------
    def check_pin(self, values: list[str]) -> Replica | None:
        """The replica an X-data-parallel-rank header names (none sent: None); ValueError in our
        words for one sent twice, not a replica's number, or a prefill-only replica (it cannot
        serve a whole request)."""
        if not values:
            return None
        n = len(self.replicas)
        if len(values) > 1:
            raise ValueError(f"X-data-parallel-rank was sent {len(values)} times: send it once")
        pin = values[0].strip()
        if not (pin.isascii() and pin.isdigit() and len(pin) <= 6 and int(pin) < n):
            raise ValueError(f"X-data-parallel-rank must be a replica's number, 0 to {n - 1}")
        replica = self.replicas[int(pin)]
        if replica.role == "prefill":
            serving = [r.rank for r in self.replicas if r.role != "prefill"]
            raise ValueError(f"replica {replica.rank} only prefills (--prefill-ranks {self.options.prefill_ranks}): "
                             f"pin one that serves whole requests, {serving}")
        return replica

    def up_in(self, role: str) -> list[Replica]:
        return [r for r in self.replicas if r.up and r.role in (role, "both")]

    def order(self, affinity: bytes, role: str) -> list[Replica]:
        """The up replicas of a role to try for a request, best first; LookupError when none is up."""
        live = self.up_in(role)
        if not live:
            raise LookupError(f"no {role} replica is up")
        preferred = live[int.from_bytes(hashlib.sha256(affinity).digest()[:4], "little") % len(live)]
        least = min(live, key=lambda r: r.in_flight)
        first = preferred if preferred.in_flight <= least.in_flight + BUSIER else least
        return [first] + sorted((r for r in live if r is not first), key=lambda r: r.in_flight)


def backend_like(backend):
    """A new backend of the same kind and page size, for a pool started again (the old one's
    pages went with its owner)."""
    if isinstance(backend, vmm.HostBackend):
        return vmm.HostBackend(backend.page_size)
    return vmm.make_backend("cuda", backend.page_size, backend.device.index or 0, shareable=True)


def remove_stale_pool_dirs() -> None:
    """Pool directories a front door killed before it could clean up left behind (`vkv-pool-*`
    in the temporary directory, this user's, whose front door's process is gone)."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "vkv-pool-*")):
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            with open(os.path.join(path, PID_FILE)) as f:
                pid = int(f.read().strip() or 0)
            os.kill(pid, 0)  # alive: someone's pool
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            log.info("vkv: removed %s, left by a front door that is gone", path)
        except (OSError, ValueError):  # not ours to judge (no pid file, unreadable)
            continue


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
