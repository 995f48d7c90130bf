"""Fairness between clients over HTTP: client A sends one request of 64 prompts x 64 tokens
(more sequences than the 32 seats); one second later client B streams one short request. B's
time to first token, against B alone, with seats shared between clients (a client with nothing
running takes a seat from the one holding them all) and with that rule turned off (B waits for
a seat to free). Clients are told apart by OpenAI's `user` field (same address, no API key).

    python benchmarks/bench_fairness.py --json benchmarks/results/cpu/fairness.json --plot benchmarks/results/cpu/fairness.png
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time

import httpx
import uvicorn

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, save  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.worker.parallel import free_port  # noqa: E402
from engine.sched.scheduler import Scheduler  # noqa: E402
from engine.serving.loop.async_engine import AsyncEngine  # noqa: E402
from engine.serving.options import ServerOptions  # noqa: E402
from engine.serving.api.server import build_app  # noqa: E402

BURST = {"prompt": [f"Story {i}: once upon a time" for i in range(64)], "max_tokens": 64, "ignore_eos": True,
         "temperature": 0, "user": "a"}
SMALL = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stream": True, "user": "b"}


async def ttft(c: httpx.AsyncClient) -> float:
    start, first = time.perf_counter(), None
    async with c.stream("POST", "/v1/completions", json=SMALL) as r:
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and '"text": ""' not in line:
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("no token came")
    return first


async def under_burst(base: str) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=600) as c:
        start = time.perf_counter()
        burst = asyncio.ensure_future(c.post("/v1/completions", json=BURST))
        await asyncio.sleep(1.0)
        first = await ttft(c)
        r = await burst
        assert r.status_code == 200, r.text
        return {"b_ttft_s": first, "a_done_s": time.perf_counter() - start}


async def alone(base: str, repeats: int) -> float:
    async with httpx.AsyncClient(base_url=base, timeout=600) as c:
        return statistics.median([await ttft(c) for _ in range(repeats)])


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["B alone", "B during A's burst,\nseats shared", "B during A's burst,\nno seat sharing"]
    values = [result["b_alone_ttft_s"], result["shared"]["b_ttft_s"], result["unshared"]["b_ttft_s"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(names, values, color=["#888", "#2a7", "#c44"])
    ax.bar_label(bars, fmt="%.2f s")
    ax.set_ylabel("client B: time to first token (s)")
    machine = result["machine"]
    ax.set_title(f"One client's 64 x 64-token request against another's stream ({machine['cpu_model']}, "
                 f"{'+'.join(machine['isa'])})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    engine = AsyncEngine(LLMEngine(EngineConfig(max_num_seqs=32, kv_cache_memory=512 << 20)))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "smol", ServerOptions()), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"
    try:
        result = {"command": "python benchmarks/bench_fairness.py " + " ".join(sys.argv[1:]), "machine": machine_info(),
                  "max_num_seqs": 32, "burst": {k: v for k, v in BURST.items() if k != "prompt"} | {"prompts": 64},
                  "b_alone_ttft_s": asyncio.run(alone(base, args.repeats))}
        result["shared"] = asyncio.run(under_burst(base))
        share, Scheduler._share_seats = Scheduler._share_seats, lambda self, budget: None
        try:
            result["unshared"] = asyncio.run(under_burst(base))
        finally:
            Scheduler._share_seats = share
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()
    print({k: v for k, v in result.items() if k != "machine"})
    save(result, args.json, args.plot, plot)


if __name__ == "__main__":
    main()
