"""vkv's panel GEMM against oneDNN's packed GEMM, on SmolLM2-135M's projection shapes.

    python benchmarks/bench_gemm.py --json benchmarks/results/cpu/gemm.json \
        --plot benchmarks/results/cpu/gemm.png
    python benchmarks/bench_gemm.py --dtype bfloat16 --shapes smollm2,llama-1b --json ...

`--dtype bfloat16`: bf16 weights and activations, as the engine serves them where bf16 arithmetic
is native: the panels' steps of more than 12 rows in AVX512-BF16 dot products (ext/cpu/panels.h,
Note [bf16 steps in bf16 dot products]; fewer rows in fp32 arithmetic, decode's), against oneDNN's
packed bf16 GEMM; the peak is then twice the fp32 FMA peak (a dot product multiplies a pair of
bf16 a lane). `--shapes llama-1b` adds Llama-3.2-1B's projections (2048 -> 3072, 2048 -> 2048,
2048 -> 16384, 8192 -> 2048).

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
SHAPES_1B = {"1b_qkv": (2048, 3072), "1b_o": (2048, 2048), "1b_gate_up": (2048, 16384), "1b_down": (8192, 2048)}
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
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--shapes", default="smollm2", help="smollm2, llama-1b, or both (comma-separated)")
    args = p.parse_args()
    if ext.cpu_kernels() is None:
        sys.exit(f"the native CPU kernels are unavailable: {ext.cpu_kernels_error()}")
    dtype = getattr(torch, args.dtype)
    if dtype == torch.bfloat16 and not ext.bf16_dot_gemm()[0]:
        sys.exit(f"no bf16 dot products over the panels here: {ext.bf16_dot_gemm()[1]}")
    shapes = {**(SHAPES if "smollm2" in args.shapes else {}), **(SHAPES_1B if "llama-1b" in args.shapes else {})}
    torch.manual_seed(0)
    peaks = [fma_peak_gflops()]
    rows = []
    for name, (k, n) in shapes.items():
        layer = Linear(k, n)
        torch.nn.init.normal_(layer.weight, std=k ** -0.5)
        layer.weight.data = layer.weight.data.to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), PACK_HINT)
        layer.pack_panels(dtype, dot=dtype == torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k, dtype=dtype)
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
    fma_peak = statistics.mean(p["gflops"] for p in peaks)
    peak = fma_peak * (2 if dtype == torch.bfloat16 else 1)
    for r in rows:
        r |= {"panels_share_of_peak": r["panels_gflops"] / peak, "onednn_share_of_peak": r["onednn_gflops"] / peak}
    print(f"[bench] peak {peak:.1f} GFLOP/s (fp32 FMAs before {peaks[0]['gflops']:.1f}, after {peaks[1]['gflops']:.1f})")
    result = {"benchmark": "gemm", "command": "python " + " ".join(sys.argv), "machine": machine_info(),
              "dtype": args.dtype, "peak_is": "twice the fp32 FMA peak" if dtype == torch.bfloat16 else "the fp32 FMA peak",
              "kernel_isa": ext.kernel_isa()[0], "panel_width": torch.ops.vkv.panel_width(),
              "threads": torch.get_num_threads(), "fma_peak_gflops": fma_peak, "peak_gflops": peak,
              "fma_peak_runs": peaks, "results": rows}
    save(result, args.json, args.plot, plot)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, name in enumerate(dict.fromkeys(r["shape"] for r in result["results"])):
        mine = [r for r in result["results"] if r["shape"] == name]
        color = f"C{i}"
        ax.plot([r["rows"] for r in mine], [r["panels_gflops"] for r in mine], "-o", color=color, label=f"{name}: vkv panels")
        ax.plot([r["rows"] for r in mine], [r["onednn_gflops"] for r in mine], "--", color=color, alpha=0.6,
                label=f"{name}: oneDNN")
    if "fma_peak_gflops" in result:
        ax.axhline(result.get("peak_gflops", result["fma_peak_gflops"]), color="k", lw=0.8, ls=":",
                   label=f"peak (measured: {result.get('peak_is', 'the fp32 FMA peak')})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (tokens in the step)")
    ax.set_ylabel(f"GFLOP/s ({result.get('dtype', 'float32')})")
    ax.legend(fontsize=7, ncol=2)
    m = result["machine"]
    ax.set_title(f"Projection GEMMs, {result.get('dtype', 'float32')}: vkv's panel GEMM vs oneDNN "
                 f"({result['threads']} threads)\n"
                 f"{m.get('cpu_model', '')} ({', '.join(m.get('isa', []))}), kernels {result['kernel_isa']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
