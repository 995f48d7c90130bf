"""Resuming a preempted sequence: by swap (its KV copied out and back at the same virtual
addresses) against by recompute (its prompt and output prefilled again), across prompt lengths.

For each length one request (random prompt tokens, prefix caching off, so recompute is real)
decodes two tokens, is preempted by hand, and the engine steps until its next token: that step
is the resume time. Swap-out time is measured apart. The next 6 tokens are checked identical
to an unpreempted run. Every measurement is the median of --repeats.

    python benchmarks/bench_swap.py --json benchmarks/results/cpu/swap.json --plot benchmarks/results/cpu/swap.png
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

from engine import LLM, SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def resume_once(llm: LLM, prompt: list[int], mode: str) -> dict:
    engine = llm.engine
    engine.scheduler.preemption_mode = mode
    engine.scheduler.swap_min_tokens = 1
    engine.add_request("r", prompt, PARAMS)
    seq = engine.scheduler.queues.waiting[0]
    while seq.num_output_tokens < 2:
        engine.step()
    start = time.perf_counter()
    engine.scheduler.preempt(seq)
    swap_out = time.perf_counter() - start
    assert (mode == "swap") == (seq in engine.scheduler.queues.swapped), mode
    before = seq.num_output_tokens
    start = time.perf_counter()
    while seq.num_output_tokens == before:
        engine.step()
    resume = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return {"swap_out_s": swap_out if mode == "swap" else 0.0, "resume_s": resume, "tokens": seq.output_token_ids}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lengths", default="16,32,64,128,256,512,1024,1536")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    args = parser.parse_args(argv)
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, preemption_mode="swap",
                          enable_prefix_caching=False, max_num_batched_tokens=4096)
    llm = LLM.from_config(config)
    vocab = llm.engine.model_config.vocab_size
    rows = []
    for length in map(int, args.lengths.split(",")):
        prompt = torch.randint(100, vocab, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        want = llm.generate([prompt], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        runs = {"swap": [], "recompute": []}
        for repeat in range(args.repeats):
            for mode in (("swap", "recompute") if repeat % 2 == 0 else ("recompute", "swap")):
                run = resume_once(llm, prompt, mode)
                assert run["tokens"] == want, (length, mode)
                runs[mode].append(run)
        med = lambda mode, key: statistics.median(r[key] for r in runs[mode])
        row = {"prompt_tokens": length, "kv_bytes": (length + 2) * llm.engine.kv.layout.token_bytes,
               "swap_out_s": med("swap", "swap_out_s"), "resume_swap_s": med("swap", "resume_s"),
               "resume_recompute_s": med("recompute", "resume_s"), "tokens_identical": True}
        rows.append(row)
        print(f"{length:>6} tokens  swap-out {row['swap_out_s'] * 1e3:7.2f} ms  resume: swap "
              f"{row['resume_swap_s'] * 1e3:7.1f} ms, recompute {row['resume_recompute_s'] * 1e3:7.1f} ms", flush=True)
    stats = llm.stats().kv
    result = {"benchmark": "swap", "model": config.model or "SmolLM2-135M-Instruct (bundled)", "dtype": args.dtype,
              "layout": config.kv_layout, "page_size": stats.page_size, "repeats": args.repeats,
              "command": "python benchmarks/bench_swap.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine_info(), "rows": rows}
    llm.engine.close()
    save(result, args.json_path, args.plot_path, plot)
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    xs = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r["resume_recompute_s"] * 1e3 for r in rows], "o-", label="resume by recompute (prefill)")
    ax.plot(xs, [r["resume_swap_s"] * 1e3 for r in rows], "o-", label="resume by swap (copy in + decode step)")
    ax.plot(xs, [r["swap_out_s"] * 1e3 for r in rows], "x--", label="swap out (copy out + unmap)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    m = result["machine"]
    ax.set_title(f"Preemption: swap vs recompute, {result['dtype']}, {result['layout']}, "
                 f"{m['processor']} ({m['cpu_count']} CPUs)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
