"""A GGUF served in its blocks (quantization="gguf") against the same file dequantized (the
default): resident memory, single-stream decode, and held-out perplexity.

    python benchmarks/bench_gguf_blocks.py --repeats 3 --json benchmarks/results/cpu/gguf_blocks.json --plot benchmarks/results/cpu/gguf_blocks.png

Configurations: "gguf" (blocks; x quantized to int8 blocks and summed in integers for Q8_0 / Q4_0
/ Q4_1 weights, as llama.cpp computes), "gguf-fp32-x" (blocks, x kept in fp32: every weight as
the format defines it, each product in fp32; not an option of the engine, the benchmark sets
GgufWeight.quantizes_x; such a model decodes layer by layer, as decode_layers takes int8-x blocks
only), and "plain" (the file dequantized to fp32, the default). Each runs in a
process of its own, alternating, `--repeats` times: the process's resident memory (VmRSS) once
the engine is built, minus the same process's before the engine (Python, torch and the engine's
modules), and the decode rate of one greedy stream of `--tokens` tokens after a 4-token prompt
(wall time of `generate`, prefill included). Perplexity (once per configuration: it is
deterministic) over `--texts` held-out texts: first replies of ShareGPT conversations from the
dataset's end, up to 511 tokens each (prompt_logprobs, every token after the first). Defaults
otherwise (fp32, prefix caching on). The model is the bundled SmolLM2-135M-Instruct Q4_1 GGUF
unless --model names another .gguf file; `--configs gguf` runs the blocks alone (a model too large
to hold dequantized), and `memory_gguf_over_file` is its resident memory over the file's size.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, save  # noqa: E402

CONFIGS = {"gguf": ("gguf", True), "gguf-fp32-x": ("gguf", False), "plain": ("dequantize", None)}


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def held_out(tokenizer, count: int) -> list[list[int]]:
    from sharegpt import load_conversations
    replies = [tokenizer.encode(reply)[:511] for _, reply in load_conversations()[-4 * count:]]
    return [r for r in replies if len(r) >= 64][:count]


def child(model: str | None, config: str, tokens: int, texts: int) -> dict:
    from engine import LLM, SamplingParams
    from engine.models.gguf_weights import GgufWeight
    quantization, quantizes_x = CONFIGS[config]
    if quantizes_x is False:  # every weight as the format defines it, x in fp32
        GgufWeight.quantizes_x = property(lambda self: False)
    before = rss_mib()
    llm = LLM(model=model, quantization=quantization, kv_cache_memory=32 << 20, max_model_len=512)
    built = rss_mib()
    llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))  # warm
    start = time.perf_counter()
    out = llm.generate([[1, 504, 3458, 314]], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    seconds = time.perf_counter() - start
    row = {"weights_and_engine_mib": built - before, "decode_tok_per_s": len(out[0].outputs[0].token_ids) / seconds,
           "gemm": llm.stats().platform["gemm"]}
    if texts:
        scored = llm.generate(held_out(llm.tokenizer, texts), SamplingParams(max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)
        logprobs = [r[t].logprob for o in scored for t, r in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]
        row |= {"perplexity": math.exp(-sum(logprobs) / len(logprobs)), "scored_tokens": len(logprobs)}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: the bundled model)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--plot")
    p.add_argument("--texts", type=int, default=16, help="held-out texts for perplexity")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="which of gguf, gguf-fp32-x, plain (an 8B model dequantized to fp32 needs 32 GB)")
    p.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = p.parse_args()
    configs = args.configs.split(",")
    if not configs or set(configs) - set(CONFIGS):
        p.error(f"--configs takes a comma-separated list of {', '.join(CONFIGS)}")
    if args.child:
        print(json.dumps(child(args.model, args.child, args.tokens, args.texts)))
        return
    runs = {kind: [] for kind in CONFIGS if kind in configs}
    for repeat in range(args.repeats):
        for kind in runs:
            argv = [sys.executable, __file__, "--child", kind, "--tokens", str(args.tokens),
                    "--texts", str(args.texts if repeat == 0 else 0)]
            if args.model:
                argv += ["--model", args.model]
            done = subprocess.run(argv, capture_output=True, text=True, check=True)
            runs[kind].append(json.loads(done.stdout.strip().splitlines()[-1]))
    summary = {}
    for kind, rs in runs.items():
        summary[kind] = {"weights_and_engine_mib": statistics.median(r["weights_and_engine_mib"] for r in rs),
                         "decode_tok_per_s": statistics.median(r["decode_tok_per_s"] for r in rs),
                         "decode_tok_per_s_range": [min(r["decode_tok_per_s"] for r in rs),
                                                    max(r["decode_tok_per_s"] for r in rs)],
                         "gemm": rs[0]["gemm"]}
        if "perplexity" in rs[0]:
            summary[kind] |= {"perplexity": rs[0]["perplexity"], "scored_tokens": rs[0]["scored_tokens"]}
    from engine.models.loader import bundled_gguf
    path = args.model or str(bundled_gguf())
    ppl = {kind: summary.get(kind, {}).get("perplexity") for kind in CONFIGS}

    def ratio(a, b, field):  # None where either configuration did not run
        return summary[a][field] / summary[b][field] if a in summary and b in summary else None
    result = {"benchmark": "gguf_blocks", "machine": machine_info(), "command": " ".join(["python"] + sys.argv),
              "model": os.path.basename(path), "file_mib": os.path.getsize(path) / 2 ** 20,
              "settings": {"tokens": args.tokens, "repeats": args.repeats, "dtype": "float32", "texts": args.texts,
                           "note": "defaults otherwise; each configuration in its own process, alternating; "
                                   "gguf-fp32-x is not an engine option (the benchmark sets it)"},
              "summary": summary,
              "memory_ratio_plain_over_gguf": ratio("plain", "gguf", "weights_and_engine_mib"),
              "memory_gguf_over_file": (summary["gguf"]["weights_and_engine_mib"] / (os.path.getsize(path) / 2 ** 20)
                                        if "gguf" in summary else None),
              "decode_ratio_gguf_over_plain": ratio("gguf", "plain", "decode_tok_per_s"),
              "decode_ratio_gguf_over_fp32_x": ratio("gguf", "gguf-fp32-x", "decode_tok_per_s"),
              "perplexity_ratio_gguf_over_plain": ppl["gguf"] / ppl["plain"] if args.texts and ppl["plain"] else None,
              "perplexity_ratio_fp32_x_over_plain": (ppl["gguf-fp32-x"] / ppl["plain"]
                                                     if args.texts and ppl["plain"] and ppl["gguf-fp32-x"] else None),
              "runs": runs}
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "runs")}, indent=1))
    save(result, args.json, args.plot, plot)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = result["summary"]
    kinds = list(s)
    names = {"gguf": "GGUF blocks\n(int8 x)", "gguf-fp32-x": "GGUF blocks\n(fp32 x)", "plain": "dequantized\n(fp32)"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = [{"gguf": "C0", "gguf-fp32-x": "C2", "plain": "C1"}[k] for k in kinds]
    left.bar([names[k] for k in kinds], [s[k]["weights_and_engine_mib"] for k in kinds], color=colors)
    left.axhline(result["file_mib"], color="k", ls="--", lw=1, label="the file")
    left.set_ylabel("MiB resident (engine built)")
    left.legend()
    rates = [s[k]["decode_tok_per_s"] for k in kinds]
    spread = [[r - s[k]["decode_tok_per_s_range"][0] for r, k in zip(rates, kinds)],
              [s[k]["decode_tok_per_s_range"][1] - r for r, k in zip(rates, kinds)]]
    right.bar([names[k] for k in kinds], rates, yerr=spread, capsize=4, color=colors)
    for i, k in enumerate(kinds):
        if s[k].get("perplexity"):
            right.text(i, rates[i] / 2, f"ppl {s[k]['perplexity']:.3f}", ha="center", color="white")
    right.set_ylabel("decode tok/s (single stream)")
    fig.suptitle(f"{result['model']}, {result['machine'].get('cpu_model', '')}, median of {result['settings']['repeats']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
