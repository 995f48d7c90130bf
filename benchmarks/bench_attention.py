"""Attention time per layer on the CPU: the same kernel over each KV layout, same shapes.

    python benchmarks/bench_attention.py --json benchmarks/results/cpu/attention.json \
        --plot benchmarks/results/cpu/attention.png

Layouts (what a kernel reads sequence b's position p from):
  per_layer    [slots, rows, H, D] per layer: a slot's rows are contiguous
  interleaved  one [slots, rows, L, 2, H, D] range: a layer's K is a strided view (row stride L*2*H*D)
  paged        [blocks, 16, H, D] per layer with a random block table (PagedAttention's layout)
Kernels: `native` (vkv's CPU kernel, one call for the batch; reads every layout in place,
the block table through its table) and `sdpa` (torch's kernel per sequence over its slot;
gathers a block table's blocks first). Cases: decode of 32 sequences at 256 and 1,024 tokens
of context, and a 512-token prefill. Reported: median time per call, and the bytes of K and V
the call must read over that time, against the bandwidth of a large copy measured in the same
run. Shapes: SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64, 30 layers) and Llama-3-8B
(32, 8, 128, 32 layers).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, save  # noqa: E402

import ext  # noqa: E402
from engine.attention import StepAttention  # noqa: E402
from engine.kv.batch import StepBatch  # noqa: E402
from engine.ops import rope_table  # noqa: E402

SHAPES = {"smollm2-135m": (9, 3, 64, 30), "llama-3-8b": (32, 8, 128, 32)}
CASES = {"decode-32x256": [(1, 256)] * 32, "decode-32x1024": [(1, 1024)] * 32, "prefill-512": [(512, 512)]}


def caches(layout: str, seqs, hkv: int, dim: int, layers: int, dtype):
    """Layer 0's K and V caches in `layout`, with a block table for `seqs`."""
    if layout == "paged":
        blocks = sum(-(-c // 16) for _, c in seqs)
        k, v = (torch.randn(blocks, 16, hkv, dim, dtype=dtype) for _ in range(2))
        order = torch.randperm(blocks).tolist()
        table = [[order.pop() for _ in range(-(-c // 16))] for _, c in seqs]
        return k, v, table, 16
    rows = max(c for _, c in seqs)
    if layout == "interleaved":
        whole = torch.randn(len(seqs), rows, layers, 2, hkv, dim, dtype=dtype)
        k, v = whole[:, :, 0, 0], whole[:, :, 0, 1]
    else:
        k, v = (torch.randn(len(seqs), rows, hkv, dim, dtype=dtype) for _ in range(2))
    return k, v, [[s] for s in range(len(seqs))], rows


def batch_for(seqs, table, block_size) -> StepBatch:
    starts, row = [], 0
    for q_len, _ in seqs:
        starts.append(row)
        row += q_len
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    width = max(map(len, table))
    return StepBatch([None] * len(seqs), starts, [q for q, _ in seqs], [c for _, c in seqs],
                     torch.tensor([p for q, c in seqs for p in range(c - q, c)]),
                     i32([i for i, (q, _) in enumerate(seqs) for _ in range(q)]), i32(starts), i32([q for q, _ in seqs]),
                     i32([c for _, c in seqs]), i32([0] + [s + q for s, (q, _) in zip(starts, seqs)]),
                     i32([t + [0] * (width - len(t)) for t in table]), block_size)


def timed(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def copy_bandwidth() -> float:
    """Bytes per second of a 512 MiB copy (read + write), the machine's practical memory bandwidth."""
    src = torch.empty(128 << 20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), 5)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    shapes = list(SHAPES)
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5))
    for ax, shape in zip(axes, shapes):
        mine = [r for r in rows if r["shape"] == shape]
        labels = sorted({(r["case"], r["dtype"]) for r in mine})
        series = sorted({(r["kernel"], r["layout"]) for r in mine})
        width = 0.8 / len(series)
        for i, (kernel, layout) in enumerate(series):
            ms = [next((r["ms"] for r in mine if (r["case"], r["dtype"]) == lab and r["kernel"] == kernel
                        and r["layout"] == layout), 0) for lab in labels]
            ax.bar([j + i * width for j in range(len(labels))], ms, width, label=f"{kernel} {layout}")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
        ax.set_xticklabels([f"{c}\n{d}" for c, d in labels], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("ms per layer call")
        ax.set_title(shape)
        ax.legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(f"attention per layer, CPU — {m['processor']} ({m['cpu_count']} CPUs), torch {m['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", dest="json_path")
    p.add_argument("--plot", dest="plot_path")
    args = p.parse_args()
    if ext.cpu_kernels() is None:
        raise SystemExit(f"the native kernels are unavailable: {ext.cpu_kernels_error()}")
    torch.manual_seed(0)
    bandwidth, rows = copy_bandwidth(), []
    for shape, (hq, hkv, dim, layers) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            cos_sin = rope_table(1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), 1024, dtype, "cpu")
            for case, seqs in CASES.items():
                tokens = sum(q for q, _ in seqs)
                q, k, v = (torch.randn(tokens, h, dim, dtype=dtype) for h in (hq, hkv, hkv))
                kv_bytes = sum(c for _, c in seqs) * 2 * hkv * dim * q.element_size()
                for layout in ("per_layer", "interleaved", "paged"):
                    k_cache, v_cache, table, block_size = caches(layout, seqs, hkv, dim, layers, dtype)
                    batch = batch_for(seqs, table, block_size)
                    for kernel in ("native", "sdpa"):
                        attn = StepAttention(kernel, [k_cache], [v_cache], batch, cos_sin)
                        seconds = timed(lambda: attn(0, q, k, v), args.repeats)  # rotating in place again is fine here
                        rows.append({"shape": shape, "dtype": str(dtype).removeprefix("torch."), "case": case,
                                     "layout": layout, "kernel": kernel, "ms": seconds * 1e3,
                                     "kv_bytes": kv_bytes, "share_of_copy_bandwidth": kv_bytes / seconds / bandwidth})
                        r = rows[-1]
                        print(f"{shape:13s} {r['dtype']:8s} {case:15s} {layout:11s} {kernel:6s} {r['ms']:8.3f} ms "
                              f"({100 * r['share_of_copy_bandwidth']:4.0f}% of copy bandwidth)", flush=True)
    result = {"benchmark": "attention_layouts_cpu", "copy_bandwidth_gb_s": bandwidth / 1e9, "machine": machine_info(),
              "rows": rows, "command": "python benchmarks/bench_attention.py " + " ".join(sys.argv[1:])}
    save(result, args.json_path, args.plot_path, plot)


if __name__ == "__main__":
    main()
