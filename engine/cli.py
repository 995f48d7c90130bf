"""`vkv`: generate, serve, profile-mapping."""
from __future__ import annotations

import argparse
import json
import sys


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint dir, .gguf file or random:<preset> "
                   "(default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
    p.add_argument("--kv-layout", default="interleaved", choices=["interleaved", "per_layer", "paged"])
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV pages")
    p.add_argument("--page-size", type=int, default=None, help="bytes per physical page")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--attention-backend", default=None, choices=["sdpa", "flash"])
    p.add_argument("--no-prefix-caching", action="store_true")


def engine_options(args: argparse.Namespace) -> dict:
    return dict(model=args.model, device=args.device, dtype=args.dtype, kv_layout=args.kv_layout,
                kv_cache_memory=args.kv_cache_memory, page_size=args.page_size,
                max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                attention_backend=args.attention_backend,
                enable_prefix_caching=not args.no_prefix_caching)


def cmd_generate(args: argparse.Namespace) -> None:
    from engine import LLM, SamplingParams

    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens)
    llm = LLM(**engine_options(args))
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=not args.json)
    else:
        outs = llm.generate(args.prompts, params, use_tqdm=not args.json)
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
        print(f"\n[vkv] {s['kv_layout']} KV, {s['attention_backend']} attention, peak {s['peak_pages_mapped']} "
              f"pages of {s['page_size'] >> 10} KiB mapped, {s['preemptions']} preemptions", file=sys.stderr)


def cmd_serve(args: argparse.Namespace) -> None:
    from engine.server import serve

    serve(args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vkv", description="LLM serving on GPU virtual memory")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for prompts")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_engine_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with Prometheus metrics")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted")
    srv.add_argument("--log-level", default="info")
    add_engine_arguments(srv)
    srv.set_defaults(func=cmd_serve)

    from vmm import profiler
    prof = sub.add_parser("profile-mapping", help="latency of page create/map/access/unmap/release")
    profiler.add_arguments(prof)
    prof.set_defaults(func=profiler.run)

    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        parser.exit(2, f"vkv: error: {exc}\n")


if __name__ == "__main__":
    main()
