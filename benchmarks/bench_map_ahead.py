"""Mapping ahead on a worker thread: how much page-mapping time stays on the critical path,
with and without it, across page sizes (host backend).

Each configuration serves the same ShareGPT requests (EOS ignored, output capped at
--max-tokens) all at once; it reports per step the mapping time exposed on the critical path
(the scheduler's mapping plus any wait for the worker) and the time the worker hid behind
forward passes, and the throughput. Greedy tokens are checked identical across
configurations. Repeats alternate; medians count.

    python benchmarks/bench_map_ahead.py --json benchmarks/results/cpu/map_ahead.json \
        --plot benchmarks/results/cpu/map_ahead.png
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, save  # noqa: E402
from sharegpt import sample_requests  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402


def run_once(config: EngineConfig, loaded, prompts, params) -> dict:
    llm = LLM.from_config(config, loaded)
    engine, steps = llm.engine, 0
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    done, start = {}, time.perf_counter()
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step() if o.finished}
        steps += 1
    elapsed = time.perf_counter() - start
    stats = llm.stats()
    engine.close()
    return {"elapsed_s": elapsed, "steps": steps, "exposed_ms_per_step": stats.map_exposed_seconds / steps * 1e3,
            "hidden_ms_per_step": stats.map_hidden_seconds / steps * 1e3,
            "tokens": [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--page-sizes", default="32768,65536,262144,2097152")
    parser.add_argument("--kv-cache-memory", type=int, default=512 << 20,
                        help="bytes of KV pages (the host maps at most ~32k pages at once)")
    parser.add_argument("--ahead", type=int, default=16, help="map_ahead_tokens when on")
    parser.add_argument("--num", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    args = parser.parse_args(argv)
    first = LLM(model=args.model, device=args.device, dtype=args.dtype)
    loaded = (first.engine.model, first.engine.tokenizer)
    first.engine.close()
    requests = sample_requests(loaded[1], args.num, 0, max_output=args.max_tokens)
    prompts = [r.prompt_ids for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    rows, reference = [], None
    for page_size in map(int, args.page_sizes.split(",")):
        runs = {0: [], args.ahead: []}
        for repeat in range(args.repeats):
            for ahead in (list(runs) if repeat % 2 == 0 else list(runs)[::-1]):
                config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, page_size=page_size,
                                      kv_cache_memory=args.kv_cache_memory, map_ahead_tokens=ahead)
                run = run_once(config, loaded, prompts, params)
                reference = reference or run["tokens"]
                assert run["tokens"] == reference, (page_size, ahead)
                runs[ahead].append(run)
        for ahead, mine in runs.items():
            med = lambda key: statistics.median(r[key] for r in mine)
            row = {"page_size": page_size, "map_ahead_tokens": ahead, "exposed_ms_per_step": med("exposed_ms_per_step"),
                   "hidden_ms_per_step": med("hidden_ms_per_step"), "elapsed_s": med("elapsed_s"),
                   "steps": mine[0]["steps"], "output_tokens_per_s": sum(len(t) for t in reference) / med("elapsed_s")}
            rows.append(row)
            print(f"page {page_size >> 10:>5} KiB ahead {ahead:>3}: exposed {row['exposed_ms_per_step']:.3f} ms/step, "
                  f"hidden {row['hidden_ms_per_step']:.3f} ms/step, {row['output_tokens_per_s']:.1f} tok/s", flush=True)
    result = {"benchmark": "map_ahead", "model": args.model or "SmolLM2-135M-Instruct (bundled)", "dtype": args.dtype,
              "requests": args.num, "kv_cache_memory": args.kv_cache_memory, "max_tokens": args.max_tokens, "repeats": args.repeats, "tokens_identical": True,
              "command": "python benchmarks/bench_map_ahead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine_info(), "rows": rows}
    save(result, args.json_path, args.plot_path, plot)
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    sizes = list(dict.fromkeys(r["page_size"] for r in rows))
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.38
    for i, on in enumerate((False, True)):
        mine = [next(r for r in rows if r["page_size"] == s and bool(r["map_ahead_tokens"]) == on) for s in sizes]
        xs = [j + (i - 0.5) * width for j in range(len(sizes))]
        ax.bar(xs, [r["exposed_ms_per_step"] for r in mine], width, label=f"exposed, map-ahead {'on' if on else 'off'}")
        if on:
            ax.bar(xs, [r["hidden_ms_per_step"] for r in mine], width, bottom=[r["exposed_ms_per_step"] for r in mine],
                   alpha=0.4, label="hidden by the worker")
    ax.set_xticks(range(len(sizes)), [f"{s >> 10} KiB" for s in sizes])
    ax.set_xlabel("page size")
    ax.set_ylabel("page-mapping ms per step")
    ax.legend(fontsize=8)
    m = result["machine"]
    ax.set_title(f"Mapping ahead, {result['requests']} ShareGPT requests, {result['dtype']}, "
                 f"{m['processor']} ({m['cpu_count']} CPUs)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
