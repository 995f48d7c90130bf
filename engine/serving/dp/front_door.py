"""The front door of `vkv serve --data-parallel-size N`: one HTTP server before N replicas over
one KV pool (engine/serving/dp/replicas.py, Note [Replicas over one pool], says how they route,
hand prompts over and fail).

A `FrontDoor` holds what every route reads (the replicas, the options, one HTTP client with
the replicas' key) and answers: /health (whether every role has a replica up), /v1/models (any
replica's), /metrics (every replica's series labelled by rank, scraped with a deadline, and the
pool's), and the two generation routes, which check the client's key, body and pin, pick a
replica, send a prompt to a prefill replica first when there are some, and relay the answer;
every wait on a replica has a deadline and watches the replica's state (`watched`).
`serve_replicas` starts the replicas and serves the front door until SIGTERM, then stops them.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.config import EngineConfig
from engine.serving.http import BodyGuard, guarded_protocol
from engine.serving.options import ServerOptions
from engine.serving.edge import UNAUTHORIZED, client_of, key_ok, refusal, stream_tail
from engine.serving.dp.replicas import AFFINITY_BYTES, Replica, ReplicaSet

log = logging.getLogger("vkv.server")
PREFILL_ONLY = ("max_completion_tokens", "best_of", "use_beam_search", "logprobs", "top_logprobs", "echo",
                "stream_options", "min_tokens", "prompt_logprobs")  # left out of a request sent to prefill


CONNECT_TIMEOUT = 5.0  # seconds to connect to a replica (loopback: it answers in microseconds when alive)
WATCH = 0.25  # seconds between looks at a forward's replica, its client and its deadline
SCRAPE_TIMEOUT = 1.0  # seconds a replica's /metrics may take; past it, its last sample is shown with its age


class ClientGone(Exception):
    """The client disconnected before its answer: not the replica's failure."""


class ReplicaLost(Exception):
    """The replica went out of rotation (or was started again) while a forward waited on it."""


class RequestTimeout(Exception):
    """The request's own deadline (--request-timeout) passed."""


class FrontDoor:
    def __init__(self, replicas: ReplicaSet, options: ServerOptions):
        self.replicas, self.options = replicas, options
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(options.request_timeout, connect=CONNECT_TIMEOUT),
                                        limits=httpx.Limits(max_connections=1024))
        self.inside = {"authorization": f"Bearer {replicas.key}"}  # the replicas' key, never the client's
        self.fallbacks = {"prefill": 0, "decode": 0}  # whole requests a role's survivors served for the other
        self.scraped: dict[int, tuple[str, float]] = {}  # rank -> its last /metrics text, and when

    def app(self) -> FastAPI:
        app = FastAPI(title="vkv", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(BodyGuard, max_bytes=self.options.max_body_bytes, timeout=self.options.body_timeout)
        app.get("/health")(self.health)
        app.get("/v1/models")(self.models)
        app.get("/metrics")(self.metrics)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat)
        app.router.add_event_handler("shutdown", self.client.aclose)
        app.add_exception_handler(Exception, self.bug)
        return app

    @staticmethod
    async def bug(_, exc: Exception):
        """As one server answers a bug: OpenAI's error object, naming only the exception's type."""
        log.exception("unexpected error", exc_info=exc)
        return refusal(500, f"internal error: {type(exc).__name__}", "internal_error")

    # -- who asks ---------------------------------------------------------------------------
    def authorized(self, request: Request) -> bool:
        return key_ok(request.headers.get("authorization"), self.options.api_key)

    def client_of(self, request: Request, body: dict) -> str:
        """As one server names a client (engine/serving/edge.py)."""
        return client_of(self.options.api_key, request.client.host if request.client else None, body.get("user"))

    # -- the routes -------------------------------------------------------------------------
    @property
    def roles(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.options.prefill_ranks else ("both",)

    async def health(self):
        """200 while every role has a replica up; 503 "degraded" while one has none (the others
        serve whole requests meanwhile), "down" while none is up."""
        replicas = self.replicas.replicas
        up = [r.rank for r in replicas if r.up]
        missing = [role for role in self.roles if not self.replicas.up_in(role)]
        status = "ok" if not missing else ("degraded" if up else "down")
        body = {"status": status, "replicas_up": up, "replicas": len(replicas), "roles_down": missing,
                "states": {str(r.rank): r.state for r in replicas}}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def models(self, request: Request):
        if not self.authorized(request):
            return refusal(401, UNAUTHORIZED, "authentication_error")
        for replica in [r for r in self.replicas.replicas if r.up]:
            try:
                answer = await self.client.get(replica.url + "/v1/models", headers=self.inside, timeout=SCRAPE_TIMEOUT)
                return Response(answer.content, answer.status_code, media_type="application/json")
            except httpx.HTTPError:
                continue
        return refusal(503, "no replica is up", "service_unavailable", retry_after=1)

    async def metrics(self, request: Request):
        """Every replica's series labelled by rank, each scraped at once with a deadline: a replica
        that hangs shows its last sample, with that sample's age, and never holds the scrape."""
        if not self.options.metrics_public and not self.authorized(request):
            return refusal(401, UNAUTHORIZED, "authentication_error")
        replicas = self.replicas.replicas
        await asyncio.gather(*(self._scrape(r) for r in replicas if r.up))
        now = asyncio.get_running_loop().time()
        lines, handed, copied, ages = [], 0, 0, []
        for replica in replicas:
            text, when = self.scraped.get(replica.rank, ("", None))
            ages.append(f'vkv:replica_metrics_age_seconds{{rank="{replica.rank}"}} '
                        f'{now - when if when is not None else float("nan"):.3f}')
            lines += _labelled(text, replica.rank)
            if replica.role == "decode":  # the handoff: pages mapped that a prefill replica computed,
                handed += int(_sample(text, "vkv:prefix_cache_imported_pages_total"))  # and bytes copied
                copied += int(_sample(text, "vkv:prefix_cache_partial_bytes_copied_total"))
        pool, sets = self.replicas.owner.stats(), self.replicas
        for name, value, what in (("vkv:pool_pages_total", pool["total"], "gauge"),
                                  ("vkv:pool_pages_free", pool["free"], "gauge"),
                                  ("vkv:pool_pages_cached", pool["cached"], "gauge"),
                                  ("vkv:pool_pages_named", pool["named"], "gauge"),
                                  ("vkv:pool_processes", pool["processes"], "gauge"),
                                  ("vkv:pool_pages_recovered_total", pool["recovered"], "counter"),
                                  ("vkv:pool_connections_refused_total", pool["refused"], "counter"),
                                  ("vkv:pool_owner_restarts_total", sets.owner_restarts, "counter"),
                                  ("vkv:kv_handoff_pages_total", handed, "counter"),
                                  ("vkv:kv_handoff_bytes_copied_total", copied, "counter"),
                                  ("vkv:replica_restarts_total", sum(r.restarts for r in replicas), "counter"),
                                  ("vkv:replica_kills_total", sum(r.kills for r in replicas), "counter")):
            lines += [f"# TYPE {name} {what}", f"{name} {value}"]
        lines += ["# TYPE vkv:replica_up gauge"] + [f'vkv:replica_up{{rank="{r.rank}"}} {int(r.up)}' for r in replicas]
        lines += ["# TYPE vkv:replica_metrics_age_seconds gauge"] + ages
        lines += ["# TYPE vkv:replica_role_fallbacks_total counter"] + [
            f'vkv:replica_role_fallbacks_total{{role="{role}"}} {n}' for role, n in self.fallbacks.items()]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def _scrape(self, replica: Replica) -> None:
        try:
            answer = await self.client.get(replica.url + "/metrics", headers=self.inside, timeout=SCRAPE_TIMEOUT)
            self.scraped[replica.rank] = (answer.text, asyncio.get_running_loop().time())
        except httpx.HTTPError:
            pass

    async def completions(self, request: Request):
        return await self.generate(request, "/v1/completions")

    async def chat(self, request: Request):
        return await self.generate(request, "/v1/chat/completions")

    # -- a generation request -----------------------------------------------------------------
    async def generate(self, request: Request, path: str):
        """Checked here (key, JSON object, pin), prefilled first where there are prefill replicas,
        then sent whole to the pinned replica or the first of the others' order; a replica that
        fails or goes out of rotation before the client saw anything passes it to the next."""
        if not self.authorized(request):
            return refusal(401, UNAUTHORIZED, "authentication_error")
        content = await request.body()
        try:
            body = json.loads(content)
        except (ValueError, RecursionError):  # (nested past Python's recursion limit)
            return refusal(400, "invalid request: body: not JSON, or nested too deep")
        if not isinstance(body, dict):
            return refusal(400, "invalid request: body: a JSON object is expected")
        try:
            pinned = self.replicas.check_pin(request.headers.getlist("x-data-parallel-rank"))
        except ValueError as exc:
            return refusal(400, str(exc))
        start = json.dumps(body.get("prompt", body.get("messages")), sort_keys=True)[:AFFINITY_BYTES].encode()
        who, deadline = self.client_of(request, body), asyncio.get_running_loop().time() + self.options.request_timeout
        if pinned is not None:
            if not pinned.up:
                return refusal(503, f"replica {pinned.rank} is down (restarting)", "service_unavailable", retry_after=2)
            order = [pinned]
        else:
            try:
                order = await self.route(body, start, who, deadline)
            except LookupError:
                return refusal(503, "no replica is up (restarting)", "service_unavailable", retry_after=2)
        tried = []
        while order:
            for replica in order:
                tried.append(replica)
                answer = await self.forward(request, replica, path, content, who, bool(body.get("stream")), deadline)
                if answer is not None:
                    return answer
            # every replica of its order failed it: any other up replica serves it whole, whatever its role
            order = [] if pinned is not None else [r for r in self.replicas.replicas if r.up and r not in tried]
            self.fallbacks["decode"] += any(r.role == "prefill" for r in order)  # (a prefill replica decoding)
        if pinned is not None:
            return refusal(503, f"replica {pinned.rank} failed this request (restarting)", "service_unavailable",
                           retry_after=2)
        return refusal(503, "every replica failed this request", "service_unavailable", retry_after=2)

    async def route(self, body: dict, start: bytes, who: str, deadline: float) -> list[Replica]:
        """The replicas to try, best first; with prefill replicas, the prompt computed on one first.
        A role with no replica up is served by the other: a decode replica computes the prompt
        itself, a prefill replica the whole request (LookupError: none is up at all)."""
        if not self.options.prefill_ranks:
            return self.replicas.order(start, "both")
        if self.replicas.up_in("prefill"):
            await self.prefill(body, start, who, deadline)
        if self.replicas.up_in("decode"):
            if not self.replicas.up_in("prefill"):
                self.fallbacks["prefill"] += 1
            return self.replicas.order(start, "decode")
        self.fallbacks["decode"] += 1
        return self.replicas.order(start, "prefill")

    async def forward(self, request: Request, replica: Replica, path: str, content: bytes, who: str,
                      stream: bool, deadline: float) -> Response | None:
        """The replica's answer, whole or as a relayed stream (its first chunk, a first token or a
        refusal, read before the client sees anything); None if the replica failed, or went out
        of rotation, before that."""
        replica.in_flight += 1
        relayed, generation = False, replica.generation
        try:
            if not stream:
                answer = await self.watched(self.call(replica, path, content, who, False), replica, generation,
                                            deadline, request)
                return Response(answer.content, answer.status_code, media_type="application/json")
            upstream = await self.watched(self.call(replica, path, content, who, True), replica, generation,
                                          deadline, request)
            chunks = upstream.aiter_raw()
            try:
                first = await self.watched(anext(chunks, b""), replica, generation, deadline, request)
            except BaseException:
                await upstream.aclose()
                raise
            relayed = True
            return StreamingResponse(self.relay(first, chunks, upstream, replica, generation, deadline),
                                     status_code=upstream.status_code,
                                     media_type=upstream.headers.get("content-type", "text/event-stream"))
        except ClientGone:  # the client left: the replica aborts it; nobody is marked down
            return Response(status_code=499)
        except RequestTimeout:
            return refusal(504, f"the request took more than --request-timeout {self.options.request_timeout:g} s",
                           "timeout")
        except (httpx.TransportError, ReplicaLost) as exc:  # nothing reached the client: another computes it
            log.warning("vkv: replica %d %s before answering: sending the request to another", replica.rank,
                        "went out of rotation" if isinstance(exc, ReplicaLost) else "failed")
            replica.up = False  # until its probes answer again (or it is restarted)
            return None
        finally:
            if not relayed:  # else the relay lets go when the stream ends
                replica.in_flight -= 1

    async def watched(self, work, replica: Replica, generation: int, deadline: float,
                      request: Request | None = None):
        """Await work on a replica, looking every WATCH seconds: ClientGone if the client left,
        ReplicaLost if the replica went out of rotation or was started again meanwhile,
        RequestTimeout past the deadline (the work is cancelled: its replica aborts the request)."""
        task, loop = asyncio.ensure_future(work), asyncio.get_running_loop()
        task.add_done_callback(_retrieved)  # (given up on, it may still end with its replica's error)
        try:
            while True:
                done, _ = await asyncio.wait([task], timeout=WATCH)
                if done:
                    return task.result()
                if request is not None and await request.is_disconnected():
                    raise ClientGone()
                if not replica.up or replica.generation != generation:
                    raise ReplicaLost()
                if loop.time() > deadline:
                    raise RequestTimeout()
        finally:
            if not task.done():
                task.cancel()

    async def call(self, replica: Replica, path: str, content: bytes, client_id: str, stream: bool):
        headers = {**self.inside, "content-type": "application/json", "x-vkv-client": client_id}
        upstream = self.client.build_request("POST", replica.url + path, content=content, headers=headers)
        return await self.client.send(upstream, stream=stream)

    async def prefill(self, body: dict, start: bytes, who: str, deadline: float) -> None:
        """The prompt computed on a prefill replica, its pages published in the pool (none could:
        the decode replica computes it)."""
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        only = {**body, "max_tokens": 1, "stream": False, "n": 1}
        for name in PREFILL_ONLY:
            only.pop(name, None)
        for replica in self.replicas.order(start, "prefill"):
            replica.in_flight += 1
            try:  # (a refusal: the decode replica says why)
                await self.watched(self.call(replica, path, json.dumps(only).encode(), who, False), replica,
                                   replica.generation, deadline)
                return
            except (httpx.TransportError, ReplicaLost):
                continue
            except RequestTimeout:
                return
            finally:
                replica.in_flight -= 1

    async def relay(self, first: bytes, chunks, upstream: httpx.Response, replica: Replica, generation: int,
                    deadline: float):
        """The stream, chunk by chunk, each awaited as `watched` awaits: a replica that stops
        answering, or the request's deadline, ends it with an error event and [DONE]."""
        try:
            yield first
            while True:
                try:
                    chunk = await self.watched(anext(chunks, None), replica, generation, deadline)
                except ReplicaLost:
                    yield stream_tail(f"replica {replica.rank} stopped answering during the stream")
                    return
                except RequestTimeout:
                    yield stream_tail(f"the request took more than --request-timeout "
                                      f"{self.options.request_timeout:g} s", "timeout", 504)
                    return
                if chunk is None:
                    return
                yield chunk
        except httpx.HTTPError:
            yield stream_tail(f"replica {replica.rank} failed during the stream")
        finally:
            replica.in_flight -= 1
            try:  # (a read cancelled part way leaves the upstream stream unusable: closing it may raise)
                await upstream.aclose()
            except Exception:
                pass


def build_front_door(replicas: ReplicaSet, options: ServerOptions) -> FastAPI:
    return FrontDoor(replicas, options).app()


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


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
    if config.kv_layout == "paged":
        raise SystemExit("vkv serve: --data-parallel-size runs replicas over one pool of virtual KV pages: give "
                         "--kv-layout per_layer or interleaved")
    if config.device.type == "cuda":  # one device: the owner's pages, exported to every replica
        print("vkv: replicas on one GPU share its pages by cuMemExportToShareableHandle (run on an H100 by "
              "benchmarks/gpu_suite.py: two replicas, no tiers or tensor parallelism beside them)", flush=True)
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
        uvicorn.run(app, host=options.host, port=options.port, log_level=options.log_level, http=guarded_protocol(options),
                    timeout_keep_alive=options.timeout_keep_alive, limit_concurrency=options.limit_concurrency,
                    timeout_graceful_shutdown=options.shutdown_timeout)
    finally:
        replicas.stop()
