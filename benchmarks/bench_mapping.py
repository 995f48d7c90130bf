"""Page-mapping latency of a vmm backend: per call (create, map, set-access, unmap, release)
and per batched run, as the KV caches map.

    python benchmarks/bench_mapping.py --backend host --pages 256 \
        --json benchmarks/results/cpu/mapping-host.json --plot benchmarks/results/cpu/mapping-host.png
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, save  # noqa: E402

from vmm import make_backend  # noqa: E402
from vmm.profiler import profile_mapping  # noqa: E402


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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["host", "cuda"], default="host")
    parser.add_argument("--pages", type=int, default=256, help="pages created and mapped one by one")
    parser.add_argument("--page-size", type=int, default=None, help="bytes (default 2 MiB / granularity)")
    parser.add_argument("--repeats", type=int, default=50, help="repetitions of each batched run")
    parser.add_argument("--json", dest="json_path", help="write the full result here")
    parser.add_argument("--plot", dest="plot_path", help="write a PNG plot here")
    args = parser.parse_args(argv)
    if args.pages < 1 or args.repeats < 1:
        parser.error("--pages and --repeats must be >= 1")
    backend = make_backend(args.backend, args.page_size)
    try:
        result = {"benchmark": "page_mapping", **profile_mapping(backend, args.pages, args.repeats),
                  "machine": machine_info()}
    finally:
        backend.close()
    result["command"] = ("python benchmarks/bench_mapping.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print_table(result)
    save(result, args.json_path, args.plot_path, plot)
    return result


if __name__ == "__main__":
    main()
