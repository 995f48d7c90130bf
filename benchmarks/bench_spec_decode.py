"""Speculative decoding with n-gram proposals: speedup over plain decoding, same model, same
requests, greedy tokens checked identical, one run.

Two workloads:
  rewrite   edits whose answer repeats the prompt: "rename a variable in this function" over
            Python standard-library functions, and "fix the spelling of this passage" over
            ShareGPT prompts; n-grams of the output occur in the prompt
  sharegpt  ShareGPT requests as in bench_throughput (each asks for its reply length, EOS
            ignored); little of the output repeats
Two modes: single stream (max_num_seqs=1, requests one after another) and batch (all at once).
Every configuration runs --repeats times, alternating, and the median time counts.

    python benchmarks/bench_spec_decode.py \
        --json benchmarks/results/cpu/spec_decode.json --plot benchmarks/results/cpu/spec_decode.png
"""
from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, save  # noqa: E402
from sharegpt import load_conversations, sample_requests  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.request.inputs import chat_prompt  # noqa: E402


def rewrite_prompts(tokenizer, num: int) -> list[list[int]]:
    """Half code edits over standard-library functions, half spelling fixes of ShareGPT prompts."""
    import difflib
    import json
    import shlex
    import string
    import textwrap

    functions = [textwrap.dedent, textwrap.indent, shlex.quote, shlex.join, string.capwords,
                 json.dumps, difflib.get_close_matches, textwrap.shorten]
    tasks = [f"Rename the first argument of this function to `value` everywhere and return the whole "
             f"function.\n\n```python\n{inspect.getsource(fn)}```" for fn in functions]
    passages = [p for p, _ in load_conversations() if 400 <= len(p) <= 1200 and "```" not in p]
    tasks += [f"Rewrite the following passage, fixing any spelling or grammar mistakes. Keep everything "
              f"else unchanged.\n\n{p}" for p in passages[:len(functions)]]
    chosen = [t for pair in zip(tasks[:len(functions)], tasks[len(functions):]) for t in pair][:num]
    return [chat_prompt(tokenizer, [{"role": "user", "content": t}]).token_ids for t in chosen]


def workload(name: str, tokenizer, num: int, max_tokens: int, seed: int) -> tuple[list, list]:
    if name == "rewrite":
        prompts = rewrite_prompts(tokenizer, num)
        return prompts, [SamplingParams(temperature=0, max_tokens=max_tokens)] * len(prompts)
    requests = sample_requests(tokenizer, num, seed, max_output=max_tokens)
    return ([r.prompt_ids for r in requests],
            [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests])


def run_once(config: EngineConfig, loaded, prompts, params) -> dict:
    llm = LLM.from_config(config, loaded)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.stats()
    llm.engine.close()
    tokens = [o.outputs[0].token_ids for o in outs]
    return {"elapsed_s": elapsed, "tokens": tokens, "acceptance_rate": stats.spec_acceptance_rate,
            "mean_accepted_length": stats.spec_mean_accepted_length, "drafts": stats.spec_drafts,
            "draft_tokens": stats.spec_draft_tokens, "accepted_tokens": stats.spec_accepted_tokens,
            "map_seconds": stats.kv.map_seconds, "peak_pages_mapped": stats.kv.peak_pages_mapped}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["cells"]
    workloads = list(dict.fromkeys(c["workload"] for c in cells))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], workloads):
        mine = [c for c in cells if c["workload"] == name]
        modes = list(dict.fromkeys(c["mode"] for c in mine))
        labels = [r["config"] for r in mine[0]["runs"]]
        width = 0.8 / len(modes)
        for i, cell in enumerate(mine):
            xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(labels))]
            bars = ax.bar(xs, [r["speedup"] for r in cell["runs"]], width, label=cell["mode"])
            for bar, r in zip(bars, cell["runs"]):
                ax.annotate(f"{r['speedup']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_title(name)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("output tokens/s vs no speculation")
    m = result["machine"]
    fig.suptitle(f"n-gram speculative decoding, {result['model']}, {result['dtype']}, "
                 f"{m['processor']} ({m['cpu_count']} CPUs)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--workloads", default="rewrite,sharegpt")
    parser.add_argument("--k", default="2,4,8", help="num_speculative_tokens values to try")
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--single", type=int, default=8, help="requests in the single-stream mode")
    parser.add_argument("--batch", type=int, default=32, help="requests in the batch mode")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    args = parser.parse_args(argv)

    base = EngineConfig(model=args.model, device="cpu", dtype=args.dtype)
    from engine.core.llm_engine import LLMEngine
    first = LLMEngine(base)
    loaded = (first.model, first.tokenizer)
    first.close()
    # The k=... configs speculate at every batch size; "default" is what vkv ships
    # ({"method": "ngram"}: k=4, lookup 5..5, off from 8 running sequences).
    configs = {"off": None} | {f"k={k}": {"method": "ngram", "num_speculative_tokens": int(k),
                                          "prompt_lookup_max": args.prompt_lookup_max,
                                          "prompt_lookup_min": args.prompt_lookup_min,
                                          "disable_by_batch_size": None}
                               for k in args.k.split(",")} | {"default": {"method": "ngram"}}
    cells = []
    for name in args.workloads.split(","):
        for mode, num, max_num_seqs in (("single", args.single, 1), ("batch", args.batch, 32)):
            prompts, params = workload(name, loaded[1], num, args.max_tokens, args.seed)
            times = {label: [] for label in configs}
            last = {}
            for repeat in range(args.repeats):
                order = list(configs) if repeat % 2 == 0 else list(configs)[::-1]
                for label in order:
                    config = EngineConfig(model=args.model, device="cpu", dtype=args.dtype,
                                          max_num_seqs=max_num_seqs, speculative_config=configs[label])
                    last[label] = run_once(config, loaded, prompts, params)
                    times[label].append(last[label]["elapsed_s"])
                    print(f"{name:<9} {mode:<6} {label:<5} {last[label]['elapsed_s']:7.2f} s", flush=True)
            reference = last["off"]["tokens"]
            num_tokens = sum(len(t) for t in reference)
            runs = []
            for label in configs:
                r = last[label]
                elapsed = statistics.median(times[label])
                runs.append({"config": label, "speculative_config": configs[label], "elapsed_s": elapsed,
                             "all_elapsed_s": times[label], "output_tokens_per_s": num_tokens / elapsed,
                             "identical_greedy_tokens": r["tokens"] == reference,
                             **{k: v for k, v in r.items() if k not in ("tokens", "elapsed_s")}})
            for r in runs:
                r["speedup"] = runs[0]["elapsed_s"] / r["elapsed_s"]
                print(f"{name:<9} {mode:<6} {r['config']:<5} {r['output_tokens_per_s']:7.1f} tok/s "
                      f"{r['speedup']:5.2f}x  accepted {r['acceptance_rate']:.2f} "
                      f"mean length {r['mean_accepted_length']:.2f}  identical {r['identical_greedy_tokens']}")
            cells.append({"workload": name, "mode": mode, "num_requests": len(prompts),
                          "max_num_seqs": max_num_seqs, "output_tokens": num_tokens,
                          "prompt_tokens": sum(len(p) for p in prompts), "runs": runs})
    result = {"benchmark": "speculative_decoding",
              "command": "python benchmarks/bench_spec_decode.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "model": args.model or "SmolLM2-135M-Instruct (bundled)", "dtype": args.dtype,
              "repeats": args.repeats, "machine": machine_info(), "cells": cells}
    save(result, args.json_path, args.plot_path, plot)
    return result


if __name__ == "__main__":
    main()
