"""`vkv serve`: an OpenAI-compatible HTTP server over the engine, with Prometheus metrics.

Routes: POST /v1/completions, POST /v1/chat/completions (streaming as server-sent events that
end with `data: [DONE]`), GET /v1/models, GET /health, GET /metrics, GET /openapi.json. Binds
127.0.0.1 unless told otherwise; with an API key, /v1 routes want `Authorization: Bearer <key>`.

No request can hurt another's: bad JSON, unknown fields, bad values and prompts that can never
fit get a 400 naming the problem (unknown model 404, wrong key 401, too large 413, too slow
408), each with OpenAI's error object, and nothing reaches the engine. A request that fails
inside the engine fails alone (500, or an error event in its stream). One request may ask for
at most `max_prompts_per_request` sequences (prompts x n), and admission is fair between requests.
A client that disconnects aborts its request, which frees its pages. On SIGTERM the server
stops accepting, lets requests in flight finish for `--shutdown-timeout` seconds, ends the
streams still running with an error event and [DONE], then stops the engine and frees its
memory.

Where things are: the routes, a router per family, in engine/serving/api/routes/ (generation,
models and adapters, admin, health and metrics); what they all read, one `ServerState`, and a
request's checks in engine/serving/api/state.py; how an answer leaves (whole, streamed, tool
calls) in engine/serving/api/streams.py. Here: the app (`build_app`: the state, the body guard,
every failure as OpenAI's error object, the routers), and `vkv serve` on uvicorn.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import threading
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import vmm
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.multi import MultiLLM
from engine.serving.loop.async_engine import AsyncEngine, EngineDeadError, RequestCancelled, Turns
from engine.serving.http import BodyGuard, guarded_protocol
from engine.serving.loop.metrics import Metrics
from engine.serving.options import ServerOptions
from engine.serving.api.protocol import parse_limit
from engine.serving.api.routes import ROUTERS
from engine.serving.api.state import HTTPError, ServerState
from engine.serving.edge import refusal

log = logging.getLogger("vkv.server")


def _with_limits(schema: dict, app: FastAPI, vocab: int, max_n: int) -> dict:
    """The OpenAPI schema with this server's own limits written in: token ids in [0, vocab) (a
    prompt's, stop_token_ids) and n, best_of at most --max-n; cached as FastAPI caches its own."""
    def token_ids(node) -> None:
        if isinstance(node, dict):
            if node.get("type") == "integer":
                node.update(minimum=0, maximum=vocab - 1)
            for child in node.values():
                token_ids(child)
        elif isinstance(node, list):
            for child in node:
                token_ids(child)

    models = schema.get("components", {}).get("schemas", {})
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        properties = models.get(name, {}).get("properties", {})
        for field in ("prompt", "stop_token_ids"):
            token_ids(properties.get(field, {}).get("anyOf") or properties.get(field, {}).get("items"))
        for field in ("n", "best_of"):
            if field in properties:
                for branch in properties[field].get("anyOf", [properties[field]]):
                    if branch.get("type") == "integer":
                        branch["maximum"] = max_n
    app.openapi_schema = schema
    return schema


def build_app(engines: AsyncEngine | dict[str, AsyncEngine], model_name: str | None = None,
              options: ServerOptions = ServerOptions(), group: MultiLLM | None = None,
              adapters: dict[str, str] | None = None) -> FastAPI:
    """The app over one engine (served as model_name) or several ({name: engine}, the models of
    `group`, which share its KV pool); of `options` it reads the API key and the limits.
    adapters: {LoRA adapter name: path} over the (first) model, loaded here; a request's
    `model` names a model or an adapter. The routes are engine/serving/api/routes/, over one
    ServerState (engine/serving/api/state.py)."""
    engines = engines if isinstance(engines, dict) else {model_name: engines}
    state = ServerState(engines, options, group)
    if adapters and not engines[state.default].lora_enabled:
        raise ValueError("LoRA adapters need enable_lora (--enable-lora)")
    taken = [name for name in adapters or {} if name in engines]
    if taken:
        raise ValueError(f"LoRA adapter name {taken[0]!r} is a model's name")
    engines[state.default].load_adapters(adapters or {})

    @asynccontextmanager
    async def lifespan(_):
        yield
        for engine in engines.values():
            engine.shutdown()
        if group is not None:
            group.close()
        print("vkv: engine stopped, KV memory released", flush=True)

    app = FastAPI(title="vkv", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.vkv = state
    vocab = min(e.vocab_size for e in engines.values())
    app.openapi = lambda: app.openapi_schema or _with_limits(FastAPI.openapi(app), app, vocab, options.max_n)
    app.add_middleware(BodyGuard, max_bytes=options.max_body_bytes, timeout=options.body_timeout)
    for kind, handler in _ERRORS.items():
        app.add_exception_handler(kind, handler)
    for router in ROUTERS:  # each route itself on the app (FastAPI 0.165's include_router nests them)
        app.router.routes.extend(router.routes)
    return app


async def _http_error(_, exc: HTTPError):
    return refusal(exc.status, exc.message, exc.kind, exc.retry_after)


async def _dead(_, exc: EngineDeadError):
    return refusal(503, str(exc), "engine_dead")


async def _cancelled(_, exc: RequestCancelled):
    return refusal(503, str(exc), "service_unavailable")


async def _invalid(_, exc: RequestValidationError):
    # A union (a message's roles, text or parts) reports an error per branch: the deepest is
    # the one that says what is wrong; the branches' own labels are left out of its path.
    errors = exc.errors()
    first = max(errors, key=lambda e: len(e.get("loc", ()))) if errors else {}
    labels = {"str", "int", "float", "bool", "dict", "list", "none", "body"}
    where = ".".join(str(p) for p in first.get("loc", ())
                     if isinstance(p, int) or (p not in labels and str(p).isidentifier()))
    return refusal(400, f"invalid request: {where or 'body'}: {first.get('msg', 'malformed body')}")


async def _starlette(_, exc: StarletteHTTPException):
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    return refusal(exc.status_code, str(exc.detail), kind)


async def _bug(_, exc: Exception):
    log.exception("unexpected error", exc_info=exc)
    return refusal(500, f"internal error: {type(exc).__name__}", "internal_error")


# Every failure as OpenAI's error object: a refusal by its status, a dead engine or a stopping
# server 503, a body the schema refuses 400 naming the field, a bug 500 naming only its type.
_ERRORS = {HTTPError: _http_error, EngineDeadError: _dead, RequestCancelled: _cancelled,
           RequestValidationError: _invalid, StarletteHTTPException: _starlette, Exception: _bug}


def _graceful_server(config: uvicorn.Config, engines: list[AsyncEngine], grace: float) -> uvicorn.Server:
    """uvicorn's server, except that streams still running at the end of the grace period end
    with an error event and [DONE] instead of being cut off mid-body."""

    def cancel_all() -> None:
        for engine in engines:
            engine.cancel_all("the server is shutting down")

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            cut = asyncio.get_running_loop().call_later(max(grace - 1.0, 0.0), cancel_all)
            try:
                await super().shutdown(sockets)
            finally:
                cut.cancel()

    return Server(config)


def serve(args, options: ServerOptions) -> None:
    """One server (a replica of a front door's too) on uvicorn, until SIGTERM or SIGINT."""
    if options.replica_rank is not None:
        _title(f"vkv: rank {options.replica_rank}")
    app, async_engines, what = make_app(args, options)
    protocol = guarded_protocol(options)
    print(f"vkv: serving {what} on http://{options.host}:{options.port}", flush=True)
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level, http=protocol,
                            timeout_keep_alive=options.timeout_keep_alive,
                            limit_concurrency=options.limit_concurrency,
                            timeout_graceful_shutdown=options.shutdown_timeout)
    # uvicorn re-raises SIGTERM/SIGINT once it has shut down, with the handler it found: make
    # that a clean exit (status 0) rather than death by signal (143), as supervisors expect.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    server = _graceful_server(config, list(async_engines.values()), options.shutdown_timeout)
    watch = OwnerWatch(server, async_engines)
    try:
        server.run()
    finally:  # when uvicorn did not get as far as the app's shutdown
        watch.stop()
        for async_engine in async_engines.values():
            async_engine.shutdown()
    if watch.gone:
        raise SystemExit(OWNER_GONE_STATUS)


OWNER_GONE_STATUS = 3  # `vkv serve --kv-pool` exits with it when the pool's owner is gone


class OwnerWatch:
    """An engine over a pool another process owns (--kv-pool) cannot go on without the owner:
    its pages can no longer be allocated, looked up or counted. When the owner goes, this ends
    every request in flight with an error that says so and stops the server, which then exits
    with OWNER_GONE_STATUS, so its supervisor (systemd, Kubernetes, the replicas' front door)
    starts it again, attached to the owner that is started again. A thread checks the owner
    every `interval` seconds (a closed socket is seen without a round trip)."""

    def __init__(self, server: uvicorn.Server, engines: dict[str, AsyncEngine], interval: float = 0.25):
        self.server, self.engines, self.interval = server, engines, interval
        self.pools = [e.engine.kv.pool for e in engines.values() if isinstance(e.engine.kv.pool, vmm.AttachedPool)]
        self.gone, self.stopping = False, threading.Event()
        self.thread = threading.Thread(target=self._watch, name="vkv-owner-watch", daemon=True)
        if self.pools:
            self.thread.start()

    def _watch(self) -> None:
        while not self.stopping.wait(self.interval):
            if all(pool.owner_alive() for pool in self.pools):
                continue
            why = (f"the KV pool's owner at {self.pools[0].path} is gone: this server stops (status "
                   f"{OWNER_GONE_STATUS}) to be started again once the owner is back")
            log.error("vkv: %s", why)
            self.gone = True
            for engine in self.engines.values():
                engine.cancel_all(why)
            self.server.should_exit = True
            return

    def stop(self) -> None:
        self.stopping.set()


def make_app(args, options: ServerOptions) -> tuple[FastAPI, dict[str, AsyncEngine], str]:
    """The app `vkv serve` serves, its engines (by served name), and a line saying what it is."""
    adapters = parse_lora_modules(options.lora_modules)
    models = dict(m.split("=", 1) for m in args.model or [] if "=" in m)
    if models:  # several models, one KV pool
        if len(models) != len(args.model):
            raise SystemExit("vkv serve: with several models every --model is NAME=SOURCE")
        config = EngineConfig.from_cli_args(argparse.Namespace(**{**vars(args), "model": None}))
        group = MultiLLM.from_config({name: source or None for name, source in models.items()}, config,
                                     {name: limit for name, limit in map(parse_kv_limit, options.kv_limit)})
        metrics, turns = Metrics(list(models), group.shared), Turns(group.shared_step_tokens)
        async_engines = {name: AsyncEngine(engine, name, metrics, turns, options.idle_sleep_seconds,
                                           options.health_stall_seconds)
                         for name, engine in group.engines.items()}
        app = lora_app(async_engines, options, adapters, group)
        what = f"{', '.join(models)} over one {config.kv_layout} KV pool of {group.shared.pool.num_pages} pages"
    else:
        if options.kv_limit or options.idle_sleep_seconds is not None:
            raise SystemExit("vkv serve: --kv-limit and --idle-sleep-seconds are for several models "
                             "(--model NAME=SOURCE ...)")
        engine = LLMEngine(EngineConfig.from_cli_args(args))
        source = (args.model or [None])[-1]
        name = options.served_model_name or (source.rstrip("/").split("/")[-1] if source else "SmolLM2-135M-Instruct")
        async_engines = {name: AsyncEngine(engine, stall_seconds=options.health_stall_seconds)}
        app = lora_app(async_engines, options, adapters)
        what = f"{name} ({engine.config.kv_layout} KV, {engine.attention.name} attention)"
    if adapters:
        what += f", LoRA adapters {', '.join(adapters)}"
    return app, async_engines, what


def parse_lora_modules(items: tuple[str, ...]) -> dict[str, str]:
    """--lora-modules NAME=PATH ... (or vLLM's JSON form {"name": ..., "path": ...})."""
    adapters = {}
    for item in items:
        try:
            spec = json.loads(item) if item.lstrip().startswith("{") else dict(zip(("name", "path"), item.split("=", 1)))
        except ValueError:
            spec = {}
        if not isinstance(spec, dict) or not spec.get("name") or not spec.get("path"):
            raise SystemExit(f"vkv serve: --lora-modules {item!r}: expected NAME=PATH")
        adapters[spec["name"]] = spec["path"]
    return adapters


def lora_app(engines: dict[str, AsyncEngine], options: ServerOptions, adapters: dict[str, str],
             group: MultiLLM | None = None) -> FastAPI:
    """build_app, with the adapters loaded first: one that does not load stops the server."""
    try:
        return build_app(engines, options=options, group=group, adapters=adapters)
    except ValueError as exc:
        for engine in engines.values():
            engine.shutdown()
        raise SystemExit(f"vkv serve: {exc}") from None


def parse_kv_limit(text: str) -> tuple[str, tuple[float | int, float | int]]:
    """--kv-limit NAME=MIN:MAX, each bytes or a percentage of the pool."""
    name, sep, limits = text.partition("=")
    low, colon, high = limits.partition(":")
    if not (sep and colon and name):
        raise SystemExit(f"vkv serve: --kv-limit {text!r}: expected NAME=MIN:MAX, e.g. chat=10%:60%")
    try:
        return name, (parse_limit(low or 0), parse_limit(high or "100%"))
    except ValueError as exc:
        raise SystemExit(f"vkv serve: --kv-limit {text!r}: {exc}") from None


def _title(title: str) -> None:
    """Name this process for `ps` (vLLM titles its engines the same way), where the OS lets us."""
    try:
        import setproctitle
        setproctitle.setproctitle(title)
    except ImportError:  # the kernel's 15-character name at least
        import ctypes
        try:
            ctypes.CDLL(None).prctl(15, title.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        except (OSError, AttributeError):
            pass


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)
