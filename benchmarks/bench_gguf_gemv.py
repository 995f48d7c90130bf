"""One row of x times a GGUF weight in its blocks (a decode step's projection): the bytes per
second each block type reads, against a plain read of the same bytes, on 1 and all threads.

    python benchmarks/bench_gguf_gemv.py --json benchmarks/results/cpu/gguf_gemv_zen4.json --plot benchmarks/results/cpu/gguf_gemv_zen4.png

Each type's weight has a 1B Llama's gate and up rows (16384 x 2048) of random blocks whose fp16
scales are a trained model's size, interleaved by eight as the loader serves them; --copies of it
(311 MB at Q4_K by default) are multiplied in turn, so every call reads from memory, not the
caches. x is one fp32 row, rounded to int8 blocks as served (quantize_x). The probe reads the
same copies as int64 and sums them (torch), alternating with the kernel's rounds. Reported per
type and thread count: the median GB/s of --repeats rounds and their range, and the median share
of the probe's. A type near 100% is bound by memory; one well below it by its instructions.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, save, vkv_commit  # noqa: E402

# ggml's type id, block weights, block bytes, where its fp16 scales lie in a block
TYPES = {"Q8_0": (8, 32, 34, (0,)), "Q4_0": (2, 32, 18, (0,)), "Q4_1": (3, 32, 20, (0, 2)),
         "Q4_K": (12, 256, 144, (0, 2)), "Q6_K": (14, 256, 210, (208,))}


def random_blocks(kind: str, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """n rows of k weights as random blocks: every bit pattern of the quants, scales in [1e-4, 1e-2)."""
    _, weights, size, scales_at = TYPES[kind]
    blocks = torch.randint(0, 256, (n, k // weights, size), dtype=torch.uint8, generator=g)
    for at in scales_at:
        scales = (10 ** (torch.rand(n, k // weights, generator=g) * 2 - 4)).half()
        blocks[:, :, at:at + 2] = scales.view(torch.uint8).view(n, k // weights, 2)
    return blocks.view(n, -1)


def measure(kind: str, n: int, k: int, copies: int, repeats: int, threads: list[int]) -> dict:
    from engine.models.gguf_weights import GgufWeight
    type_id = TYPES[kind][0]
    weight = GgufWeight(random_blocks(kind, n, k, torch.Generator().manual_seed(0)), type_id, k).interleaved()
    rows = [weight.rows.clone() for _ in range(copies)]
    nbytes = weight.rows.numel() * copies
    flat = torch.cat([r.view(-1) for r in rows])
    flat = flat[:flat.numel() // 8 * 8].view(torch.int64)
    x, out = torch.randn(1, k), torch.empty(1, n)
    result = {"type": kind, "weight_bytes": weight.rows.numel(), "copies": copies, "by_threads": {}}
    for t in threads:
        torch.set_num_threads(t)
        torch.ops.vkv.linear_gguf(x, rows[0], type_id, None, out, True)  # (warm)
        kernel, probe = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            for r in rows:
                torch.ops.vkv.linear_gguf(x, r, type_id, None, out, True)
            kernel.append(nbytes / (time.perf_counter() - start) / 1e9)
            start = time.perf_counter()
            flat.sum()
            probe.append(flat.numel() * 8 / (time.perf_counter() - start) / 1e9)
        shares = [a / b for a, b in zip(kernel, probe)]
        result["by_threads"][str(t)] = {"gb_s": statistics.median(kernel), "gb_s_range": [min(kernel), max(kernel)],
                                        "probe_gb_s": statistics.median(probe),
                                        "probe_gb_s_range": [min(probe), max(probe)],
                                        "share_of_probe": statistics.median(shares)}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--copies", type=int, default=16)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    import ext
    if ext.cpu_kernels() is None:
        raise SystemExit(f"the native kernels are needed: {ext.cpu_kernels_error()}")
    threads = sorted({1, torch.get_num_threads()})
    rows = [measure(kind, 16384, 2048, args.copies, args.repeats, threads) for kind in args.types.split(",")]
    for r in rows:
        print(r["type"], "  ".join(f"{t} thr {v['gb_s']:.1f} GB/s ({v['share_of_probe']:.0%} of the probe's "
                                   f"{v['probe_gb_s']:.1f})" for t, v in r["by_threads"].items()))
    result = {"benchmark": "gguf_gemv", "machine": machine_info(), "vkv_commit": vkv_commit(),
              "kernel_isa": ext.kernel_isa()[0], "threads": threads, "shape": [16384, 2048], "rows": rows,
              "command": "python benchmarks/bench_gguf_gemv.py " + " ".join(sys.argv[1:])}
    save(result, args.json, args.plot, plot)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    kinds = [r["type"] for r in result["rows"]]
    width = 0.8 / len(result["threads"])
    for i, t in enumerate(result["threads"]):
        shares = [r["by_threads"][str(t)]["share_of_probe"] for r in result["rows"]]
        ax.bar([j + i * width for j in range(len(kinds))], shares, width, label=f"{t} thread(s)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + width * (len(result["threads"]) - 1) / 2 for j in range(len(kinds))], kinds)
    ax.set_ylabel("one-row GEMV bytes/s over a plain read's")
    ax.legend(fontsize=8)
    m = result["machine"]
    ax.set_title(f"GGUF blocks, one row of x, 16384 x 2048, {m.get('cpu_model', '')} ({result['kernel_isa']}), "
                 f"median of rounds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
