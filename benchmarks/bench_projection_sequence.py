"""Where single-stream decode's projections lose against the read bound: the model's projections
one after another, against one projection of the same bytes.

    python benchmarks/bench_projection_sequence.py --dtype bfloat16 --samples 30 \
        --json benchmarks/results/cpu/projection_sequence.json --plot benchmarks/results/cpu/projection_sequence.png

A decode step at one row streams every layer's four projections (qkv, o, gate/up, down: 120 for
the bundled model) with serial work between them. bench_decode_share.py measures the whole step;
this takes the serial work away and asks what the projections alone cost beyond their bytes. Each
sample, on the bundled model's own panels (on 2 MiB pages, as the engine lays them out):

    probe      roofline.read_gbps: a dot product of two arrays on 2 MiB pages, all threads
    one        one one-row `linear_panels` over synthetic panels of the step's total bytes
               (K = hidden size), on 2 MiB pages: the kernel's streaming rate with no boundaries
    sequence   every layer's projections in order, one-row `linear_panels` each, from Python;
               the gate/up projection as `linear_panels` over its fused panels (decode folds silu
               into it: the same bytes)
    calls      as many calls over a one-panel weight: a call's own cost (Python, dispatch, checks),
               taken off `sequence` for `sequence - calls`

Each is the best of --repeats; a sample's level is its probe's (split at --split GB/s, as in
bench_decode_share.py). The shares are GB/s over the probe. `sequence - calls` against `one` is
what the boundaries between projections cost (the fork and join of the threads, each thread's
streams starting again); decode's serial stages come on top of that. Run it alone.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import add_level_arguments, isa_label, machine_info, positive, run_as, save  # noqa: E402
from roofline import read_gbps  # noqa: E402

import ext  # noqa: E402
from engine import LLM  # noqa: E402
from engine.models.huge_pages import onto_huge_pages  # noqa: E402

PROBE_MIB = 128
KINDS = ("one", "sequence", "sequence - calls")


def best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--samples", type=positive, default=30)
    p.add_argument("--repeats", type=positive, default=3, help="timings per kind a sample, the best kept")
    add_level_arguments(p)
    args = p.parse_args(argv)
    run_as(args.isa, __file__, argv)
    if ext.cpu_kernels() is None:
        sys.exit(f"the native CPU kernels are unavailable: {ext.cpu_kernels_error()}")
    lp, width = torch.ops.vkv.linear_panels, torch.ops.vkv.panel_width()
    with LLM(dtype=args.dtype, quantization="dequantize", enable_prefix_caching=False, kv_cache_memory=16 << 20) as llm:
        model = llm.engine.model
        if not model.decode:
            sys.exit(f"{args.dtype}: the one-call decode path does not run here ({model.gemm_path})")
        panels = [t for layer in model.decode for t in (layer[3], layer[5], layer[6], layer[7])]
        total = sum(t.nbytes for t in panels)
        hidden = panels[0].size(1)
        xs = {t.size(1): torch.randn(1, t.size(1)) for t in panels}
        steps = [(xs[t.size(1)], t, torch.empty(1, t.size(0) * width)) for t in panels]  # (x, panels, out)
        one = torch.empty(total // (hidden * width * panels[0].element_size()), hidden, width, dtype=panels[0].dtype)
        one.normal_()
        pages = onto_huge_pages([one])
        one_out = torch.empty(1, one.size(0) * width)
        tiny, tiny_x, tiny_out = one[:1], torch.randn(1, hidden), torch.empty(1, width)

        def sequence():
            for x, w, o in steps:
                lp(x, w, None, o)

        def calls():
            for _ in panels:
                lp(tiny_x, tiny, None, tiny_out)

        for _ in range(2):  # first-call costs, not kept
            lp(xs[hidden], one, None, one_out), sequence(), calls()
        samples = []
        for i in range(args.samples):
            probe = read_gbps(PROBE_MIB, repeats=3)
            t_one, t_seq, t_calls = (best_seconds(fn, args.repeats) for fn in
                                     (lambda: lp(xs[hidden], one, None, one_out), sequence, calls))
            gbps = {"one": one.nbytes / t_one / 1e9, "sequence": total / t_seq / 1e9,
                    "sequence - calls": total / (t_seq - t_calls) / 1e9}
            samples.append({"probe_gbps": probe, "gbps": gbps, "call_us": t_calls / len(panels) * 1e6,
                            "share": {k: v / probe for k, v in gbps.items()}})
            print(f"[bench] {i + 1}/{args.samples}: probe {probe:.1f} GB/s, " +
                  ", ".join(f"{k} {v:.1f}" for k, v in gbps.items()) + f", a call {samples[-1]['call_us']:.2f} us",
                  flush=True)
    levels = {}
    for name, inside in (("slow", lambda g: g < args.split), ("fast", lambda g: g >= args.split)):
        level = [s for s in samples if inside(s["probe_gbps"])]
        levels[name] = {"level_samples": len(level)} | ({
            "probe_gbps": statistics.median(s["probe_gbps"] for s in level),
            "share": {k: statistics.median(s["share"][k] for s in level) for k in KINDS},
            "sequence_over_one": statistics.median(s["gbps"]["sequence - calls"] / s["gbps"]["one"] for s in level),
            "lost_us_per_projection": statistics.median(
                (total / s["gbps"]["sequence - calls"] - total / s["gbps"]["one"]) / 1e3 / len(panels) for s in level),
        } if level else {})
        if level:
            lv = levels[name]
            print(f"{name} level ({len(level)} samples, probe {lv['probe_gbps']:.1f} GB/s): " +
                  ", ".join(f"{k} {v * 100:.1f}%" for k, v in lv["share"].items()) +
                  f"; the sequence (calls taken off) at {lv['sequence_over_one'] * 100:.1f}% of one projection, "
                  f"{lv['lost_us_per_projection']:.2f} us lost a projection", flush=True)
    result = {"benchmark": "projection_sequence", "machine": machine_info(),
              "command": "python benchmarks/bench_projection_sequence.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "kernel_isa": ext.kernel_isa()[0], "threads": torch.get_num_threads(), "isa": isa_label(args.isa),
              "dtype": args.dtype, "projections": len(panels), "bytes": total, "one_panels": pages,
              "split_gbps": args.split, "repeats": args.repeats, "levels": levels, "samples": samples}
    save(result, args.json, args.plot, plot)
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, kind in enumerate(KINDS):
        ax.scatter([s["probe_gbps"] for s in result["samples"]], [s["gbps"][kind] for s in result["samples"]],
                   color=f"C{i}", s=14, label=kind)
    top = max(s["probe_gbps"] for s in result["samples"])
    ax.plot([0, top], [0, top], "k-", lw=0.8, label="the probe")
    ax.plot([0, top], [0, 0.85 * top], "k--", lw=0.8, label="85% of it")
    ax.set_xlabel("read bandwidth probed before the sample (GB/s)")
    ax.set_ylabel("weights streamed (GB/s)")
    ax.legend(fontsize=8)
    m = result["machine"]
    ax.set_title(f"vkv one-row projections, {result['dtype']}: {result['projections']} in sequence against one "
                 f"of the same {result['bytes'] / 1e6:.0f} MB\n{m.get('cpu_model', '')}, kernels {result['kernel_isa']}, "
                 f"{result['threads']} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
