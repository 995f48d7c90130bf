"""KV memory efficiency on a ShareGPT arrival trace, through vkv's real allocators.

The same scheduler, sequences and KV caches the engine runs are driven without a model: each
step, every scheduled sequence has its tokens "computed" and, at the end of what it knows,
gains one token, until it reaches its ShareGPT reply length. Requests arrive as a Poisson
process (in engine steps). With one fixed KV budget, each allocator reports:
  KV utilization  bytes of tokens held ÷ bytes allocated or mapped (time average, and at the
                  peak of allocated memory); "active" leaves out the pages that finished
                  sequences keep mapped for the next one (deferred reclamation), which are
                  reclaimed the moment memory is short
  concurrency     the most sequences running at once
  finished        requests done within the step horizon
Allocators: naive (contiguous max-length preallocation = one block of max_model_len tokens),
paged blocks of 16 and 256 tokens, per_layer and interleaved with 2 MiB pages (vAttention
without and with one page for all layers), and both with the host backend's small pages (the
smallest that keep the pool within Linux's limit on mapped areas: 64 KiB at 256 MiB).

    python benchmarks/bench_memory.py --json benchmarks/results/cpu/memory.json \
        --plot benchmarks/results/cpu/memory.png
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, save  # noqa: E402
from sharegpt import sample_requests  # noqa: E402

import vmm  # noqa: E402
from engine.kv.manager import KVManager  # noqa: E402
from engine.kv.paged import PagedLayout  # noqa: E402
from engine.kv.virtual import VirtualLayout  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.models.presets import PRESETS  # noqa: E402
from engine.request.sampling_params import SamplingParams  # noqa: E402
from engine.sample.sampler import Sampled  # noqa: E402
from engine.sched.scheduler import Scheduler  # noqa: E402
from engine.request.sequence import Sequence  # noqa: E402

MAX_MODEL_LEN = 2048
ALLOCATORS = {  # name: (layout, page bytes or block tokens)
    "naive": ("paged", MAX_MODEL_LEN), "paged-16": ("paged", 16), "paged-256": ("paged", 256),
    "per_layer-2MiB": ("per_layer", 2 << 20), "interleaved-2MiB": ("interleaved", 2 << 20),
    "per_layer-small": ("per_layer", None), "interleaved-small": ("interleaved", None),
}


def make_cache(cfg: ModelConfig, name: str, budget: int, max_seqs: int, small_page: int):
    layout, size = ALLOCATORS[name]
    size = size or small_page
    dtype = torch.bfloat16
    if layout == "paged":
        block_bytes = size * cfg.kv_bytes_per_token(2)
        return KVManager(PagedLayout(cfg, size, budget // block_bytes, dtype, torch.device("cpu")))
    return KVManager(VirtualLayout(cfg, layout, max_seqs, MAX_MODEL_LEN, dtype, vmm.HostBackend(size), budget // size))


def replay(cfg: ModelConfig, name: str, trace, budget: int, horizon: int, max_seqs: int,
           small_page: int) -> dict:
    kv = make_cache(cfg, name, budget, max_seqs, small_page)
    scheduler = Scheduler(kv, max_seqs, max_num_batched_tokens=4096)
    pending, finished, samples = list(trace), 0, []
    for step in range(horizon):
        while pending and pending[0][0] <= step:
            _, req = pending.pop(0)
            scheduler.queues.add(Sequence(str(step), 0, list(req.prompt_ids),
                                   SamplingParams(max_tokens=req.output_len, ignore_eos=True), step))
        out = scheduler.schedule()
        results = {seq: [Sampled(0)] for seq, n in out.scheduled if seq.num_computed_tokens + n >= len(seq)}
        finished += sum(o.finish_reason is not None for o in scheduler.update_from_output(out, results))
        used = sum(s.num_computed_tokens for s in scheduler.queues.running) * cfg.kv_bytes_per_token(2)
        stats = kv.stats()
        active = stats.pages_in_use * kv.layout.page_size
        allocated = active + stats.pages_idle * kv.layout.page_size
        samples.append((used, allocated, active, len(scheduler.queues.running)))
        if not pending and not scheduler.queues.has_unfinished():
            break
    kv.audit()
    kv.close()
    used, allocated, active, running = (np.array(x, dtype=float) for x in zip(*samples))
    busy = active > 0
    peak = int(allocated.argmax())
    return {"allocator": name, "page_bytes": kv.layout.page_size, "pages_total": kv.pool.num_pages,
            "utilization_mean": float((used[busy] / allocated[busy]).mean()) if busy.any() else 0.0,
            "utilization_at_peak": float(used[peak] / allocated[peak]) if allocated[peak] else 0.0,
            "utilization_active_mean": float((used[busy] / active[busy]).mean()) if busy.any() else 0.0,
            "max_concurrent_seqs": int(running.max()), "finished": finished, "steps": len(samples),
            "preemptions": scheduler.num_preemptions}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(result["shapes"])
    fig, axes = plt.subplots(len(shapes), 2, figsize=(12, 3.6 * len(shapes)), squeeze=False)
    for row, shape in zip(axes, shapes):
        rows = result["shapes"][shape]["runs"]
        names = [r["allocator"] for r in rows]
        x = np.arange(len(names))
        row[0].bar(x - 0.27, [100 * r["utilization_mean"] for r in rows], 0.27, label="time average")
        row[0].bar(x, [100 * r["utilization_at_peak"] for r in rows], 0.27, label="at peak")
        row[0].bar(x + 0.27, [100 * r["utilization_active_mean"] for r in rows], 0.27,
                   label="time average, idle pages left out")
        row[0].set_ylabel("KV utilization %")
        row[1].bar(x, [r["max_concurrent_seqs"] for r in rows], color="tab:green")
        row[1].set_ylabel("max concurrent sequences")
        for ax in row:
            ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
            ax.set_title(f"{shape}, {result['shapes'][shape]['budget_bytes'] >> 20} MiB KV (bf16)", fontsize=9)
        row[0].set_ylim(0, 130)
        row[0].legend(fontsize=7, ncol=3, loc="upper center")
    fig.suptitle(f"{result['num_requests']} ShareGPT requests, Poisson {result['rate']} req/step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--rate", type=float, default=1.0, help="mean arrivals per engine step")
    parser.add_argument("--horizon", type=int, default=3000, help="steps replayed at most")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--shapes", default="llama-3-8b:4096:256,smollm2-135m:256:64",
                        help="preset:budget MiB:small page KiB, comma-separated")
    parser.add_argument("--allocators", default=",".join(ALLOCATORS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    args = parser.parse_args()

    from engine.models import load_tokenizer
    requests = sample_requests(load_tokenizer(None), args.num_requests, args.seed)
    gaps = np.random.default_rng(args.seed).exponential(1 / args.rate, len(requests))
    trace = list(zip(np.cumsum(gaps).astype(int).tolist(), requests))
    result = {"benchmark": "kv_memory", "command": " ".join(["python"] + sys.argv),
              "num_requests": len(requests), "rate": args.rate, "horizon": args.horizon,
              "max_model_len": MAX_MODEL_LEN, "tokenizer": "SmolLM2-135M-Instruct",
              "mean_prompt_len": float(np.mean([len(r.prompt_ids) for r in requests])),
              "mean_output_len": float(np.mean([r.output_len for r in requests])),
              "machine": machine_info(), "shapes": {}}
    for spec in args.shapes.split(","):
        preset, mib, small_kib = spec.split(":")
        cfg = ModelConfig.from_hf(PRESETS[preset])
        runs = []
        for name in tqdm(args.allocators.split(","), desc=preset):
            start = time.perf_counter()
            runs.append(replay(cfg, name, trace, int(mib) << 20, args.horizon, args.max_num_seqs,
                               int(small_kib) << 10))
            runs[-1]["wall_s"] = time.perf_counter() - start
        result["shapes"][preset] = {"budget_bytes": int(mib) << 20, "kv_bytes_per_token": cfg.kv_bytes_per_token(2),
                                    "small_page_bytes": int(small_kib) << 10, "runs": runs}
        print(f"\n{preset} ({mib} MiB bf16 KV)")
        print(f"{'allocator':<20}{'util avg':>9}{'at peak':>9}{'active':>9}{'max seqs':>9}{'finished':>9}{'preempt':>9}")
        for r in runs:
            print(f"{r['allocator']:<20}{100 * r['utilization_mean']:>8.1f}%{100 * r['utilization_at_peak']:>8.1f}%"
                  f"{100 * r['utilization_active_mean']:>8.1f}%"
                  f"{r['max_concurrent_seqs']:>9}{r['finished']:>9}{r['preemptions']:>9}")
    save(result, args.json_path, args.plot_path, plot)


if __name__ == "__main__":
    main()
