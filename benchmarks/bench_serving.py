"""Online serving: `vkv serve` under Poisson arrivals of ShareGPT requests, at several rates.

The server runs as its own process, as a user would start it, started afresh for each rate
(so no rate finds the prompts of another in its prefix cache) and warmed with one request
before the clock starts. The client streams each request
over HTTP (`/v1/completions`, token-id prompt, `max_tokens` = the ShareGPT reply length,
`ignore_eos`) and times every server-sent event. As in vLLM's benchmark_serving:
  TTFT  time to first token: request sent -> first text chunk
  TPOT  time per output token after the first: (latency - TTFT) / (output tokens - 1)
  ITL   inter-token latency: gaps between successive text chunks
  E2E   request sent -> last chunk
reported as mean, median and p99, with request throughput and output tokens/s per rate, and
the server's own counters from /metrics. After each rate the server gets SIGTERM; its
shutdown time and exit are recorded.

    python benchmarks/bench_serving.py --rates 0.25,0.5,1,inf --num-requests 32 \
        --json benchmarks/results/cpu/serving.json --plot benchmarks/results/cpu/serving.png
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, save  # noqa: E402
from sharegpt import BenchRequest, sample_requests  # noqa: E402



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    """`vkv serve` on port, healthy and past its first (warm-up) request."""
    command = [sys.executable, "-m", "engine.cli", "serve", "--port", str(port), "--log-level", "warning", *extra]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"the server exited with {server.returncode}:\n{server.stdout.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                           json={"prompt": "Warm up", "max_tokens": 4, "temperature": 0}).raise_for_status()
                return server
        except httpx.TransportError:
            time.sleep(0.5)
    server.kill()
    sys.exit("the server did not come up within 300 s")


def stop_server(server: subprocess.Popen) -> dict:
    start = time.monotonic()
    server.send_signal(signal.SIGTERM)
    output, _ = server.communicate(timeout=60)
    return {"signal": "SIGTERM", "shutdown_s": time.monotonic() - start, "returncode": server.returncode,
            "clean": "KV memory released" in output}


async def one_request(client: httpx.AsyncClient, url: str, req: BenchRequest) -> dict:
    body = {"prompt": req.prompt_ids, "max_tokens": req.output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start, chunks, tokens = time.perf_counter(), [], None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            return {"ok": False, "error": (await response.aread()).decode()[:200]}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event["choices"] and event["choices"][0]["text"]:
                chunks.append(time.perf_counter())
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    ttft, latency = chunks[0] - start, chunks[-1] - start
    return {"ok": True, "output_tokens": tokens, "ttft": ttft, "latency": latency,
            "tpot": (latency - ttft) / (tokens - 1) if tokens > 1 else None, "itl": np.diff(chunks).tolist()}


async def run_rate(url: str, requests: list[BenchRequest], rate: float, seed: int) -> dict:
    gaps = np.random.default_rng(seed).exponential(1 / rate, len(requests)) if rate != float("inf") \
        else np.zeros(len(requests))
    bar = tqdm(total=len(requests), desc=f"rate {rate} req/s", unit="req", leave=False)

    async def send(client, delay, req):
        await asyncio.sleep(delay)
        result = await one_request(client, url, req)
        bar.update(1)
        return result

    limits = httpx.Limits(max_connections=len(requests))
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(send(client, d, r) for d, r in zip(np.cumsum(gaps), requests)))
        duration = time.perf_counter() - start
    bar.close()
    return summarize(rate, results, duration)


def stats(values: list[float]) -> dict:
    ms = np.array(values, dtype=float) * 1e3
    if not len(ms):
        return {"mean_ms": None, "median_ms": None, "p99_ms": None}
    return {"mean_ms": float(ms.mean()), "median_ms": float(np.median(ms)), "p99_ms": float(np.percentile(ms, 99))}


def summarize(rate: float, results: list[dict], duration: float) -> dict:
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["output_tokens"] for r in ok)
    return {"rate": rate if rate != float("inf") else "inf", "completed": len(ok), "failed": len(results) - len(ok),
            "errors": [r["error"] for r in results if not r["ok"]][:3], "duration_s": duration,
            "request_throughput": len(ok) / duration, "output_throughput": tokens / duration,
            "total_output_tokens": tokens,
            "ttft": stats([r["ttft"] for r in ok]), "tpot": stats([r["tpot"] for r in ok if r["tpot"] is not None]),
            "itl": stats([gap for r in ok for gap in r["itl"]]), "e2e": stats([r["latency"] for r in ok])}


COUNTERS = ("vkv:num_preemptions_total", "vkv:prefix_cache_hits_total", "vkv:prefix_cache_queries_total",
            "vkv:generation_tokens_total", "vkv:peak_pages_mapped", "vkv:pages_total")


def scrape(url: str) -> dict:
    found = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in COUNTERS:
            found[name] = float(value)
    return found


def measure_rate(server_args: list[str], requests: list[BenchRequest], rate: float, seed: int) -> dict:
    port = free_port()
    server = start_server(port, server_args)
    try:
        result = asyncio.run(run_rate(f"http://127.0.0.1:{port}/v1/completions", requests, rate, seed))
        result["server_counters"] = scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        shutdown = stop_server(server)
    return {**result, "shutdown": shutdown}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    labels = [str(r["rate"]) for r in runs]
    x = np.arange(len(runs))
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    axes[0].bar(x, [r["output_throughput"] for r in runs], color="tab:green")
    axes[0].set_title("output tokens/s", fontsize=10)
    for r, xi in zip(runs, x):
        axes[0].annotate(f"{r['request_throughput']:.2f} req/s", (xi, r["output_throughput"]), ha="center",
                         va="bottom", fontsize=8)
    for ax, key in zip(axes[1:], ("ttft", "tpot", "itl")):
        for offset, stat in ((-0.27, "mean_ms"), (0, "median_ms"), (0.27, "p99_ms")):
            ax.bar(x + offset, [r[key][stat] or 0 for r in runs], 0.27, label=stat.replace("_ms", ""))
        ax.set_title(f"{key.upper()}, ms", fontsize=10)
        ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(x, labels)
        ax.set_xlabel("Poisson arrival rate, req/s")
    fig.suptitle(f"vkv serve, {result['num_requests']} ShareGPT requests per rate, {result['server_args']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="0.25,0.5,1,inf", help="requests per second; inf: all at once")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-output", type=int, default=128, help="cap on a request's output tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default="--kv-layout interleaved --max-num-seqs 32",
                        help="options for `vkv serve`")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    args = parser.parse_args()

    from engine.models import load_tokenizer
    requests = sample_requests(load_tokenizer(None), args.num_requests, args.seed, max_output=args.max_output)
    runs = [measure_rate(args.server_args.split(), requests, float(rate), args.seed)
            for rate in tqdm(args.rates.split(","), desc="rates")]
    result = {"benchmark": "serving", "command": " ".join(["python"] + sys.argv), "server_args": args.server_args,
              "model": "SmolLM2-135M-Instruct (bundled: Q4_1 GGUF dequantized to fp32)", "num_requests": len(requests),
              "mean_prompt_len": float(np.mean([len(r.prompt_ids) for r in requests])),
              "mean_output_len": float(np.mean([r.output_len for r in requests])),
              "machine": machine_info(), "runs": runs}
    print(f"\n{'rate':>6}{'req/s':>8}{'tok/s':>8}{'TTFT med':>10}{'TTFT p99':>10}{'TPOT med':>10}"
          f"{'ITL med':>9}{'ITL p99':>9}{'failed':>8}")
    for r in runs:
        print(f"{r['rate']:>6}{r['request_throughput']:>8.2f}{r['output_throughput']:>8.1f}"
              f"{r['ttft']['median_ms']:>8.0f}ms{r['ttft']['p99_ms']:>8.0f}ms{r['tpot']['median_ms']:>8.0f}ms"
              f"{r['itl']['median_ms']:>7.0f}ms{r['itl']['p99_ms']:>7.0f}ms{r['failed']:>8}")
    print("server shutdowns on SIGTERM:", [(round(r["shutdown"]["shutdown_s"], 2), r["shutdown"]["clean"])
                                           for r in runs])
    save(result, args.json_path, args.plot_path, plot)


if __name__ == "__main__":
    main()
