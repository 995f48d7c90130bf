"""Two replicas over one KV pool (`vkv serve --data-parallel-size 2`) against one process, and
against two processes with pools of their own, on a shared-system-prompt workload; then a
prefix computed on the other replica against a hit in the same process; then one replica
killed under load.

Workload: --requests ShareGPT questions (vLLM's sampling), each behind one of 8 long system
prompts (ShareGPT texts cut to --system-tokens), Poisson arrivals at --rate, greedy, output
lengths capped at --max-output. Every setup gets the same KV bytes in all (--kv-cache-memory)
and the same 2 cores: one process with 2 threads, or two with 1 thread each. Reported: tokens
computed (prompt tokens less prefix-cache hits, from /metrics), TTFT p50/p99, throughput.
Cross-replica: a --system-tokens prompt computed on rank 0 (pinned), then the same prompt plus a
question sent to rank 1 (mapped from rank 0's pages) and, with another question, to rank 0 (a hit
in its own process); TTFT medians over --probes. Kill: rank 1 SIGKILLed halfway through the
workload; requests failed (streamed or not yet), seconds until the pool counts its pages back.

    python benchmarks/bench_replicas.py --json benchmarks/results/cpu/replicas.json --plot benchmarks/results/cpu/replicas.png
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import sys
import threading
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_serving import free_port, start_server, stats, stop_server  # noqa: E402
from common import machine_info, save  # noqa: E402
from sharegpt import BenchRequest, sample_requests  # noqa: E402

from engine.models import load_tokenizer  # noqa: E402


def workload(tokenizer, n: int, system_tokens: int, max_output: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    texts = sample_requests(tokenizer, 8 + n, seed=seed, max_prompt=1024, max_total=2048)
    systems = [(t.prompt_ids * (1 + system_tokens // max(1, len(t.prompt_ids))))[:system_tokens] for t in texts[:8]]
    out = []
    for q in texts[8:]:
        ids = rng.choice(systems) + q.prompt_ids[:128]
        out.append(BenchRequest("", ids, max(1, min(q.output_len, max_output))))
    return out


async def one_request(client: httpx.AsyncClient, url: str, req: BenchRequest) -> dict:
    """One streamed request: its TTFT and tokens, or its error and whether any token had come."""
    body = {"prompt": req.prompt_ids, "max_tokens": req.output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start, first, tokens, cached = time.perf_counter(), None, 0, 0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            return {"ok": False, "streamed": False, "error": (await response.aread()).decode()[:200]}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"ok": False, "streamed": first is not None, "error": event["error"]["message"]}
            if event["choices"] and event["choices"][0]["text"]:
                first = first or time.perf_counter()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
                cached = event["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"ok": True, "output_tokens": tokens, "ttft": (first or time.perf_counter()) - start,
            "prompt_tokens": len(req.prompt_ids), "cached_tokens": cached}


def counters(url: str) -> dict[str, float]:
    """The vkv: counters summed over replicas (a front door labels them rank="R")."""
    found: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r'^(vkv:[a-z_:]+)(\{rank="\d+"\})? (\S+)$', line)
        if m:
            found[m.group(1)] = found.get(m.group(1), 0.0) + float(m.group(3))
    return found


async def run(urls: list[str], requests: list[BenchRequest], rate: float, seed: int, on_half=None) -> dict:
    gaps = np.random.default_rng(seed).exponential(1 / rate, len(requests))
    half = asyncio.Event()

    async def send(client, i, delay, req):
        await asyncio.sleep(delay)
        if i == len(requests) // 2 and on_half:
            on_half()
        try:
            return await one_request(client, urls[i % len(urls)] + "/v1/completions", req)
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            return {"ok": False, "streamed": False, "error": f"{type(exc).__name__}: {exc}"[:200]}

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=256)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(send(client, i, d, r) for i, (d, r) in
                                         enumerate(zip(np.cumsum(gaps), requests))))
        duration = time.perf_counter() - start
    del half
    ok = [r for r in results if r["ok"]]
    return {"completed": len(ok), "failed": len(results) - len(ok),
            "failed_before_streaming": sum(1 for r in results if not r["ok"] and not r.get("streamed")),
            "errors": [r["error"] for r in results if not r["ok"]][:3],
            "duration_s": duration, "output_throughput": sum(r["output_tokens"] for r in ok) / duration,
            "prompt_tokens": sum(r["prompt_tokens"] for r in ok), "cached_tokens": sum(r["cached_tokens"] for r in ok),
            "ttft": stats([r["ttft"] for r in ok])}


def computed(before: dict, after: dict) -> dict:
    queries = after.get("vkv:prefix_cache_queries_total", 0) - before.get("vkv:prefix_cache_queries_total", 0)
    hits = after.get("vkv:prefix_cache_hits_total", 0) - before.get("vkv:prefix_cache_hits_total", 0)
    return {"prompt_tokens": queries, "prefix_hits": hits, "tokens_computed": queries - hits}


def setup(name: str, servers: list[tuple[list[str], dict]], requests, rate, seed) -> dict:
    ports = [free_port() for _ in servers]
    procs = []
    for port, (extra, env) in zip(ports, servers):
        os.environ.update(env)
        procs.append(start_server(port, extra))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        before = [counters(u) for u in urls]
        result = asyncio.run(run(urls, requests, rate, seed))
        after = [counters(u) for u in urls]
        tokens = [computed(b, a) for b, a in zip(before, after)]
        result["tokens"] = {k: sum(t[k] for t in tokens) for k in tokens[0]}
    finally:
        for proc in procs:
            stop_server(proc)
    print(f"{name:32} computed {result['tokens']['tokens_computed']:8.0f} of {result['tokens']['prompt_tokens']:8.0f} "
          f"prompt tokens, TTFT p50 {result['ttft']['median_ms']:.0f} ms p99 {result['ttft']['p99_ms']:.0f} ms, "
          f"{result['output_throughput']:.1f} tok/s, {result['failed']} failed", flush=True)
    return {"setup": name, **result}


def ttft(url: str, ids: list[int], rank: int) -> float:
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600,
                      headers={"x-data-parallel-rank": str(rank)}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError("no token")


def cross_replica(url: str, requests: list[BenchRequest], probes: int, system_tokens: int) -> dict:
    rng = random.Random(1)
    other, same = [], []
    for i in range(probes):
        prefix = [rng.randrange(100, 40000) for _ in range(system_tokens)]
        ttft(url, prefix, 0)  # computed on rank 0, its pages published
        q1, q2 = requests[2 * i].prompt_ids[-32:], requests[2 * i + 1].prompt_ids[-32:]
        other.append(ttft(url, prefix + q1, 1))  # rank 1 maps rank 0's pages
        same.append(ttft(url, prefix + q2, 0))  # rank 0 hits its own
    result = {"other_replica_ttft_ms": statistics.median(other) * 1e3, "same_process_ttft_ms": statistics.median(same) * 1e3}
    result["ratio"] = result["other_replica_ttft_ms"] / result["same_process_ttft_ms"]
    print(f"prefix from the other replica: TTFT {result['other_replica_ttft_ms']:.1f} ms against "
          f"{result['same_process_ttft_ms']:.1f} ms for a hit in the same process ({result['ratio']:.2f}x)", flush=True)
    return result


def _running(url: str, rank: int) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.search(rf'^vkv:num_requests_running{{rank="{rank}"}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def replica_pid(front: int, rank: int) -> int:
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and open(f"/proc/{pid}/stat").read().split(")")[1].split()[1] == str(front):
                if f"vkv: rank {rank}" in open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"):
                    return int(pid)
        except OSError:
            continue
    raise LookupError(f"no replica {rank}")


def kill_under_load(args, requests) -> dict:
    port = free_port()
    proc = start_server(port, ["--data-parallel-size", "2", *args])
    url = f"http://127.0.0.1:{port}"
    killed = {}

    def kill():  # from a thread: once rank 1 is running requests, SIGKILL it and time its pages' return
        def run_kill():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not _running(url, 1):
                time.sleep(0.02)
            recovered = counters(url).get("vkv:pool_pages_recovered_total", 0)
            killed["running"] = _running(url, 1)
            killed["at"] = time.monotonic()
            os.kill(replica_pid(proc.pid, 1), signal.SIGKILL)
            while time.monotonic() - killed["at"] < 10:
                if counters(url).get("vkv:pool_pages_recovered_total", 0) > recovered:
                    killed["pages_back_s"] = time.monotonic() - killed["at"]
                    killed["pages_recovered"] = counters(url)["vkv:pool_pages_recovered_total"] - recovered
                    return
                time.sleep(0.01)
        threading.Thread(target=run_kill, daemon=True).start()

    try:
        result = asyncio.run(run([url], requests, args_rate, 0, on_half=kill))
        time.sleep(1)
    finally:
        stop_server(proc)
    result.update(pages_back_s=killed.get("pages_back_s"), pages_recovered=killed.get("pages_recovered"),
                  sequences_running_at_kill=killed.get("running"))
    print(f"rank 1 killed under load ({result['sequences_running_at_kill']} sequences running there): "
          f"{result['failed']} of {len(requests)} requests failed, "
          f"{result['failed_before_streaming']} of them before their first token ({result['errors'][:1]}); "
          f"its pages back in {result['pages_back_s']} s", flush=True)
    return result


args_rate = 1.0


def main(argv: list[str] | None = None) -> dict:
    global args_rate
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--max-output", type=int, default=32)
    parser.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    parser.add_argument("--probes", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    args = parser.parse_args(argv)
    args_rate = args.rate
    tokenizer = load_tokenizer(None)
    requests = workload(tokenizer, args.requests, args.system_tokens, args.max_output, args.seed)
    memory = ["--kv-cache-memory", str(args.kv_cache_memory)]
    half = ["--kv-cache-memory", str(args.kv_cache_memory // 2)]
    two, one = {"OMP_NUM_THREADS": "2"}, {"OMP_NUM_THREADS": "1"}
    setups = [setup("one process (2 threads)", [(memory, two)], requests, args.rate, args.seed),
              setup("two replicas, one pool", [(["--data-parallel-size", "2", *memory], two)], requests, args.rate,
                    args.seed),
              setup("two processes, two pools", [(half, one), (half, one)], requests, args.rate, args.seed)]
    port = free_port()
    os.environ.update(two)
    front = start_server(port, ["--data-parallel-size", "2", *memory])
    try:
        cross = cross_replica(f"http://127.0.0.1:{port}", requests, args.probes, args.system_tokens)
    finally:
        stop_server(front)
    kill = kill_under_load(memory, requests)
    result = {"benchmark": "replicas", "command": "python benchmarks/bench_replicas.py " + " ".join(argv or sys.argv[1:]),
              "machine": machine_info(), "threads_total": 2, "model": "bundled SmolLM2-135M-Instruct (Q4_1 weights "
              "dequantized to fp32), per_layer KV", "workload": {"requests": args.requests, "rate": args.rate,
                                                                 "system_prompts": 8,
                                                                 "system_tokens": args.system_tokens,
                                                                 "max_output": args.max_output},
              "setups": setups, "cross_replica": cross, "kill": kill}
    save(result, args.json_path, args.plot_path, plot)
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = [s["setup"] for s in result["setups"]]
    axes[0].bar(names, [s["tokens"]["tokens_computed"] for s in result["setups"]], color=["C0", "C1", "C2"])
    axes[0].set_ylabel("prompt tokens computed")
    axes[1].bar(names, [s["ttft"]["median_ms"] for s in result["setups"]], color=["C0", "C1", "C2"], label="p50")
    axes[1].set_ylabel("TTFT p50 (ms)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("Shared-system-prompt workload: one process, two replicas over one pool, two separate pools")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
