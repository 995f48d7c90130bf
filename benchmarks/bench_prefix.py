"""Prefix sharing: one long system prompt, many short questions; n parallel samples of one prompt.

The system prompt is a ~1,000-token ShareGPT prompt; the questions are short ShareGPT prompts.
For each KV layout, with automatic prefix caching off and on (fresh engine each, greedy, the
outputs must be identical):
  batch       all questions arrive at once: KV pages mapped at peak (bytes), time to first
              token, wall time
  one by one  each question arrives when the previous one is done, after one request has
              warmed the cache: time to first token (prefill of ~1,000 tokens vs a few dozen)
Parallel sampling: one request with n samples (they fork from the prompt's pages) against n
independent requests of the same prompt (prefix caching off in both): pages at peak.

    python benchmarks/bench_prefix.py --json benchmarks/results/cpu/prefix.json \
        --plot benchmarks/results/cpu/prefix.png
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from itertools import count

import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, save  # noqa: E402
from sharegpt import load_conversations  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402

_ids = count()


def make_workload(tokenizer, system_tokens: int, num_questions: int, max_question: int, seed: int):
    """A system prompt of system_tokens tokens cut from a long ShareGPT prompt, and short ones."""
    prompts = [p for p, _ in load_conversations()]
    rng = np.random.default_rng(seed)
    long_ids = next(ids for ids in (tokenizer.encode(p, add_special_tokens=False) for p in prompts)
                    if len(ids) >= system_tokens)
    system = long_ids[:system_tokens]
    short = [ids for ids in (tokenizer.encode(p, add_special_tokens=False) for p in prompts[:2000])
             if 4 <= len(ids) <= max_question]
    questions = [short[i] for i in rng.choice(len(short), num_questions, replace=False)]
    return system, [system + q for q in questions]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[float], list[list[int]]]:
    """Submit prompts together; (time to first token of each, output tokens of each)."""
    engine, start = llm.engine, time.perf_counter()
    ids = [f"q{next(_ids)}" for _ in prompts]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    ttft, outputs = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id not in ttft and out.outputs[0].token_ids:
                ttft[out.request_id] = time.perf_counter() - start
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return [ttft[i] for i in ids], [outputs[i] for i in ids]


def summary(seconds: list[float]) -> dict:
    ms = np.array(seconds) * 1e3
    return {"mean_ms": float(ms.mean()), "median_ms": float(np.median(ms)), "p99_ms": float(np.percentile(ms, 99))}


def shared_prompt(layout: str, caching: bool, prompts, params, kv_memory: int) -> dict:
    llm = LLM(kv_layout=layout, enable_prefix_caching=caching, max_num_seqs=len(prompts),
              kv_cache_memory=kv_memory, max_num_batched_tokens=2048)
    start = time.perf_counter()
    batch_ttft, batch_out = run(llm, prompts, params)
    batch_s = time.perf_counter() - start
    batch_stats = llm.stats()
    llm.engine.close()
    llm = LLM(kv_layout=layout, enable_prefix_caching=caching, kv_cache_memory=kv_memory,
              max_num_batched_tokens=2048)
    run(llm, prompts[:1], params)  # the first request: warms the cache when caching is on
    serial = [run(llm, [p], params) for p in prompts[1:]]
    llm.engine.close()
    return {"layout": layout, "prefix_caching": caching, "batch_wall_s": batch_s,
            "batch_peak_pages": batch_stats.kv.peak_pages_mapped, "page_size": batch_stats.kv.page_size,
            "batch_peak_mib": batch_stats.kv.peak_pages_mapped * batch_stats.kv.page_size / 2**20,
            "batch_ttft": summary(batch_ttft), "serial_ttft": summary([t[0] for t, _ in serial]),
            "prefix_cache_hits": batch_stats.kv.prefix_cache_hits,
            "prefix_cache_queries": batch_stats.kv.prefix_cache_queries, "cow_copies": batch_stats.kv.cow_copies,
            "preemptions": batch_stats.preemptions,
            "outputs": batch_out + [o[0] for _, o in serial]}


def parallel_sampling(layout: str, prompt: list[int], n: int, max_tokens: int, kv_memory: int) -> dict:
    result = {"layout": layout, "n": n}
    for shared in (True, False):
        llm = LLM(kv_layout=layout, enable_prefix_caching=False, max_num_seqs=n, kv_cache_memory=kv_memory)
        if shared:
            run(llm, [prompt], SamplingParams(n=n, temperature=0.8, seed=0, max_tokens=max_tokens, ignore_eos=True))
        else:
            run(llm, [prompt] * n, SamplingParams(temperature=0.8, seed=0, max_tokens=max_tokens, ignore_eos=True))
        stats = llm.stats()
        key = "shared" if shared else "independent"
        result[f"{key}_peak_pages"] = stats.kv.peak_pages_mapped
        result[f"{key}_peak_mib"] = stats.kv.peak_pages_mapped * stats.kv.page_size / 2**20
        result["cow_copies" if shared else "page_size"] = stats.kv.cow_copies if shared else stats.kv.page_size
        llm.engine.close()
    result["peak_ratio"] = result["shared_peak_pages"] / result["independent_peak_pages"]
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, sampling = result["shared_prompt"], result["parallel_sampling"]
    layouts = list(dict.fromkeys(r["layout"] for r in runs))
    pick = {(r["layout"], r["prefix_caching"]): r for r in runs}
    x, w = np.arange(len(layouts)), 0.38
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = [(axes[0], lambda r: r["batch_peak_mib"], "KV mapped at peak, MiB (batch)"),
              (axes[1], lambda r: r["serial_ttft"]["median_ms"], "TTFT median, ms (one by one)")]
    for ax, value, title in panels:
        for i, caching in enumerate((False, True)):
            ax.bar(x + (i - 0.5) * w, [value(pick[(layout, caching)]) for layout in layouts], w,
                   label=f"prefix caching {'on' if caching else 'off'}")
        ax.set_xticks(x, layouts)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    ax = axes[2]
    ax.bar(x - w / 2, [s["independent_peak_mib"] for s in sampling], w, label=f"{sampling[0]['n']} independent")
    ax.bar(x + w / 2, [s["shared_peak_mib"] for s in sampling], w, label=f"n={sampling[0]['n']} (forks share)")
    ax.set_xticks(x, layouts)
    ax.set_title("parallel sampling: KV mapped at peak, MiB", fontsize=10)
    ax.legend(fontsize=8)
    fig.suptitle(f"{result['system_prompt_tokens']}-token system prompt + {result['num_questions']} short "
                 f"questions, {result['model']}, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--num-questions", type=int, default=16)
    parser.add_argument("--max-question-tokens", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="parallel samples")
    parser.add_argument("--kv-layouts", default="interleaved,per_layer,paged")
    parser.add_argument("--kv-memory-mib", type=int, default=1536)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    args = parser.parse_args()

    from engine.models import load_tokenizer
    system, prompts = make_workload(load_tokenizer(None), args.system_tokens, args.num_questions,
                                    args.max_question_tokens, args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    kv_memory, layouts = args.kv_memory_mib << 20, args.kv_layouts.split(",")
    runs = [shared_prompt(layout, caching, prompts, params, kv_memory)
            for layout in tqdm(layouts, desc="shared system prompt") for caching in (False, True)]
    sampling = [parallel_sampling(layout, prompts[0], args.n, 4 * args.max_tokens, kv_memory)
                for layout in tqdm(layouts, desc="parallel sampling")]
    identical = all(r["outputs"] == runs[0]["outputs"] for r in runs)
    for r in runs:
        del r["outputs"]
    result = {"benchmark": "prefix_sharing", "command": " ".join(["python"] + sys.argv),
              "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32)", "system_prompt_tokens": len(system),
              "num_questions": len(prompts), "question_tokens_mean": float(np.mean([len(p) - len(system) for p in prompts])),
              "max_tokens": args.max_tokens, "kv_memory_bytes": kv_memory, "outputs_identical": identical,
              "machine": machine_info(), "shared_prompt": runs, "parallel_sampling": sampling}
    print(f"\n{'layout':<12}{'caching':>8}{'peak MiB':>10}{'batch s':>9}{'TTFT batch':>11}{'TTFT 1by1':>10}")
    for r in runs:
        print(f"{r['layout']:<12}{'on' if r['prefix_caching'] else 'off':>8}{r['batch_peak_mib']:>10.1f}"
              f"{r['batch_wall_s']:>9.2f}{r['batch_ttft']['median_ms']:>9.0f}ms{r['serial_ttft']['median_ms']:>8.0f}ms")
    for s in sampling:
        print(f"{s['layout']:<12} n={s['n']}: shared {s['shared_peak_mib']:.1f} MiB, independent "
              f"{s['independent_peak_mib']:.1f} MiB ({100 * s['peak_ratio']:.0f}%)")
    print(f"outputs identical with and without caching, every layout: {identical}")
    save(result, args.json_path, args.plot_path, plot)
    if not identical:
        sys.exit("outputs differ between runs")


if __name__ == "__main__":
    main()
