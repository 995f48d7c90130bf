"""The front door of `vkv serve --data-parallel-size N`: one HTTP server before N replicas over
one KV pool (engine/serving/dp/replicas.py, Note [Replicas over one pool], says how they route,
hand prompts over and fail).

A `FrontDoor` holds what every route reads (the replicas, the options, one HTTP client with
the replicas' key) and answers: /health (the replicas up), /v1/models (any replica's), /metrics
(every replica's series labelled by rank, and the pool's), and the two generation routes, which
check the client's key and body, pin or pick a replica, send a prompt to a prefill replica
first when there are some, and relay the answer. `serve_replicas` starts the replicas and
serves the front door until SIGTERM, then stops them.
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


class ClientGone(Exception):
    """The client disconnected before its answer: not the replica's failure."""


class FrontDoor:
    def __init__(self, replicas: ReplicaSet, options: ServerOptions):
        self.replicas, self.options = replicas, options
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                        limits=httpx.Limits(max_connections=1024))
        self.inside = {"authorization": f"Bearer {replicas.key}"}  # the replicas' key, never the client's

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
    async def health(self):
        up = [r.rank for r in self.replicas.replicas if r.up]
        body = {"status": "ok" if up else "down", "replicas_up": up, "replicas": len(self.replicas.replicas)}
        return JSONResponse(body, status_code=200 if up else 503)

    async def models(self, request: Request):
        if not self.authorized(request):
            return refusal(401, UNAUTHORIZED, "authentication_error")
        try:
            live = self.replicas.order(None, b"", "both" if not self.options.prefill_ranks else "decode")
        except LookupError as exc:
            return refusal(503, str(exc), "service_unavailable")
        for replica in live:
            try:
                answer = await self.client.get(replica.url + "/v1/models", headers=self.inside)
                return Response(answer.content, answer.status_code, media_type="application/json")
            except httpx.HTTPError:
                continue
        return refusal(503, "no replica is up", "service_unavailable")

    async def metrics(self, request: Request):
        if not self.options.metrics_public and not self.authorized(request):
            return refusal(401, UNAUTHORIZED, "authentication_error")
        lines, handed, copied = [], 0, 0
        for replica in self.replicas.replicas:
            try:
                text = (await self.client.get(replica.url + "/metrics", headers=self.inside, timeout=5.0)).text
            except httpx.HTTPError:
                continue
            lines += _labelled(text, replica.rank)
            if replica.role == "decode":  # the handoff: pages mapped that a prefill replica computed,
                handed += int(_sample(text, "vkv:prefix_cache_imported_pages_total"))  # and bytes copied
                copied += int(_sample(text, "vkv:prefix_cache_partial_bytes_copied_total"))
        pool = self.replicas.owner.stats()
        for name, value, what in (("vkv:pool_pages_total", pool["total"], "gauge"),
                                  ("vkv:pool_pages_free", pool["free"], "gauge"),
                                  ("vkv:pool_pages_cached", pool["cached"], "gauge"),
                                  ("vkv:pool_pages_named", pool["named"], "gauge"),
                                  ("vkv:pool_processes", pool["processes"], "gauge"),
                                  ("vkv:pool_pages_recovered_total", pool["recovered"], "counter"),
                                  ("vkv:kv_handoff_pages_total", handed, "counter"),
                                  ("vkv:kv_handoff_bytes_copied_total", copied, "counter"),
                                  ("vkv:replica_restarts_total", sum(r.restarts for r in self.replicas.replicas),
                                   "counter")):
            lines += [f"# TYPE {name} {what}", f"{name} {value}"]
        lines += ["# TYPE vkv:replica_up gauge"] + [f'vkv:replica_up{{rank="{r.rank}"}} {int(r.up)}'
                                                      for r in self.replicas.replicas]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def completions(self, request: Request):
        return await self.generate(request, "/v1/completions")

    async def chat(self, request: Request):
        return await self.generate(request, "/v1/chat/completions")

    # -- a generation request -----------------------------------------------------------------
    async def generate(self, request: Request, path: str):
        """Checked here (key, JSON object), prefilled first where there are prefill replicas, then
        sent whole to the pinned replica or the first of the others' order; a replica that fails
        before the client saw anything passes it to the next."""
        if not self.authorized(request):
            return refusal(401, UNAUTHORIZED, "authentication_error")
        content = await request.body()
        try:
            body = json.loads(content)
        except (ValueError, RecursionError):  # (nested past Python's recursion limit)
            return refusal(400, "invalid request: body: not JSON, or nested too deep")
        if not isinstance(body, dict):
            return refusal(400, "invalid request: body: a JSON object is expected")
        start = json.dumps(body.get("prompt", body.get("messages")), sort_keys=True)[:AFFINITY_BYTES].encode()
        who, pin = self.client_of(request, body), request.headers.get("x-data-parallel-rank")
        if self.options.prefill_ranks and pin is None:
            try:
                await self.prefill(body, start, who)
            except LookupError as exc:
                return refusal(503, str(exc), "service_unavailable")
        try:
            order = self.replicas.order(pin, start, "decode" if self.options.prefill_ranks else "both")
        except ValueError as exc:
            return refusal(400, str(exc))
        except LookupError as exc:
            return refusal(503, str(exc), "service_unavailable")
        for replica in order:
            answer = await self.forward(request, replica, path, content, who, bool(body.get("stream")))
            if answer is not None:
                return answer
        if pin is not None:
            return refusal(503, f"replica {pin} is down (restarting)", "service_unavailable")
        return refusal(503, "every replica failed this request", "service_unavailable")

    async def forward(self, request: Request, replica: Replica, path: str, content: bytes, who: str,
                      stream: bool) -> Response | None:
        """The replica's answer, whole or as a relayed stream (its first chunk, a first token or a
        refusal, read before the client sees anything); None if the replica failed before that."""
        replica.in_flight += 1
        relayed = False
        try:
            if not stream:
                answer = await _unless_gone(request, self.call(replica, path, content, who, False))
                return Response(answer.content, answer.status_code, media_type="application/json")
            upstream = await self.call(replica, path, content, who, True)
            chunks = upstream.aiter_raw()
            try:
                first = await anext(chunks, b"")
            except BaseException:
                await upstream.aclose()
                raise
            relayed = True
            return StreamingResponse(self.relay(first, chunks, upstream, replica), status_code=upstream.status_code,
                                     media_type=upstream.headers.get("content-type", "text/event-stream"))
        except ClientGone:  # the client left: the replica aborts it; nobody is marked down
            return Response(status_code=499)
        except httpx.TransportError:  # nothing reached the client: the next replica computes it
            log.warning("vkv: replica %d failed a request before answering: sending it to another", replica.rank)
            replica.up = False  # until it answers /health again (or is restarted)
            return None
        finally:
            if not relayed:  # else the relay lets go when the stream ends
                replica.in_flight -= 1

    async def call(self, replica: Replica, path: str, content: bytes, client_id: str, stream: bool):
        headers = {**self.inside, "content-type": "application/json", "x-vkv-client": client_id}
        upstream = self.client.build_request("POST", replica.url + path, content=content, headers=headers)
        return await self.client.send(upstream, stream=stream)

    async def prefill(self, body: dict, start: bytes, who: str) -> None:
        """The prompt computed on a prefill replica, its pages published in the pool."""
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        only = {**body, "max_tokens": 1, "stream": False, "n": 1}
        for name in PREFILL_ONLY:
            only.pop(name, None)
        for replica in self.replicas.order(None, start, "prefill"):
            replica.in_flight += 1
            try:
                await self.call(replica, path, json.dumps(only).encode(), who, False)  # a refusal: decode says why
                return
            except httpx.TransportError:
                continue
            finally:
                replica.in_flight -= 1

    @staticmethod
    async def relay(first: bytes, chunks, upstream: httpx.Response, replica: Replica):
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except httpx.HTTPError:
            yield stream_tail(f"replica {replica.rank} failed during the stream")
        finally:
            replica.in_flight -= 1
            await upstream.aclose()


def build_front_door(replicas: ReplicaSet, options: ServerOptions) -> FastAPI:
    return FrontDoor(replicas, options).app()


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
