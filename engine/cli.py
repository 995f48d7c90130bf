"""`vkv`: generate, serve, top, tp-worker, profile-mapping."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from engine import profile_mapping
from engine.config import EngineConfig, KVEventsConfig
from engine.serving.options import ServerOptions


def cmd_generate(args: argparse.Namespace) -> None:
    from engine import LLM, SamplingParams

    from engine.request.lora_request import LoRARequest

    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens)
    config = EngineConfig.from_cli_args(args)
    if args.lora is not None and not config.enable_lora:
        raise SystemExit("vkv generate: --lora needs --enable-lora")
    if config.enable_lora and args.lora is None:
        raise SystemExit("vkv generate: --enable-lora without --lora PATH would change nothing")
    llm = LLM.from_config(config)
    lora = LoRARequest("cli", 1, args.lora) if args.lora else None
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=not args.json,
                        lora_request=lora)
    else:
        outs = llm.generate(args.prompts, params, use_tqdm=not args.json, lora_request=lora)
    for prompt, out in zip(args.prompts, outs):
        if args.json:
            print(json.dumps({"prompt": prompt, "outputs": [
                {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                for o in out.outputs]}))
            continue
        print(f"\n>>> {prompt}")
        for o in out.outputs:
            print(("" if len(out.outputs) == 1 else f"[{o.index}] ") + o.text.strip())
    if not args.json:
        s = llm.stats()
        print(f"\n[vkv] {s.kv.layout} KV, {s.attention_backend} attention, peak {s.kv.peak_pages_mapped} "
              f"pages of {s.kv.page_size >> 10} KiB mapped, {s.preemptions} preemptions", file=sys.stderr)
    llm.engine.close()  # tensor parallel: the workers stop with it


def cmd_serve(args: argparse.Namespace) -> None:
    """One server; engine processes over one KV pool behind a front door (engine/serving/dp/replicas.py);
    or replicas on a Ray cluster behind Ray Serve (engine/serving/dp/ray_serve.py)."""
    from engine.serving.options import ServerOptions

    options = ServerOptions.from_cli_args(args)
    if args.kv_events_config is not None:  # under --isolate-clients, no tenant's tokens on the wire
        events = KVEventsConfig.of(args.kv_events_config).for_tenants(options.isolate_clients)
        args.kv_events_config = dataclasses.asdict(events)
    if options.data_parallel_backend == "ray":
        from engine.serving.dp.ray_serve import serve_on_ray
        serve_on_ray(args, options)
    elif options.data_parallel_size > 1:
        from engine.serving.dp.front_door import serve_replicas
        serve_replicas(args, options)
    else:
        from engine.serving.api.server import serve
        serve(args, options)


def cmd_tp_worker(args: argparse.Namespace) -> None:
    from engine.worker.parallel import worker_main

    config = EngineConfig.from_cli_args(args)
    if not config.distributed_init or config.tensor_parallel_size < 2:
        raise ValueError("a tensor-parallel worker needs --distributed-init and --tensor-parallel-size >= 2")
    if not 1 <= args.rank < config.tensor_parallel_size:
        raise ValueError(f"--rank must be in [1, {config.tensor_parallel_size - 1}]")
    worker_main(config, args.rank, config.tensor_parallel_size, config.distributed_init)


def cmd_top(args: argparse.Namespace) -> None:
    from engine import top

    top.main(args.url, args.api_key, args.interval, args.once)


def cmd_profile_mapping(args: argparse.Namespace) -> None:
    profile_mapping.run(args, "vkv profile-mapping " + " ".join(sys.argv[2:]))


def cmd_pool_owner(args: argparse.Namespace) -> None:
    """Own a physical KV pool that engine processes started with --kv-pool SOCKET draw from."""
    import signal

    import torch

    import vmm
    from engine.config import DEFAULT_HOST_PAGE
    device = torch.device(args.device)
    if device.type == "cuda":  # pages created shareable: each engine process imports them
        backend = vmm.make_backend("cuda", args.page_size, device.index or 0, shareable=True)
    else:
        backend = vmm.HostBackend(args.page_size or DEFAULT_HOST_PAGE)
    from engine.config import KVEventsConfig
    from engine.kv.pool_events import PoolEvents
    events_config = KVEventsConfig.of(args.kv_events_config) if args.kv_events_config is not None else None
    announce = events_config is not None and events_config.publishes
    num_pages = max(1, args.kv_cache_memory // backend.page_size)
    cap = None if args.max_process_share >= 1 else max(1, int(args.max_process_share * num_pages))
    if not 0 < args.max_process_share <= 1:
        raise ValueError(f"--max-process-share must be in (0, 1], got {args.max_process_share}")
    owner = vmm.PoolOwner(backend, num_pages, args.socket, announce,
                          frozenset({os.getuid(), *args.allow_uid}), cap)
    try:
        events = PoolEvents(owner, events_config) if announce else None  # the directory, for routers
    except BaseException:  # its ports taken, say: no pool (and no socket file) left behind
        owner.stop()
        raise
    signal.signal(signal.SIGTERM, lambda *_: owner.request_stop())
    print(f"vkv: pool of {owner.pool.num_pages} pages of {backend.page_size} bytes at {args.socket}", flush=True)
    try:
        owner.serve()
    except KeyboardInterrupt:
        pass
    finally:
        owner.stop()
        if events is not None:
            events.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vkv", description="LLM serving on GPU virtual memory")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for prompts")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="seed of the sampling")
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.add_argument("--lora", metavar="PATH", default=None,
                     help="generate with this LoRA adapter (a PEFT directory; with --enable-lora)")
    EngineConfig.add_cli_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with Prometheus metrics")
    ServerOptions.add_cli_args(srv)
    EngineConfig.add_cli_args(srv)
    srv.set_defaults(func=cmd_serve)

    worker = sub.add_parser("tp-worker", help="one tensor-parallel rank (1..N-1) for a driver started with "
                            "--tensor-parallel-workers external, on this host or another")
    worker.add_argument("--rank", type=int, required=True)
    EngineConfig.add_cli_args(worker)
    worker.set_defaults(func=cmd_tp_worker)

    owner = sub.add_parser("pool-owner", help="own a physical KV pool that several engine processes "
                           "(--kv-pool SOCKET) share: pages, reference counts and page names for all of them")
    owner.add_argument("--socket", required=True, help="Unix socket path (made readable by this user only)")
    owner.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes of KV pages")
    owner.add_argument("--page-size", type=int, default=None, help="bytes per physical page")
    owner.add_argument("--device", default="cpu", help="cpu (memfd pages) or cuda[:N] (the GPU's pages, exported "
                                                       "to each engine process; start those with --device cuda[:N])")
    owner.add_argument("--allow-uid", type=int, action="append", default=[], metavar="UID",
                       help="another user whose processes may attach (default: this user's only, and the socket "
                            "0600; with others it is 0666 and each connection's uid decides)")
    owner.add_argument("--max-process-share", type=float, default=1.0, metavar="FRACTION",
                       help="the most of the pool one process may hold at once (default 1: all); an alloc past it "
                            "is refused to that process as a full pool is")
    owner.add_argument("--kv-events-config", type=json.loads, default=None, metavar="JSON",
                       help="vLLM's KVEventsConfig: the pool's directory (what every process attached to it can "
                            "map) announced as vLLM's KV events, by this owner (the engine processes announce nothing)")
    owner.set_defaults(func=cmd_pool_owner)

    live = sub.add_parser("top", help="live view of a server's KV pool: pages per model, running and waiting")
    live.add_argument("--url", default="http://127.0.0.1:8000")
    live.add_argument("--api-key", default=None, help="the server's key, if /metrics is behind it")
    live.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    live.add_argument("--once", action="store_true", help="print one view and exit")
    live.set_defaults(func=cmd_top)

    prof = sub.add_parser("profile-mapping", help="page-mapping latency of a vmm backend over a sweep of page sizes")
    profile_mapping.add_cli_args(prof)
    prof.set_defaults(func=cmd_profile_mapping)

    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])[1:]  # what followed the command (replicas take it)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        parser.exit(2, f"vkv: error: {exc}\n")


if __name__ == "__main__":
    main()
