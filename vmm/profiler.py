"""The page-mapping profiler: what each VMM call costs, per page and per batched run.

Per page it times create, map, set-access, unmap and release one page at a time; then it maps
runs of 1..64 pages with one map call per page and a single access call per run, which is how
the KV manager maps. Samples are kept raw; summaries are min, median and p99. Reporting (the
command line, tables, plots) lives in benchmarks/bench_mapping.py.
"""
from __future__ import annotations

import time

import numpy as np
from tqdm import tqdm

from vmm.backend import Backend

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


def profile_mapping(backend: Backend, pages: int = 256, repeats: int = 50) -> dict:
    """Per-page and batched-run latencies of one backend; the backend stays open."""
    single = profile_single_pages(backend, pages)
    runs = profile_runs(backend, pages, repeats)
    return {"backend": backend.name, "page_size": backend.page_size, "pages": pages,
            "per_page": {op: summarize(s) for op, s in single.items()}, "batched": runs}
