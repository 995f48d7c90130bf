"""The page-mapping profiler: what each VMM call costs, per page and per batched run.

Per page it times create, map, set-access, unmap and release one page at a time; then it maps
runs of 1..64 pages with one map call per page and a single access call per run, which is how
the KV manager maps. Samples are kept raw in the JSON; summaries are min, median and p99.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
from tqdm import tqdm

from vmm import make_backend
from vmm.backend import Backend
from vmm.machine import machine_info

RUN_LENGTHS = (1, 2, 4, 8, 16, 32, 64)


def summarize(samples_us: list[float]) -> dict:
    a = np.asarray(samples_us)
    return {"min_us": float(a.min()), "median_us": float(np.median(a)),
            "p99_us": float(np.percentile(a, 99)), "n": len(samples_us), "samples_us": samples_us}


def _timed(fn, *args) -> float:
    start = time.perf_counter_ns()
    fn(*args)
    return (time.perf_counter_ns() - start) / 1e3


def profile_single_pages(backend: Backend, pages: int) -> dict[str, list[float]]:
    ps = backend.page_size
    samples = {op: [] for op in ("create", "map", "set_access", "unmap", "release")}
    handles = []
    for _ in tqdm(range(pages), desc="create", leave=False):
        start = time.perf_counter_ns()
        handles.append(backend.create_page())
        samples["create"].append((time.perf_counter_ns() - start) / 1e3)
    base = backend.reserve(pages * ps)
    for i, handle in enumerate(handles):
        samples["map"].append(_timed(backend.map_handles, base + i * ps, [handle]))
        samples["set_access"].append(_timed(backend.set_access, base + i * ps, ps))
    for i in range(pages):
        samples["unmap"].append(_timed(backend.unmap, base + i * ps, ps))
    for handle in handles:
        samples["release"].append(_timed(backend.release_page, handle))
    backend.free_reservation(base, pages * ps)
    return samples


def profile_runs(backend: Backend, pages: int, repeats: int) -> list[dict]:
    ps = backend.page_size
    lengths = [n for n in RUN_LENGTHS if n <= pages]
    handles = [backend.create_page() for _ in range(max(lengths))]
    # Map in scattered physical order, as a KV cache sees pages after some churn.
    order = np.random.default_rng(0).permutation(len(handles)).tolist()
    base = backend.reserve(max(lengths) * ps)
    rows = []
    for n in tqdm(lengths, desc="batched runs", leave=False):
        run = [handles[i] for i in order[:n]]
        map_us, unmap_us = [], []
        for _ in range(repeats):
            map_us.append(_timed(backend.map, base, run))
            unmap_us.append(_timed(backend.unmap, base, n * ps))
        rows.append({"pages": n, "map_run": summarize(map_us), "unmap_run": summarize(unmap_us),
                     "map_per_page_median_us": float(np.median(map_us)) / n})
    backend.free_reservation(base, max(lengths) * ps)
    for handle in handles:
        backend.release_page(handle)
    return rows


def profile_mapping(backend_name: str, pages: int = 256, page_size: int | None = None,
                    repeats: int = 50) -> dict:
    backend = make_backend(backend_name, page_size)
    try:
        single = profile_single_pages(backend, pages)
        runs = profile_runs(backend, pages, repeats)
    finally:
        backend.close()
    return {"benchmark": "page_mapping", "backend": backend_name, "page_size": backend.page_size,
            "pages": pages, "machine": machine_info(),
            "per_page": {op: summarize(s) for op, s in single.items()}, "batched": runs}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    ops = list(result["per_page"])
    med = [result["per_page"][op]["median_us"] for op in ops]
    p99 = [result["per_page"][op]["p99_us"] for op in ops]
    left.bar(ops, med, label="median")
    left.scatter(ops, p99, color="k", marker="_", s=300, label="p99", zorder=3)
    left.set_yscale("log")
    left.set_ylabel("µs per page")
    left.set_title(f"{result['backend']}: one page at a time ({result['page_size'] >> 10} KiB)")
    left.legend()
    runs = result["batched"]
    n = [r["pages"] for r in runs]
    right.plot(n, [r["map_per_page_median_us"] for r in runs], "o-", label="map + one set-access")
    right.plot(n, [r["unmap_run"]["median_us"] / r["pages"] for r in runs], "s-", label="unmap run")
    right.set_xscale("log", base=2)
    right.set_xlabel("pages per run")
    right.set_ylabel("median µs per page")
    right.set_title("batched runs")
    right.legend()
    gpu = result["machine"].get("gpu") or result["machine"]["processor"]
    fig.suptitle(f"vkv page-mapping latency — {gpu}, torch {result['machine']['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(result: dict) -> None:
    print(f"backend={result['backend']} page_size={result['page_size']} pages={result['pages']}")
    print(f"{'op':<12}{'min µs':>10}{'median µs':>12}{'p99 µs':>10}")
    for op, s in result["per_page"].items():
        print(f"{op:<12}{s['min_us']:>10.2f}{s['median_us']:>12.2f}{s['p99_us']:>10.2f}")
    print(f"{'run pages':<12}{'map µs':>10}{'per page':>12}{'unmap µs':>10}")
    for r in result["batched"]:
        print(f"{r['pages']:<12}{r['map_run']['median_us']:>10.2f}"
              f"{r['map_per_page_median_us']:>12.2f}{r['unmap_run']['median_us']:>10.2f}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["host", "cuda"], default="host")
    parser.add_argument("--pages", type=int, default=256, help="pages created and mapped one by one")
    parser.add_argument("--page-size", type=int, default=None, help="bytes (default 2 MiB / granularity)")
    parser.add_argument("--repeats", type=int, default=50, help="repetitions of each batched run")
    parser.add_argument("--json", dest="json_path", help="write the full result here")
    parser.add_argument("--plot", dest="plot_path", help="write a PNG plot here")


def run(args: argparse.Namespace) -> dict:
    if args.pages < 1 or args.repeats < 1:
        raise SystemExit("--pages and --repeats must be >= 1")
    result = profile_mapping(args.backend, args.pages, args.page_size, args.repeats)
    result["command"] = (f"vkv profile-mapping --backend {args.backend} --pages {args.pages} "
                         f"--repeats {args.repeats}" + (f" --page-size {args.page_size}" if args.page_size else ""))
    print_table(result)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot_path:
        plot(result, args.plot_path)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))
