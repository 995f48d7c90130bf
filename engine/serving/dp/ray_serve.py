"""Replicas on a Ray cluster behind Ray Serve, each request routed to the replica that holds its
prefix (`vkv serve --data-parallel-size N --data-parallel-backend ray [--ray-address ADDR]`).

Note [Replicas on Ray Serve]
----------------------------
Rationale. Traffic that outgrows one machine runs replicas on several, and a request whose
prefix one replica already computed costs a fraction there of what it costs anywhere else
(a 1,000-token system prompt: ~3.7 s to compute on a 2-core CPU, ~0.1 s to find). Ray Serve
places replicas on a cluster, restarts them when they die and lets a deployment bring its own
request router. Ray's own prefix router (`PrefixCacheAffinityRouter`) guesses from the request
text and imports only beside vLLM or SGLang; vkv's router reads what each replica holds.

Approach.
  VKVIngress    one small deployment behind Ray's HTTP proxy: every route of vkv's server is
                forwarded whole (method, path, query, headers, body) to a replica the router
                picks, and the answer streams back as the replica wrote it. It tokenizes the
                prompt once (engine/request/inputs.py, as the replica will) so the router can name its
                pages; a replica that dies before answering is replaced by another, once.
  VKVReplica    N replicas, each placed by Ray with its share of the cluster's CPUs: vkv's own
                app (engine/serving/api/server.py make_app) over its engine, called in process, so
                every route, check, limit and error is the one-machine server's. Its routing
                stats (Ray polls them every STATS_PERIOD s) say which pages it holds (the pool's
                prefix cache and its tiers, by name), how it names them (namespace, page
                boundaries) and how busy it is; check_health fails when its engine died or
                stalled, and Ray starts another.
  PrefixRouter  vkv's RequestRouter: names the request's pages as the replicas do
                (engine/kv/prefix_cache.py) and sends it to the replica holding the most
                leading pages, or the one a request with those pages was just sent to (so a
                burst of one new prefix lands in one place before the stats say so; what was
                sent before any stats said how pages are named is named once they do), unless
                that replica is more than BUSIER requests busier than the least busy; with no
                holder, the less busy of two picked at random (Ray's power of two choices).
`--ray-router pow2` uses Ray's power of two instead, `ray-prefix` Ray's prefix router (where it
imports), to compare.

Limitations. The ingress is one replica (Ray's proxy runs on the head node): a request's bytes
pass through it. /metrics answers for the replica it reaches; Ray's dashboard and Prometheus
endpoint see them all. A request for a LoRA adapter has names the router cannot compute (the
adapter's digest): it goes where its prefix went before, else by load. With --isolate-clients
the router names a request's pages with its client's salt, as the replica does, and answers
carry no X-VKV-Replica (which replica answered would tell of other clients' prompts). The
routes that change one engine (ONE_ENGINE_ROUTES: sleep, new weights, adapters, KV limits) are
refused: forwarded, each would reach one replica. The replicas do not share a KV pool: pages
cross no machine.
"""
# (no `from __future__ import annotations`: Ray Serve's ingress hands the handlers' annotations
# to FastAPI as they are, and FastAPI cannot resolve strings from Ray's module)
import argparse
import asyncio
import functools
import json
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from engine.kv.prefix_cache import chain_hash, root_name
from engine.kv.publisher import block_hash
from engine.serving.edge import client_of, client_salt, refusal, stream_tail
from engine.serving.http import body_once
from engine.serving.options import ServerOptions

log = logging.getLogger("vkv.ray")
APP = "vkv"
STATS_PERIOD = 1.0  # seconds between a replica's routing stats
BUSIER = 2  # requests in flight past the least busy replica's before the prefix's holder gives way
EXPECT_SECONDS = 30.0  # a prefix just routed counts as held where it went for this long
MAX_REPORTED = 200_000  # page names a replica reports at most (the most recently used)
RETRIES = 1  # a request whose replica died before answering goes to another this many times
# Routes that change one engine's state: forwarded, each would reach one replica of N (new weights
# on one, an adapter on one, one asleep while its health check passes), so the ingress refuses them
ONE_ENGINE_ROUTES = frozenset({"/sleep", "/wake_up", "/pause_generation", "/continue_generation",
                               "/update_weights_from_disk", "/kv_limits", "/v1/load_lora_adapter",
                               "/v1/unload_lora_adapter"})
HOP_BY_HOP = {b"content-length", b"transfer-encoding", b"connection", b"keep-alive"}


@dataclass(frozen=True)
class RouteKey:
    """What the router reads of a request: its prompt's token ids (None: no prompt it could
    read; the replica answers that request's error) and its cache_salt."""
    token_ids: tuple[int, ...] | None = None
    cache_salt: str | None = None


def route_key(tokenizer, vocab_size: int, path: str, body: bytes,
              client: Callable[[object], str] | None = None) -> RouteKey:
    """The prompt's tokens as the replica will make them (engine/request/inputs.py), or an empty
    key. client: with --isolate-clients, who asks given the body's `user` (edge.client_of, the
    rule the replica follows): a request without a cache_salt is named with its client's salt,
    as the replica names it, so no client's routing depends on another's prompts."""
    from engine.request.inputs import chat_prompt, tokenize
    try:
        request = json.loads(body) if body else None
        if not isinstance(request, dict):
            return RouteKey()
        salt = request.get("cache_salt") if isinstance(request.get("cache_salt"), str) else None
        if salt is None and client is not None:
            salt = client_salt(client(request.get("user")))
        if path.endswith("/chat/completions"):
            prompt = chat_prompt(tokenizer, request["messages"], request.get("tools"))
        elif path.endswith("/completions"):
            prompt = request["prompt"]
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # several prompts: the first one's prefix
            prompt = tokenize(tokenizer, vocab_size, prompt)
        else:
            return RouteKey()
        return RouteKey(tuple(prompt.token_ids), salt)
    except Exception:  # anything the replica will refuse with a 4xx: no preference
        return RouteKey()


def page_names(key: RouteKey, namespace: bytes, page_ends: list[int]) -> list[int]:
    """The names (as block hashes) of the request's complete prompt pages, as its replica names them."""
    if not key.token_ids:
        return []
    names, parent, start = [], root_name(namespace, key.cache_salt), 0
    for end in page_ends:
        if end > len(key.token_ids) - 1:  # the last prompt token is always computed
            break
        parent = chain_hash(parent, key.token_ids[start:end])
        names.append(block_hash(parent))
        start = end
    return names


# -- the replica ---------------------------------------------------------------------------
class VKVReplica:
    """vkv's server app over one engine, in this Ray actor."""

    def __init__(self, args):
        from engine.serving.api.server import make_app
        self.rank = 0
        try:  # its place among the replicas: its KV events' rank and port offset, X-VKV-Replica
            from ray import serve
            rank = serve.get_replica_context().rank
            self.rank = args.data_parallel_rank = int(getattr(rank, "rank", rank) or 0)
        except Exception:
            pass
        options = ServerOptions.from_cli_args(args)
        self.app, self.engines, what = make_app(args, options)
        self.engine = next(iter(self.engines.values()))
        kv = self.engine.engine.kv
        ends, k = [], 0
        while kv.layout.page_end(k) <= self.engine.max_model_len:
            ends.append(kv.layout.page_end(k))
            k += 1
        self.page_ends = ends
        self.shows_rank = not options.isolate_clients  # which replica answered tells of other clients' prompts
        log.info("vkv: Ray replica serving %s", what)

    async def handle(self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes,
                     client: str, key: RouteKey):
        """The app's answer: first {"status", "headers"}, then the body's chunks as it writes them."""
        sent: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()

        async def disconnect():
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
                 "root_path": "", "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
                 "client": (client, 0), "server": ("127.0.0.1", 0)}
        task = asyncio.ensure_future(self.app(scope, body_once(body, disconnect), sent.put))
        try:
            while True:
                getter = asyncio.ensure_future(sent.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():  # the app returned (or raised) with nothing more to send
                    getter.cancel()
                    task.result()
                    return
                message = getter.result()
                if message["type"] == "http.response.start":
                    yield {"status": message["status"], "headers": [(k.decode("latin-1"), v.decode("latin-1"))
                                                                   for k, v in message.get("headers", [])]
                           + ([("x-vkv-replica", str(self.rank))] if self.shows_rank else [])}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        return
        finally:  # the client left, or the answer is whole
            gone.set()
            if not task.done():
                task.cancel()

    def record_routing_stats(self) -> dict:
        """What this replica holds and how busy it is, for the router (Ray polls it)."""
        kv = self.engine.engine.kv
        held = []
        try:  # (list() of a dict is one step under the GIL: the engine thread cannot change it midway)
            if kv.prefix_cache is not None:
                held = list(kv.prefix_cache.entries)[-MAX_REPORTED:]
            if kv.tiers is not None:
                held += [n for tier in (kv.tiers.host, kv.tiers.disk) if tier is not None
                         for n in list(tier.entries if tier is kv.tiers.host else tier.index)[-MAX_REPORTED:]]
        except RuntimeError:
            pass
        stats = self.engine.stats
        return {"namespace": kv.namespace.hex(), "page_ends": self.page_ends,  # (as of now: weights may change it)
                "held": [block_hash(n) for n in held], "running": stats.num_running,
                "waiting": stats.num_waiting, "hits": stats.kv.prefix_cache_hits}

    def check_health(self) -> None:
        if self.engine.dead:
            raise RuntimeError(f"the engine died: {self.engine.dead}")
        if why := self.engine.stalled():
            raise RuntimeError(why)

    def __del__(self):
        for engine in getattr(self, "engines", {}).values():
            engine.shutdown()


# -- the router (engine/serving/dp/ray_router.py) ---------------------------------------------
def router_config(choice: str):
    from ray.serve.config import RequestRouterConfig
    if choice == "prefix":
        cls = "engine.serving.dp.ray_router:PrefixRouter"
    elif choice == "pow2":
        cls = "ray.serve._private.request_router.pow_2_router:PowerOfTwoChoicesRequestRouter"
    else:
        try:
            from ray.serve.llm.request_router import PrefixCacheAffinityRouter as cls
        except ImportError as exc:
            raise SystemExit(f"vkv serve: --ray-router ray-prefix: Ray's prefix router does not import here ({exc}); "
                             f"it needs vLLM or SGLang installed. Use --ray-router prefix (vkv's) or pow2") from None
    return RequestRouterConfig(request_router_class=cls, request_routing_stats_period_s=STATS_PERIOD,
                               request_routing_stats_timeout_s=10.0)


# -- the ingress ---------------------------------------------------------------------------
def ingress_class(options: ServerOptions, model: str | None):
    from ray import serve

    from engine.models import load_tokenizer

    api = FastAPI(title="vkv on Ray Serve", docs_url=None, redoc_url=None)

    @serve.ingress(api)
    class VKVIngress:
        def __init__(self, replicas):
            self.replicas = replicas.options(stream=True)
            self.tokenizer = load_tokenizer(model)
            self.vocab_size = len(self.tokenizer)

        @api.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT"])
        async def forward(self, path: str, request: Request):
            body = b""
            async for chunk in request.stream():
                body += chunk
                if len(body) > options.max_body_bytes:
                    return refusal(413, f"request body exceeds {options.max_body_bytes} bytes")
            path = "/" + path
            if path in ONE_ENGINE_ROUTES:
                return refusal(400, f"{path} changes one engine, and behind Ray Serve it would reach one replica of "
                                    f"{options.data_parallel_size}: not served here")
            client = request.client.host if request.client else ""
            who = functools.partial(client_of, options.api_key, client) if options.isolate_clients else None
            key = await asyncio.to_thread(route_key, self.tokenizer, self.vocab_size, path, body, who) \
                if request.method == "POST" else RouteKey()
            headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("host",)]
            for attempt in range(RETRIES + 1):
                answer = self.replicas.handle.remote(request.method, path, request.url.query, headers, body, client, key)
                try:
                    head = await answer.__anext__()
                    break
                except Exception as exc:  # the replica died (or was lost) before answering
                    log.warning("vkv: a replica failed before answering (%s)%s", exc,
                                ": sending the request to another" if attempt < RETRIES else "")
            else:
                return refusal(503, "no replica could answer the request; try again", "service_unavailable")
            streaming = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in head["headers"])

            async def rest():
                try:
                    async for chunk in answer:
                        yield chunk
                except Exception as exc:  # the replica died mid-answer: said, never silently cut
                    log.warning("vkv: a replica failed during an answer: %s", exc)
                    if streaming:
                        yield stream_tail("the replica serving this request failed during the stream")

            kept = {k: v for k, v in head["headers"] if k.lower().encode() not in HOP_BY_HOP}
            return StreamingResponse(rest(), status_code=head["status"], headers=kept)

    return VKVIngress


def _serve_address() -> tuple[str, int] | None:
    """Where the cluster's Serve proxies listen (a Serve already running keeps its own)."""
    try:
        from ray.serve.context import _get_global_client
        http = _get_global_client().http_config
        return http.host, http.port
    except Exception:  # (a private API of Ray's: if it moves, the check is skipped)
        return None


# -- the command ---------------------------------------------------------------------------
def serve_on_ray(args, options: ServerOptions) -> None:
    """Deploy N replicas and the ingress as one Ray Serve application, and serve until stopped."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise SystemExit("vkv serve --data-parallel-backend ray needs Ray Serve: pip install -e '.[ray]'") from None
    if options.data_parallel_size < 1:
        raise SystemExit("vkv serve: --data-parallel-size must be >= 1")
    own = options.ray_address is None
    ray.init(address="local" if own else options.ray_address, include_dashboard=False,
             log_to_driver=True, configure_logging=False)
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)) // options.data_parallel_size)
    try:
        serve.start(http_options={"host": options.host, "port": options.port})
        listening = _serve_address()
        if listening not in (None, (options.host, options.port)):
            raise SystemExit(f"vkv serve: Ray Serve on this cluster already listens on {listening[0]}:{listening[1]} "
                             f"(one HTTP address a cluster): serve there (--host/--port) or `serve shutdown` it first")
        replica_args = {k: v for k, v in vars(args).items() if k not in ("func",)}
        replica_args.update(data_parallel_size=1, data_parallel_backend="mp")
        replicas = serve.deployment(VKVReplica, name="VKVReplica").options(
            num_replicas=options.data_parallel_size, max_ongoing_requests=options.limit_concurrency,
            ray_actor_options={"num_cpus": cpus, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(cpus)}}},
            request_router_config=router_config(options.ray_router), health_check_period_s=5,
            health_check_timeout_s=max(30, options.health_stall_seconds + 5),
        ).bind(argparse.Namespace(**replica_args))
        model = (args.model or [None])[-1]
        ingress = serve.deployment(ingress_class(options, model), name="VKVIngress").options(
            num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=options.limit_concurrency,
        ).bind(replicas)
        serve.run(ingress, name=APP, route_prefix="/", blocking=False)
        print(f"vkv: serving {options.data_parallel_size} replicas ({cpus} CPU each, router {options.ray_router}) "
              f"on Ray Serve at http://{options.host}:{options.port}", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        try:
            serve.delete(APP)
            if own:
                serve.shutdown()
        finally:
            ray.shutdown()
        print("vkv: Ray Serve application stopped", flush=True)
