"""`vkv profile-mapping`: what mapping a KV page costs on this machine, over a sweep of page sizes.

For each page size it runs vmm's profiler (create, map, set-access, unmap, release one page at
a time; then runs of 1..64 pages mapped with one access call per run, as the KV caches map) and
reports min / median / p99 per call. Page sizes: several on the host (4 KiB to 2 MiB), multiples
of the allocation granularity on CUDA. The JSON keeps every raw sample; the plot shows the
median per call against the page size, and the batched cost per page.

    vkv profile-mapping --backend host --pages 256 --json map.json --plot map.png
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from tqdm import tqdm

import vmm
from engine.machine import machine_info
from vmm.profiler import profile_mapping

HOST_PAGE_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 2 << 20)
CUDA_MULTIPLES = (1, 2, 4, 8)  # of the granularity (2 MiB on Hopper)


def default_page_sizes(backend: str) -> list[int]:
    if backend == "host":
        return list(HOST_PAGE_SIZES)
    probe = vmm.make_backend("cuda")
    try:
        return [m * probe.granularity for m in CUDA_MULTIPLES]
    finally:
        probe.close()


def sweep(backend: str, page_sizes: list[int], pages: int, repeats: int) -> dict:
    runs = []
    for page_size in tqdm(page_sizes, desc=f"{backend} page sizes"):
        b = vmm.make_backend(backend, page_size)
        try:
            runs.append(profile_mapping(b, pages, repeats))
        finally:
            b.close()
    return {"benchmark": "page_mapping", "backend": backend, "pages": pages, "repeats": repeats,
            "page_sizes": page_sizes, "sweep": runs, "machine": machine_info()}


def print_table(result: dict) -> None:
    ops = list(result["sweep"][0]["per_page"])
    print(f"{result['backend']} backend, {result['pages']} pages per size: median µs per call (p99)")
    print(f"{'page size':>10}" + "".join(f"{op:>18}" for op in ops) + f"{'64-page run/page':>18}")
    for run in result["sweep"]:
        cells = "".join(f"{run['per_page'][op]['median_us']:>9.2f} ({run['per_page'][op]['p99_us']:>6.1f})" for op in ops)
        batched = run["batched"][-1]["map_per_page_median_us"] if run["batched"] else float("nan")
        print(f"{_size(run['page_size']):>10}{cells}{batched:>18.2f}")


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    sizes = [run["page_size"] for run in result["sweep"]]
    for op in result["sweep"][0]["per_page"]:
        left.plot(sizes, [run["per_page"][op]["median_us"] for run in result["sweep"]], "o-", label=op)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks(sizes, [_size(s) for s in sizes])
    left.set_xlabel("page size")
    left.set_ylabel("median µs per call")
    left.set_title(f"{result['backend']}: one page at a time")
    left.legend(fontsize=8)
    for run in result["sweep"]:
        n = [r["pages"] for r in run["batched"]]
        right.plot(n, [r["map_per_page_median_us"] for r in run["batched"]], "o-", label=_size(run["page_size"]))
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("pages per run (one access call per run)")
    right.set_ylabel("median µs per page mapped")
    right.set_title("batched runs")
    right.legend(title="page size", fontsize=8)
    m = result["machine"]
    fig.suptitle(f"vkv page-mapping latency — {m.get('gpu') or m['cpu_model']}, torch {m['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["host", "cuda"], default="host")
    p.add_argument("--pages", type=int, default=256, help="pages created and mapped one by one, per page size")
    p.add_argument("--page-sizes", default=None, help="comma-separated bytes (default: 4 KiB..2 MiB on the host, "
                   "1, 2, 4, 8 x the granularity on CUDA)")
    p.add_argument("--repeats", type=int, default=50, help="repetitions of each batched run")
    p.add_argument("--json", dest="json_path", help="write the full result (raw samples too) here")
    p.add_argument("--plot", dest="plot_path", help="write a PNG plot here")


def run(args: argparse.Namespace, command: str) -> dict:
    if args.pages < 1 or args.repeats < 1:
        raise ValueError("--pages and --repeats must be >= 1")
    try:
        sizes = [int(s) for s in args.page_sizes.split(",")] if args.page_sizes else default_page_sizes(args.backend)
    except ValueError:
        raise ValueError(f"--page-sizes must be comma-separated byte counts, got {args.page_sizes!r}") from None
    result = sweep(args.backend, sizes, args.pages, args.repeats)
    result["command"] = command
    print_table(result)
    if args.json_path:
        os.makedirs(os.path.dirname(args.json_path) or ".", exist_ok=True)
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot_path:
        plot(result, args.plot_path)
    print(*(f"wrote {p}" for p in (args.json_path, args.plot_path) if p), sep="\n", file=sys.stderr)
    return result
