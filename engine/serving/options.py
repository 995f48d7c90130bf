"""The server's settings and its command-line flags, declared once (no heavy imports here, so
`vkv --help` stays fast)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    max_body_bytes: int = 1 << 20
    body_timeout: float = 30.0  # seconds for a whole request body to arrive
    header_timeout: float = 10.0  # seconds for a request's line and headers to arrive
    timeout_keep_alive: int = 5  # seconds an idle kept-alive connection stays open
    limit_concurrency: int = 512  # connections at once; more get 503
    max_connections_per_peer: int = 64  # connections one address may hold open; more get 429
    max_n: int = 16  # n, best_of and beam width
    max_prompts_per_request: int = 64  # sequences (prompts x max(n, best_of)) one request may ask for
    shutdown_timeout: float = 30.0  # seconds requests in flight get to finish on SIGTERM
    metrics_public: bool = False  # with an API key, /metrics needs it too unless this says otherwise
    isolate_clients: bool = False  # each client's prompts get its identity as cache_salt: no prefix crosses clients
    kv_limit: tuple[str, ...] = ()  # several models: NAME=MIN:MAX of the shared KV pool, bytes or %
    idle_sleep_seconds: float | None = None  # several models: a model idle this long gives its KV pages back
    lora_modules: tuple[str, ...] = ()  # NAME=PATH: LoRA adapters served over the model (needs --enable-lora)
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter answer
    enable_weight_updates: bool = False  # /pause_generation, /continue_generation, /update_weights_from_disk answer
    health_stall_seconds: float = 30.0  # /health is 503 when the engine thread has made no progress this long
    data_parallel_size: int = 1  # > 1: engine processes over one KV pool behind this server (engine/serving/dp/replicas.py)
    prefill_ranks: int = 0  # of those, replicas that only prefill; the others decode (the KV handed over by mapping)
    replica_rank: int | None = None  # set by the front door for the replicas it starts
    data_parallel_backend: str = "mp"  # "ray": the replicas on a Ray cluster behind Ray Serve (engine/serving/dp/ray_serve.py)
    ray_address: str | None = None  # the Ray cluster to join (default: a local Ray of our own, stopped on exit)
    ray_router: str = "prefix"  # "prefix" (vkv's, from the pages each replica holds) | "pow2" | "ray-prefix"
    request_timeout: float = 600.0  # seconds a request may take through the replicas' front door, end to end
    replica_hang_seconds: float = 5.0  # a replica that answers no health probe this long is killed and restarted
    replica_start_timeout: float = 300.0  # a replica not healthy this long after its start is killed and started again
    enable_sleep_routes: bool = False  # POST /sleep and /wake_up answer (vLLM keeps them behind its dev mode)
    pause_wait_seconds: float = 30.0  # a request made while generation is paused waits this long, then 503

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        d = ServerOptions()
        p.add_argument("--host", default=d.host, help="address to bind (default: loopback only)")
        p.add_argument("--port", type=int, default=d.port)
        p.add_argument("--api-key", default=d.api_key, help="require 'Authorization: Bearer KEY' on /v1 and /metrics "
                       "(default: $VKV_API_KEY)")
        p.add_argument("--metrics-public", action="store_true",
                       help="serve /metrics without the API key (its prefix-cache counters tell one client about "
                            "another's prompts)")
        p.add_argument("--isolate-clients", action="store_true",
                       help="salt every request's cached pages with its client (the API key or address, with the "
                            "request's `user`) unless it gives a cache_salt: no client can reuse, or time, another's "
                            "cached prefix")
        p.add_argument("--served-model-name", default=d.served_model_name)
        p.add_argument("--log-level", default=d.log_level)
        dp = p.add_argument_group("replicas: engine processes over one physical KV pool, one front door")
        dp.add_argument("--data-parallel-size", "-dp", type=int, default=d.data_parallel_size,
                        help="engine processes (the cores split between them); a request goes to a replica that is "
                             "not much busier than the others, preferring the one its prefix went to before; every "
                             "replica maps the pages any other computed")
        dp.add_argument("--prefill-ranks", type=int, default=d.prefill_ranks,
                        help="replicas that only prefill: a request's prompt is computed there and its pages are "
                             "mapped by a decoding replica, not copied")
        dp.add_argument("--replica-rank", type=int, default=None, help=argparse.SUPPRESS)
        dp.add_argument("--request-timeout", type=float, default=d.request_timeout,
                        help="seconds a request may take through the front door, end to end (then 504, or an "
                             "error event that ends its stream)")
        dp.add_argument("--replica-hang-seconds", type=float, default=d.replica_hang_seconds,
                        help="a replica answering no health probe is out of rotation at once; this long, and it is "
                             "killed (TERM, then KILL) and restarted")
        dp.add_argument("--replica-start-timeout", type=float, default=d.replica_start_timeout,
                        help="a replica not healthy this long after it started is killed and started again, with "
                             "backoff")
        dp.add_argument("--data-parallel-backend", choices=("mp", "ray"), default=d.data_parallel_backend,
                        help="mp: engine processes on this host over one KV pool; ray: replicas placed by Ray on a "
                             "cluster, Ray Serve in front (pip install -e '.[ray]')")
        dp.add_argument("--ray-address", default=d.ray_address, help="the Ray cluster to join, e.g. 10.0.0.1:6379 "
                        "(default: start a local Ray, stopped on exit)")
        dp.add_argument("--ray-router", choices=("prefix", "pow2", "ray-prefix"), default=d.ray_router,
                        help="prefix: to the replica holding the request's leading pages (from what each replica "
                             "reports it holds), else the less loaded of two; pow2: Ray's power of two choices; "
                             "ray-prefix: Ray's PrefixCacheAffinityRouter (needs ray.serve.llm to import)")
        m = p.add_argument_group("several models (--model NAME=SOURCE, more than once: one KV pool)")
        m.add_argument("--kv-limit", action="append", default=[], metavar="NAME=MIN:MAX",
                       help="a model's floor and cap of the pool, bytes or percent, e.g. chat=10%%:60%%")
        m.add_argument("--idle-sleep-seconds", type=float, default=None,
                       help="a model without requests this long gives its KV pages back until its next request")
        lo = p.add_argument_group("LoRA adapters (with --enable-lora)")
        lo.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                        help="PEFT adapters to serve; a request's `model` names one")
        lo.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="answer /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key): "
                             "they read a directory of this machine")
        rl = p.add_argument_group("reinforcement-learning loops")
        rl.add_argument("--enable-sleep-routes", action="store_true",
                        help="answer POST /sleep and /wake_up (behind the API key): they stop serving until woken "
                             "(vLLM keeps them behind its dev mode)")
        rl.add_argument("--pause-wait-seconds", type=float, default=d.pause_wait_seconds,
                        help="a request made while generation is paused waits this long for it to go on, then gets "
                             "503 with Retry-After")
        rl.add_argument("--enable-weight-updates", action="store_true",
                        help="answer POST /pause_generation, /continue_generation and /update_weights_from_disk "
                             "(behind the API key): they stop generation and read a directory of this machine")
        g = p.add_argument_group("limits")
        g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="largest request body accepted")
        g.add_argument("--body-timeout", type=float, default=d.body_timeout, help="seconds for a body to arrive")
        g.add_argument("--header-timeout", type=float, default=d.header_timeout,
                       help="seconds for a request's headers to arrive")
        g.add_argument("--timeout-keep-alive", type=int, default=d.timeout_keep_alive,
                       help="seconds an idle connection stays open")
        g.add_argument("--limit-concurrency", type=int, default=d.limit_concurrency,
                       help="connections at once; more get 503")
        g.add_argument("--max-connections-per-peer", type=int, default=d.max_connections_per_peer,
                       help="connections one client address may hold open; more get 429")
        g.add_argument("--max-n", type=int, default=d.max_n, help="largest n, best_of or beam width")
        g.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts_per_request,
                       help="most sequences (prompts x n) one request may ask for")
        g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                       help="seconds requests in flight get to finish on SIGTERM")
        g.add_argument("--health-stall-seconds", type=float, default=d.health_stall_seconds,
                       help="/health answers 503 when an engine thread has made no progress this long (a step or "
                            "an I/O call that does not return); a step longer than this is logged")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerOptions:
        values = {f.name: getattr(args, f.name) for f in fields(cls)}
        if values["api_key"] is None:  # as vLLM reads VLLM_API_KEY: a key kept off the command line
            values["api_key"] = os.environ.get("VKV_API_KEY") or None
        return cls(**{**values, "kv_limit": tuple(values["kv_limit"]), "lora_modules": tuple(values["lora_modules"])})
