"""vkv's panel GEMM against oneDNN's packed GEMM, on SmolLM2-135M's projection shapes.

    python benchmarks/bench_gemm.py --json benchmarks/results/cpu/gemm.json \
        --plot benchmarks/results/cpu/gemm.png

The engine's CPU projections of more than ROWS_MAX rows (engine/models/linear.py) ran on
oneDNN's packed fp32 GEMM (`torch.ops.mkldnn._linear_pointwise` over a weight reordered with a
batch-size hint of 128) and now run on vkv's `linear_panels`. This measures both, alone, for the
rows a decode batch has (5 to 64) and a prefill chunk's (128, 512), on each of the model's
shapes: qkv 576 -> 960, o 576 -> 576, gate/up 576 -> 3072, down 1536 -> 576 and the LM head
576 -> 49152. Median of several calls after a warm-up; GFLOP/s = 2 M K N / time. Beside them,
the FMA peak measured before and after the shapes (`roofline.fma_peak_gflops`: fp32 FMAs on
every thread in the widest vector, no loads) and each GEMM's share of it. Run alone: another
process on the same cores halves either figure.
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
from roofline import fma_peak_gflops  # noqa: E402

import ext  # noqa: E402
from engine.models.linear import PACK_HINT, Linear  # noqa: E402

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}
ROWS = (5, 8, 16, 32, 64, 128, 512)


def median_time(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    if ext.cpu_kernels() is None:
        sys.exit(f"the native CPU kernels are unavailable: {ext.cpu_kernels_error()}")
    torch.manual_seed(0)
    peaks = [fma_peak_gflops()]
    rows = []
    for name, (k, n) in SHAPES.items():
        layer = Linear(k, n)
        torch.nn.init.normal_(layer.weight, std=k ** -0.5)
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), PACK_HINT)
        layer.pack_panels(torch.float32)
        for m in ROWS:
            x = torch.randn(m, k)
            calls = 5 if m * n > 4_000_000 else 25
            onednn = median_time(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), calls)
            panels = median_time(lambda: layer(x), calls)
            flops = 2 * m * k * n
            rows.append({"shape": name, "k": k, "n": n, "rows": m, "onednn_ms": onednn * 1e3, "panels_ms": panels * 1e3,
                         "onednn_gflops": flops / onednn / 1e9, "panels_gflops": flops / panels / 1e9,
                         "speedup": onednn / panels})
            print(f"[bench] {name:8s} {m:4d} rows: oneDNN {flops / onednn / 1e9:6.1f} GFLOP/s, "
                  f"panels {flops / panels / 1e9:6.1f} GFLOP/s ({onednn / panels:.2f}x)", flush=True)
    peaks.append(fma_peak_gflops())
    peak = statistics.mean(p["gflops"] for p in peaks)
    for r in rows:
        r |= {"panels_share_of_peak": r["panels_gflops"] / peak, "onednn_share_of_peak": r["onednn_gflops"] / peak}
    print(f"[bench] FMA peak {peak:.1f} GFLOP/s (before {peaks[0]['gflops']:.1f}, after {peaks[1]['gflops']:.1f})")
    result = {"benchmark": "gemm", "command": "python " + " ".join(sys.argv), "machine": machine_info(),
              "kernel_isa": ext.kernel_isa()[0], "panel_width": torch.ops.vkv.panel_width(),
              "threads": torch.get_num_threads(), "fma_peak_gflops": peak, "fma_peak_runs": peaks, "results": rows}
    save(result, args.json, args.plot, plot)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, name in enumerate(SHAPES):
        mine = [r for r in result["results"] if r["shape"] == name]
        color = f"C{i}"
        ax.plot([r["rows"] for r in mine], [r["panels_gflops"] for r in mine], "-o", color=color, label=f"{name}: vkv panels")
        ax.plot([r["rows"] for r in mine], [r["onednn_gflops"] for r in mine], "--", color=color, alpha=0.6,
                label=f"{name}: oneDNN")
    if "fma_peak_gflops" in result:
        ax.axhline(result["fma_peak_gflops"], color="k", lw=0.8, ls=":", label="FMA peak (measured)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (tokens in the step)")
    ax.set_ylabel("GFLOP/s (fp32)")
    ax.legend(fontsize=7, ncol=2)
    m = result["machine"]
    ax.set_title(f"Projection GEMMs of SmolLM2-135M: vkv's panel GEMM vs oneDNN ({result['threads']} threads)\n"
                 f"{m.get('cpu_model', '')} ({', '.join(m.get('isa', []))}), kernels {result['kernel_isa']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
