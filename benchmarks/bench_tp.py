"""Tensor parallelism on this CPU: the same ShareGPT requests with 1 rank and with N ranks
(processes over gloo, sharing the machine's cores), batch and single stream; greedy tokens
checked identical. Repeats alternate; medians count.

    python benchmarks/bench_tp.py --json benchmarks/results/cpu/tp.json --plot benchmarks/results/cpu/tp.png
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, save  # noqa: E402
from sharegpt import sample_requests  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def run_once(tp: int, args, prompts, params) -> dict:
    start = time.perf_counter()
    llm = LLM(model=args.model, device="cpu", dtype=args.dtype, tensor_parallel_size=tp)
    startup = time.perf_counter() - start
    try:
        result = {"startup_s": startup}
        for mode, batch in (("batch", prompts), ("single", prompts[:args.single])):
            start = time.perf_counter()
            if mode == "batch":
                outs = llm.generate(batch, params[:len(batch)], use_tqdm=False)
            else:  # one request at a time
                outs = [llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(batch, params)]
            elapsed = time.perf_counter() - start
            toks = [o.outputs[0].token_ids for o in outs]
            result[mode] = {"elapsed_s": elapsed, "output_tokens_per_s": sum(map(len, toks)) / elapsed, "tokens": toks}
        return result
    finally:
        llm.engine.close()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tp", type=int, default=3, help="ranks to compare with 1 (must divide the heads)")
    parser.add_argument("--num", type=int, default=16)
    parser.add_argument("--single", type=int, default=4, help="requests run one at a time")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    args = parser.parse_args(argv)
    tokenizer = LLM(model=args.model, device="cpu", dtype=args.dtype, kv_cache_memory=1 << 20).tokenizer
    requests = sample_requests(tokenizer, args.num, 0, max_output=args.max_tokens)
    prompts = [r.prompt_ids for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    runs = {1: [], args.tp: []}
    for repeat in range(args.repeats):
        for tp in (list(runs) if repeat % 2 == 0 else list(runs)[::-1]):
            runs[tp].append(run_once(tp, args, prompts, params))
    for mode in ("batch", "single"):
        assert runs[args.tp][0][mode]["tokens"] == runs[1][0][mode]["tokens"], mode
    rows = []
    for tp, mine in runs.items():
        med = lambda mode: statistics.median(r[mode]["output_tokens_per_s"] for r in mine)
        rows.append({"tensor_parallel_size": tp, "batch_output_tokens_per_s": med("batch"),
                     "single_output_tokens_per_s": med("single"),
                     "startup_s": statistics.median(r["startup_s"] for r in mine)})
        print(f"tp={tp}: batch {rows[-1]['batch_output_tokens_per_s']:.1f} tok/s, single "
              f"{rows[-1]['single_output_tokens_per_s']:.1f} tok/s, startup {rows[-1]['startup_s']:.1f} s", flush=True)
    result = {"benchmark": "tensor_parallel", "model": args.model or "SmolLM2-135M-Instruct (bundled)",
              "dtype": args.dtype, "requests": args.num, "single_requests": args.single, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "tokens_identical": True, "machine": machine_info(), "rows": rows,
              "command": "python benchmarks/bench_tp.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    save(result, args.json_path, args.plot_path, plot)
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    labels = [f"TP={r['tensor_parallel_size']}" for r in rows]
    for i, (key, name) in enumerate((("batch_output_tokens_per_s", "batch"), ("single_output_tokens_per_s", "single"))):
        ax.bar([j + (i - 0.5) * 0.38 for j in range(len(rows))], [r[key] for r in rows], 0.38, label=name)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("output tokens/s")
    ax.legend(fontsize=8)
    m = result["machine"]
    ax.set_title(f"Tensor parallelism on {m['cpu_count']} CPUs, {result['dtype']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
