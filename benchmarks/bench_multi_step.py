"""Where several decode steps a native call (--num-scheduler-steps) win, and where they lose.

    python benchmarks/bench_multi_step.py --models bundled,<a .gguf> --repeats 3 \\
        --json benchmarks/results/cpu/multi_step.json --plot benchmarks/results/cpu/multi_step.png

For each model (a .gguf served at the default, in its blocks, or `bundled`; `--quantization
dequantize` widens them to --dtype), one engine per steps value, built once; then --repeats
rounds, each running every (steps, seqs) cell once in turn, so a slow minute of the machine falls
on every cell alike. A cell: seqs greedy requests of --tokens tokens after a short prompt (each
its own, prefix caching off), output tokens over the wall time, prefill included. Medians and
ranges of the rounds, and each cell's ratio of several steps over one. All threads. Run it alone.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, positive, save  # noqa: E402

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402

PROMPT = "The history of the city begins"


def run(models: list[str], steps: list[int], seqs: list[int], tokens: int, repeats: int, quantization: str | None,
        dtype: str) -> list[dict]:
    rows = []
    for model in models:
        spec = None if model == "bundled" else model
        engines = {s: LLM(model=spec, num_scheduler_steps=s, quantization=quantization, dtype=dtype,
                          enable_prefix_caching=False, kv_cache_memory=256 << 20, max_model_len=512) for s in steps}
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        for llm in engines.values():  # first-call costs, untimed
            llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)
        runs = {(s, n): [] for s in steps for n in seqs}
        for _ in range(repeats):
            for (s, n), rates in runs.items():
                began = time.perf_counter()
                engines[s].generate([f"{PROMPT} {i}" for i in range(n)], params, use_tqdm=False)
                rates.append(n * tokens / (time.perf_counter() - began))
        weights = engines[steps[0]].stats().platform.get("gemm", "")
        for llm in engines.values():
            llm.close()
        for (s, n), rates in runs.items():
            one = statistics.median(runs[(1, n)]) if (1, n) in runs else None
            rows.append({"model": model, "weights": weights, "steps": s, "seqs": n,
                         "median_tok_s": statistics.median(rates), "min_tok_s": min(rates), "max_tok_s": max(rates),
                         "runs_tok_s": rates, "over_one_step": statistics.median(rates) / one if one else None})
            print(f"[bench] {model} steps={s} seqs={n}: {rows[-1]['median_tok_s']:.1f} tok/s "
                  f"({min(rates):.1f}-{max(rates):.1f})" + (f", {rows[-1]['over_one_step']:.2f}x one step" if one else ""),
                  flush=True)
    return rows


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["rows"] if r["steps"] != 1]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    labels = [f"{os.path.basename(r['model'])[:28]}\n{r['seqs']} seq, {r['steps']} steps" for r in rows]
    ax.bar(labels, [r["over_one_step"] for r in rows])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("tok/s over one step a call")
    ax.set_title(f"multi-step decode, medians of {result['repeats']} rounds, {result['threads']} threads")
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bundled", help="comma-separated: 'bundled' or paths to .gguf files")
    parser.add_argument("--steps", default="1,8", help="comma-separated num_scheduler_steps values (1 first)")
    parser.add_argument("--seqs", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--tokens", type=positive, default=64)
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--quantization", default=None, choices=["gguf", "dequantize"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    steps, seqs = [int(s) for s in args.steps.split(",")], [int(n) for n in args.seqs.split(",")]
    rows = run(args.models.split(","), steps, seqs, args.tokens, args.repeats, args.quantization, args.dtype)
    result = {"benchmark": "multi_step", "command": " ".join(["python"] + sys.argv), "machine": machine_info(),
              "threads": torch.get_num_threads(), "tokens": args.tokens, "repeats": args.repeats,
              "quantization": args.quantization or "default", "dtype": args.dtype, "rows": rows}
    save(result, args.json, args.plot, plot)
    return result


if __name__ == "__main__":
    main()
