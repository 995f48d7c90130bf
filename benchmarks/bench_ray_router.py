"""Two vkv replicas on a local Ray cluster of two nodes behind Ray Serve: vkv's prefix router
against Ray's power of two choices (and Ray's PrefixCacheAffinityRouter where it imports),
on multi-tenant traffic.

Workload (bench_replicas.py's): --requests ShareGPT questions (vLLM's sampling), each behind one
of 8 long system prompts (ShareGPT texts cut to --system-tokens), Poisson arrivals at --rate,
greedy, output lengths capped at --max-output, streamed. The cluster: a head and a second node
(`ray start --address`) on this machine, one CPU each, one replica on each (one thread each),
--kv-cache-memory of KV each; the Serve application is deployed afresh (cold caches) for each
router. Reported per router: prefix-cache hit rate (cached prompt tokens / prompt tokens, from
each answer's usage.prompt_tokens_details), prompt tokens computed, TTFT p50/p99, output
throughput.

    python benchmarks/bench_ray_router.py --json benchmarks/results/cpu/ray_router.json --plot benchmarks/results/cpu/ray_router.png

Several --kv-cache-memory sizes make a sweep (one cluster, each router deployed afresh at each
size): where each router's hit rate falls as the replicas' KV shrinks below what the system
prompts need, and the ratio between them. With two replicas and prompts of equal popularity the
steady-state ratio is about 2x at most (a replica that serves half the prompts holds twice the
share of them that one serving all of them holds); a run can land a little above it, when power
of two's replicas thrash harder than that share (cold misses, running sequences crowding out
cached pages).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from bench_replicas import run, workload  # noqa: E402
from bench_serving import free_port  # noqa: E402
from common import machine_info, save  # noqa: E402
from ray_cluster import LocalRayCluster  # noqa: E402

from engine.models import load_tokenizer  # noqa: E402

ROUTERS = ("prefix", "pow2", "ray-prefix")


def deploy(cluster: LocalRayCluster, router: str, port: int, kv_bytes: int) -> subprocess.Popen | str:
    """`vkv serve -dp 2 --data-parallel-backend ray` with this router, warmed up; or why it did not start."""
    server = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--port", str(port), "-dp", "2",
                               "--data-parallel-backend", "ray", "--ray-address", cluster.address, "--ray-router", router,
                               "--kv-cache-memory", str(kv_bytes), "--log-level", "warning"],
                              env={**cluster.env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in server.stdout:
        lines.append(line)
        if "vkv: serving" in line:
            break
    else:
        server.wait()
        return "".join(lines[-3:]).strip()
    for _ in range(2):  # each replica past its first request
        httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300,
                   json={"prompt": "Warm up", "max_tokens": 2, "temperature": 0}).raise_for_status()
    return server


def measure(cluster, router: str, requests, args, port: int, kv_bytes: int) -> dict:
    server = deploy(cluster, router, port, kv_bytes)
    if isinstance(server, str):
        print(f"{router:10} did not start: {server}", flush=True)
        return {"router": router, "unavailable": server}
    try:
        result = asyncio.run(run([f"http://127.0.0.1:{port}"], requests, args.rate, args.seed))
    finally:
        server.send_signal(2)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
        time.sleep(2)
    result["hit_rate"] = result["cached_tokens"] / max(1, result["prompt_tokens"])
    result["tokens_computed"] = result["prompt_tokens"] - result["cached_tokens"]
    print(f"{router:10} hit rate {result['hit_rate']:.1%}, computed {result['tokens_computed']} of "
          f"{result['prompt_tokens']} prompt tokens, TTFT p50 {result['ttft']['median_ms']:.0f} ms "
          f"p99 {result['ttft']['p99_ms']:.0f} ms, {result['output_throughput']:.1f} tok/s, "
          f"{result['failed']} failed", flush=True)
    return {"router": router, **result}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=0.5)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--max-output", type=int, default=32)
    parser.add_argument("--kv-cache-memory", type=int, nargs="+", default=[160 << 20],
                        help="bytes of KV per replica; several: a sweep")
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    args = parser.parse_args(argv)
    requests = workload(load_tokenizer(None), args.requests, args.system_tokens, args.max_output, args.seed)
    import ray
    # a SIGTERM (a stopped job, `kill`) ends the run through `finally` too, so the cluster goes with it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    cluster = LocalRayCluster(nodes=2, cpus_per_node=1)
    try:
        port = free_port()  # one for all: a cluster's Serve keeps the HTTP address it started with
        sweep = []
        for kv_bytes in args.kv_cache_memory:
            print(f"-- {kv_bytes / 2 ** 20:.0f} MiB of KV a replica", flush=True)
            results = [measure(cluster, router, requests, args, port, kv_bytes) for router in args.routers]
            sweep.append({"kv_cache_memory_per_replica": kv_bytes, "routers": results, "prefix_vs_pow2": versus(results)})
    finally:
        cluster.stop()
    result = {"benchmark": "ray_router", "command": "python benchmarks/bench_ray_router.py " + " ".join(argv or sys.argv[1:]),
              "machine": machine_info(), "threads_total": 2, "ray": ray.__version__,
              "cluster": "2 Ray nodes on this machine (head + ray start --address), 1 CPU each, one replica each "
                         "(1 thread)",
              "model": "bundled SmolLM2-135M-Instruct (Q4_1 weights dequantized to fp32), per_layer KV",
              "workload": {"requests": args.requests, "rate": args.rate, "system_prompts": 8,
                           "system_tokens": args.system_tokens, "max_output": args.max_output}}
    if len(sweep) == 1:  # one size: the routers side by side
        result["workload"]["kv_cache_memory_per_replica"] = sweep[0]["kv_cache_memory_per_replica"]
        result.update(routers=sweep[0]["routers"], prefix_vs_pow2=sweep[0]["prefix_vs_pow2"])
        save(result, args.json_path, args.plot_path, plot)
    else:
        result["sweep"] = sweep
        save(result, args.json_path, args.plot_path, plot_sweep)
    return result


def versus(results: list[dict]) -> dict:
    """The prefix router's hit rate, p50 TTFT and throughput over power of two's (if both ran)."""
    done = {r["router"]: r for r in results if "unavailable" not in r}
    if "prefix" not in done or "pow2" not in done:
        return {}
    p, q = done["prefix"], done["pow2"]
    ratios = {"hit_rate_ratio": p["hit_rate"] / max(q["hit_rate"], 1e-9),
              "ttft_p50_ratio": p["ttft"]["median_ms"] / q["ttft"]["median_ms"],
              "throughput_ratio": p["output_throughput"] / q["output_throughput"]}
    print(f"prefix / pow2: hit rate {ratios['hit_rate_ratio']:.2f}x, TTFT p50 {ratios['ttft_p50_ratio']:.2f}x, "
          f"throughput {ratios['throughput_ratio']:.2f}x", flush=True)
    return ratios


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in result["routers"] if "unavailable" not in r]
    names = [r["router"] for r in done]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    axes[0].bar(names, [100 * r["hit_rate"] for r in done], color="C0")
    axes[0].set_ylabel("prefix-cache hit rate (%)")
    axes[1].bar(names, [r["ttft"]["median_ms"] for r in done], color="C1", label="p50")
    axes[1].bar(names, [r["ttft"]["p99_ms"] - r["ttft"]["median_ms"] for r in done],
                bottom=[r["ttft"]["median_ms"] for r in done], color="C1", alpha=0.4, label="to p99")
    axes[1].set_ylabel("TTFT (ms)")
    axes[1].legend(fontsize=8)
    axes[2].bar(names, [r["output_throughput"] for r in done], color="C2")
    axes[2].set_ylabel("output tokens/s")
    m = result["machine"]
    fig.suptitle(f"Two vkv replicas on Ray Serve, by router ({m.get('cpu_model', '')}, {result['threads_total']} threads)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)



def plot_sweep(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [s["kv_cache_memory_per_replica"] / 2 ** 20 for s in result["sweep"]]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for i, router in enumerate(result["sweep"][0]["routers"]):
        name = router["router"]
        rows = [next(r for r in s["routers"] if r["router"] == name) for s in result["sweep"]]
        if any("unavailable" in r for r in rows):
            continue
        axes[0].plot(sizes, [100 * r["hit_rate"] for r in rows], "o-", color=f"C{i}", label=name)
        axes[1].plot(sizes, [r["ttft"]["median_ms"] for r in rows], "o-", color=f"C{i}", label=name)
    axes[0].set_ylabel("prefix-cache hit rate (%)")
    axes[1].set_ylabel("TTFT p50 (ms)")
    ratios = [s["prefix_vs_pow2"].get("hit_rate_ratio") for s in result["sweep"]]
    axes[2].plot(sizes, ratios, "o-", color="C3", label="hit rate, prefix / pow2")
    axes[2].axhline(2.0, color="gray", ls="--", lw=1, label="2x (the goal; about the steady-state most with 2 replicas)")
    axes[2].set_ylabel("ratio")
    for ax in axes:
        ax.set_xlabel("KV per replica (MiB)")
        ax.legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(f"Two vkv replicas on Ray Serve, by router and KV size ({m.get('cpu_model', '')}, "
                 f"{result['threads_total']} threads)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
