"""Where a single-stream decode step's time goes: each stage of the one-call decode, timed inside it.

    python benchmarks/bench_decode_stages.py --dtypes float32,bfloat16 --repeats 5 \
        --json benchmarks/results/cpu/decode_stages.json --plot benchmarks/results/cpu/decode_stages.png

bench_decode_share.py gives the whole step's share of the read bound; this says where the rest
goes. The engine is bench_vs_llamacpp.py's decode alone (a 4-token prompt, --tokens greedy tokens,
--num-scheduler-steps 8, prefix caching off, all threads). With decode_layers' stage clock on
(torch.ops.vkv.time_decode_stages, ext/cpu/decode_step.cpp), each run sums every stage's time: per
layer the context prefetch, the two norms, the qkv projection, rope and the cache store,
attention, the o projection, the gate/up projection with silu folded in, the down projection;
per step the pick (last norm, the LM head's half-size copy, the exact pick) and the next token's
embedding. `other` is the run's wall time less those: Python between calls (scheduling, mapping
pages, detokenizing), the calls' own costs and the prompt's prefill. The streaming stages also
give GB/s (their bytes over their time), and the whole step its share of a read probe taken
before and after the run (roofline.read_gbps over as many bytes as a step streams:
roofline.footprint_mib; --probe-mib sets another size). Medians of
--repeats runs. `--isa avx2` measures the AVX2 code paths (common.AVX2_ENV) on this machine's
memory. Run it alone.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode_share import PROMPT, parse_dtypes, single_stream, streamed_bytes  # noqa: E402
from common import add_level_arguments, isa_label, machine_info, positive, run_as, save  # noqa: E402
from roofline import footprint_mib, read_gbps  # noqa: E402

import ext  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402



def stage_bytes(model) -> dict[str, int]:
    """What each streaming stage reads a step: the layers' panels of each projection, the pick's copy."""
    head = model.lm_head
    sums = {name: sum(layer[i].nbytes for layer in model.decode)
            for name, i in (("qkv", 3), ("o", 5), ("gate_up", 6), ("down", 7))}
    return sums | {"pick": (head.pick if head.pick is not None else head.panels).nbytes}


def run(llm: LLM, tokens: int, probe_mib: int) -> dict:
    """One timed run: the stages' microseconds summed over its steps, its wall time, the probes around it."""
    before = read_gbps(probe_mib, repeats=3)
    torch.ops.vkv.decode_stage_times(True)  # (cleared)
    torch.ops.vkv.time_decode_stages(True)
    start = time.perf_counter()
    try:
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    finally:
        wall = time.perf_counter() - start
        torch.ops.vkv.time_decode_stages(False)
    stages = dict(torch.ops.vkv.decode_stage_times(True))
    stages.pop("steps in one region")
    return {"wall_s": wall, "steps": stages.pop("steps"), "stage_us": stages, "probe_before_gbps": before,
            "probe_after_gbps": read_gbps(probe_mib, repeats=3)}


def summary(runs: list[dict], nbytes: dict[str, int], streamed: int, tokens: int) -> dict:
    """Medians over the runs: ms a step for each stage and `other`, GB/s of the streaming ones, the step's share."""
    def median(f):
        return statistics.median(f(r) for r in runs)

    names = list(runs[0]["stage_us"])
    ms = {n: median(lambda r, n=n: r["stage_us"][n] / r["steps"] / 1e3) for n in names}
    wall_ms = median(lambda r: r["wall_s"] / tokens * 1e3)
    ms["other"] = median(lambda r: (r["wall_s"] * 1e6 - sum(r["stage_us"].values())) / tokens / 1e3)
    probe = median(lambda r: (r["probe_before_gbps"] + r["probe_after_gbps"]) / 2)
    return {"ms_per_step": ms, "wall_ms_per_token": wall_ms,
            "share_of_step": {n: v / wall_ms for n, v in ms.items()},
            "stage_gbps": {n: b / (ms[n] / 1e3) / 1e9 for n, b in nbytes.items()},
            "probe_gbps": probe, "streamed_gbps": streamed / (wall_ms / 1e3) / 1e9,
            "share_of_bound": streamed / (wall_ms / 1e3) / 1e9 / probe}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    p.add_argument("--repeats", type=positive, default=5, help="timed runs per dtype (medians)")
    p.add_argument("--tokens", type=positive, default=256, help="tokens each run decodes")
    p.add_argument("--num-scheduler-steps", type=positive, default=8)
    p.add_argument("--probe-mib", type=positive, default=None,
                   help="the probe's size (default: as many MiB as a step streams, roofline.footprint_mib)")
    add_level_arguments(p)
    args = p.parse_args(argv)
    dtypes = parse_dtypes(p, args.dtypes)
    run_as(args.isa, __file__, argv)
    rows = []
    for dtype in dtypes:
        with single_stream(dtype, args.num_scheduler_steps) as llm:
            model = llm.engine.model
            probe_mib = args.probe_mib or footprint_mib(streamed_bytes(model))
            run(llm, args.tokens, probe_mib)  # first-call costs, not kept
            runs = []
            for i in range(args.repeats):
                runs.append(run(llm, args.tokens, probe_mib))
                print(f"[bench] {dtype} {i + 1}/{args.repeats}: {args.tokens / runs[-1]['wall_s']:.1f} tok/s", flush=True)
            nbytes, streamed = stage_bytes(model), streamed_bytes(model)
            row = {"dtype": dtype, "bytes_per_token": streamed, "probe_mib": probe_mib, "stage_bytes": nbytes,
                   "gemm_path": model.gemm_path,
                   **summary(runs, nbytes, streamed, args.tokens), "runs": runs}
        rows.append(row)
        print(f"{dtype}: {row['wall_ms_per_token']:.2f} ms a token, {row['share_of_bound'] * 100:.1f}% of the read "
              f"bound (probe {row['probe_gbps']:.1f} GB/s)", flush=True)
        for name, value in sorted(row["ms_per_step"].items(), key=lambda kv: -kv[1]):
            rate = f", {row['stage_gbps'][name]:.1f} GB/s" if name in row["stage_gbps"] else ""
            print(f"    {name:18s} {value:7.3f} ms  {row['share_of_step'][name] * 100:5.1f}%{rate}", flush=True)
    result = {"benchmark": "decode_stages", "machine": machine_info(),
              "command": "python benchmarks/bench_decode_stages.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "kernel_isa": ext.kernel_isa()[0], "threads": torch.get_num_threads(), "isa": isa_label(args.isa),
              "num_scheduler_steps": args.num_scheduler_steps, "tokens": args.tokens, "rows": rows}
    save(result, args.json, args.plot, plot)
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 1.8 + 0.7 * len(result["rows"])))
    names = list(result["rows"][0]["ms_per_step"])
    for y, row in enumerate(result["rows"]):
        left = 0.0
        for i, name in enumerate(names):
            width = row["ms_per_step"][name]
            ax.barh(y, width, left=left, color=plt.cm.tab20(i), edgecolor="white", label=name if y == 0 else None)
            left += width
    ax.set_yticks(range(len(result["rows"])), [r["dtype"] for r in result["rows"]])
    ax.set_xlabel("ms a decode step (a token)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    m = result["machine"]
    ax.set_title(f"vkv single-stream decode, stage by stage, kernels {result['kernel_isa']}, {result['threads']} "
                 f"threads\n{m.get('cpu_model', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
