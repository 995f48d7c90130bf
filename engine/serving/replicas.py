"""`vkv serve --data-parallel-size N`: N engine processes over one physical KV pool, one front door.

Note [Replicas over one pool]
-----------------------------
Rationale. One engine process uses a few cores well; a large host runs several. Replicas that
each keep a pool of their own compute every shared prefix once per replica, and a request
routed to the "wrong" replica pays the whole prefill. Over one physical pool (vmm/owner.py) a
page any replica computed is mapped by every other in place, so routing only balances load.

Approach. This process owns the pool (a `vmm.PoolOwner` on a thread) and starts N replicas,
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

Limitations. On GPUs the replicas share one device (the owner exports its pages to each; no peer
access across devices yet). One model per replica set (several models: `--model NAME=SOURCE`
without -dp). The proxy adds a loopback hop (well under a millisecond against steps of tens).
The front door reads each body to route it (bounded by --max-body-bytes); adapters loaded at run
time go to one replica only, so they are refused here.
"""
from __future__ import annotations

import asyncio
import ctypes
import hashlib
import hmac
import json
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
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import vmm
from engine.config import EngineConfig
from engine.kv.build import backend_for
from engine.parallel import free_port
from engine.serving.http import BodyGuard
from engine.serving.options import ServerOptions
from engine.serving.protocol import error_body

log = logging.getLogger("vkv.server")
FRONT_DOOR_FLAGS = {"--port", "--host", "--api-key", "--data-parallel-size", "-dp", "--prefill-ranks", "--kv-pool",
                    "--replica-rank", "--data-parallel-rank"}
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
        self.owner = vmm.PoolOwner(backend, max(1, config.kv_budget_bytes(0) // backend.page_size),
                                   os.path.join(self.dir, "pool.sock")).start()
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


def _refuse(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(error_body(message, kind, status), status_code=status)


def build_front_door(replicas: ReplicaSet, options: ServerOptions) -> FastAPI:
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=httpx.Limits(max_connections=1024))
    inside = {"authorization": f"Bearer {replicas.key}"}

    app = FastAPI(title="vkv", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyGuard, max_bytes=options.max_body_bytes, timeout=options.body_timeout)

    def authorized(request: Request) -> bool:
        if options.api_key is None:
            return True
        sent = request.headers.get("authorization", "")
        return hmac.compare_digest(sent.encode(), f"Bearer {options.api_key}".encode())

    def client_of(request: Request, body: dict) -> str:
        """As one server names a client (the key, else the address; with `user`)."""
        who = "key" if options.api_key is not None else (request.client.host if request.client else "unknown")
        user = body.get("user") if isinstance(body.get("user"), str) else None
        return f"{who}/{user}" if user else who

    async def call(replica: Replica, path: str, content: bytes, client_id: str, stream: bool):
        headers = {**inside, "content-type": "application/json", "x-vkv-client": client_id}
        upstream = client.build_request("POST", replica.url + path, content=content, headers=headers)
        return await client.send(upstream, stream=stream)

    @app.get("/health")
    async def health():
        up = [r.rank for r in replicas.replicas if r.up]
        body = {"status": "ok" if up else "down", "replicas_up": up,
                "replicas": len(replicas.replicas)}
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/v1/models")
    async def models(request: Request):
        if not authorized(request):
            return _refuse(401, "invalid or missing API key", "authentication_error")
        try:
            live = replicas.order(None, b"", "both" if not options.prefill_ranks else "decode")
        except LookupError as exc:
            return _refuse(503, str(exc), "service_unavailable")
        for replica in live:
            try:
                answer = await client.get(replica.url + "/v1/models", headers=inside)
                return Response(answer.content, answer.status_code, media_type="application/json")
            except httpx.HTTPError:
                continue
        return _refuse(503, "no replica is up", "service_unavailable")

    @app.get("/metrics")
    async def metrics(request: Request):
        if not options.metrics_public and not authorized(request):
            return _refuse(401, "invalid or missing API key", "authentication_error")
        lines, handed, copied = [], 0, 0
        for replica in replicas.replicas:
            try:
                text = (await client.get(replica.url + "/metrics", headers=inside, timeout=5.0)).text
            except httpx.HTTPError:
                continue
            lines += _labelled(text, replica.rank)
            if replica.role == "decode":  # the handoff: pages mapped that a prefill replica computed,
                handed += int(_sample(text, "vkv:prefix_cache_imported_pages_total"))  # and last pages copied
                copied += int(_sample(text, "vkv:prefix_cache_partial_bytes_copied_total"))
        pool = replicas.owner.stats()
        for name, value, what in (("vkv:pool_pages_total", pool["total"], "gauge"),
                                  ("vkv:pool_pages_free", pool["free"], "gauge"),
                                  ("vkv:pool_pages_cached", pool["cached"], "gauge"),
                                  ("vkv:pool_pages_named", pool["named"], "gauge"),
                                  ("vkv:pool_processes", pool["processes"], "gauge"),
                                  ("vkv:pool_pages_recovered_total", pool["recovered"], "counter"),
                                  ("vkv:kv_handoff_pages_total", handed, "counter"),
                                  ("vkv:kv_handoff_bytes_copied_total", copied, "counter"),
                                  ("vkv:replica_restarts_total", sum(r.restarts for r in replicas.replicas),
                                   "counter")):
            lines += [f"# TYPE {name} {what}", f"{name} {value}"]
        lines += ["# TYPE vkv:replica_up gauge"] + [f'vkv:replica_up{{rank="{r.rank}"}} {int(r.up)}'
                                                      for r in replicas.replicas]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def generate(request: Request, path: str):
        if not authorized(request):
            return _refuse(401, "invalid or missing API key", "authentication_error")
        content = await request.body()
        try:
            body = json.loads(content)
        except ValueError:
            return _refuse(400, "invalid request: body: not JSON")
        if not isinstance(body, dict):
            return _refuse(400, "invalid request: body: a JSON object is expected")
        start = json.dumps(body.get("prompt", body.get("messages")), sort_keys=True)[:AFFINITY_BYTES].encode()
        who, pin = client_of(request, body), request.headers.get("x-data-parallel-rank")
        if options.prefill_ranks and pin is None:
            try:
                await prefill(body, start, who)
            except LookupError as exc:
                return _refuse(503, str(exc), "service_unavailable")
        try:
            order = replicas.order(pin, start, "decode" if options.prefill_ranks else "both")
        except ValueError as exc:
            return _refuse(400, str(exc))
        except LookupError as exc:
            return _refuse(503, str(exc), "service_unavailable")
        stream = bool(body.get("stream"))
        for replica in order:
            replica.in_flight += 1
            relayed = False
            try:
                if not stream:
                    answer = await _unless_gone(request, call(replica, path, content, who, False))
                    return Response(answer.content, answer.status_code, media_type="application/json")
                upstream = await call(replica, path, content, who, True)
                chunks = upstream.aiter_raw()
                try:  # the first chunk (a first token, or a refusal) before the client sees anything
                    first = await anext(chunks, b"")
                except BaseException:
                    await upstream.aclose()
                    raise
                relayed = True
                return StreamingResponse(_relay(first, chunks, upstream, replica), status_code=upstream.status_code,
                                         media_type=upstream.headers.get("content-type", "text/event-stream"))
            except ClientGone:  # the client left: the replica aborts it; nobody is marked down
                return Response(status_code=499)
            except httpx.TransportError:  # nothing reached the client: the next replica computes it
                log.warning("vkv: replica %d failed a request before answering: sending it to another", replica.rank)
                replica.up = False  # until it answers /health again (or is restarted)
                continue
            finally:
                if not relayed:  # else the relay lets go when the stream ends
                    replica.in_flight -= 1
        if pin is not None:
            return _refuse(503, f"replica {pin} is down (restarting)", "service_unavailable")
        return _refuse(503, "every replica failed this request", "service_unavailable")

    async def prefill(body: dict, start: bytes, who: str) -> None:
        """The prompt computed on a prefill replica, its pages published in the pool."""
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        only = {**body, "max_tokens": 1, "stream": False, "n": 1}
        for name in ("max_completion_tokens", "best_of", "use_beam_search", "logprobs", "top_logprobs", "echo",
                     "stream_options", "min_tokens", "prompt_logprobs"):
            only.pop(name, None)
        for replica in replicas.order(None, start, "prefill"):
            replica.in_flight += 1
            try:
                await call(replica, path, json.dumps(only).encode(), who, False)  # a refusal: decode says why
                return
            except httpx.TransportError:
                continue
            finally:
                replica.in_flight -= 1

    async def _relay(first: bytes, chunks, upstream: httpx.Response, replica: Replica):
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except httpx.HTTPError:
            failure = error_body(f"replica {replica.rank} failed during the stream", "service_unavailable", 503)
            yield f"data: {json.dumps(failure)}\n\ndata: [DONE]\n\n".encode()
        finally:
            replica.in_flight -= 1
            await upstream.aclose()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, "/v1/chat/completions")

    @app.on_event("shutdown")
    async def close_client():
        await client.aclose()

    return app


class ClientGone(Exception):
    """The client disconnected before its answer: not the replica's failure."""


async def _unless_gone(request: Request, work):
    """Await an upstream call; if the client disconnects first, cancel it (the replica aborts)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait([task], timeout=0.5)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            raise ClientGone()
    return task.result()


def _sample(text: str, name: str) -> float:
    """The value of an unlabelled sample in a Prometheus exposition (0 if absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _labelled(text: str, rank: int) -> list[str]:
    """A replica's exposition with rank="R" on each sample (HELP/TYPE lines kept once per rank)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition(" ")
        if "{" in name:
            name = name.replace("{", f'{{rank="{rank}",', 1)
        else:
            name = f'{name}{{rank="{rank}"}}'
        out.append(f"{name} {rest}")
    return out


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)


def serve_replicas(args, options: ServerOptions) -> None:
    config = EngineConfig.from_cli_args(args)
    if config.kv_layout == "paged" or config.device.type != "cpu":
        raise SystemExit("vkv serve: --data-parallel-size runs CPU replicas with a virtual kv_layout so far")
    replicas = ReplicaSet(options, config, list(getattr(args, "argv", None) or sys.argv[2:]))
    try:
        print(f"vkv: starting {options.data_parallel_size} replicas over one pool of {replicas.owner.pool.num_pages} "
              f"pages ({options.prefill_ranks} prefill-only), {replicas.threads} threads each", flush=True)
        replicas.wait_ready()
        replicas.supervisor = threading.Thread(target=replicas.supervise, name="vkv-replicas", daemon=True)
        replicas.supervisor.start()
        app = build_front_door(replicas, options)
        print(f"vkv: serving {options.data_parallel_size} replicas on http://{options.host}:{options.port}", flush=True)
        # uvicorn re-raises SIGTERM/SIGINT once it has shut down, with the handler it found: make that
        # an exception, so the replicas are stopped below instead of the process dying past them
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _exit_cleanly)
        uvicorn.run(app, host=options.host, port=options.port, log_level=options.log_level,
                    timeout_keep_alive=options.timeout_keep_alive, limit_concurrency=options.limit_concurrency,
                    timeout_graceful_shutdown=options.shutdown_timeout)
    finally:
        replicas.stop()
