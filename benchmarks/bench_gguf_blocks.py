"""A GGUF served in its blocks (quantization="gguf") against the same file dequantized (the
default): resident memory, single-stream decode, and how far the two score one text apart.

    python benchmarks/bench_gguf_blocks.py --repeats 3 --json benchmarks/results/cpu/gguf_blocks.json --plot benchmarks/results/cpu/gguf_blocks.png

Each configuration runs in a process of its own, alternating, `--repeats` times: the process's
resident memory (VmRSS) once the engine is built, minus the same process's before the engine
(Python, torch and the engine's modules), and the decode rate of one greedy stream of
`--tokens` tokens after a 4-token prompt (wall time of `generate`, prefill included). Defaults
otherwise (fp32, one step a native call, prefix caching on). The model is the bundled
SmolLM2-135M-Instruct Q4_1 GGUF unless --model names another .gguf file.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, save  # noqa: E402

TEXT = "The capital of France is Paris. It is known for the Eiffel Tower and"


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def child(model: str | None, quantization: str | None, tokens: int) -> dict:
    from engine import LLM, SamplingParams
    before = rss_mib()
    llm = LLM(model=model, quantization=quantization, kv_cache_memory=32 << 20, max_model_len=512)
    built = rss_mib()
    llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))  # warm
    start = time.perf_counter()
    out = llm.generate([[1, 504, 3458, 314]], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    seconds = time.perf_counter() - start
    scored = llm.generate([TEXT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    logprobs = [lp[t].logprob for t, lp in zip(scored.prompt_token_ids[1:], scored.prompt_logprobs[1:])]
    return {"weights_and_engine_mib": built - before, "decode_tok_per_s": len(out[0].outputs[0].token_ids) / seconds,
            "gemm": llm.stats().platform["gemm"], "logprobs": logprobs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: the bundled model)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--plot")
    p.add_argument("--child", choices=["gguf", "plain"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.model, "gguf" if args.child == "gguf" else None, args.tokens)))
        return
    runs = {"gguf": [], "plain": []}
    for _ in range(args.repeats):
        for kind in runs:
            argv = [sys.executable, __file__, "--child", kind, "--tokens", str(args.tokens)]
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
    a, b = runs["gguf"][0]["logprobs"], runs["plain"][0]["logprobs"]
    from engine.models.loader import bundled_gguf
    path = args.model or str(bundled_gguf())
    result = {"benchmark": "gguf_blocks", "machine": machine_info(), "command": " ".join(["python"] + sys.argv),
              "model": os.path.basename(path), "file_mib": os.path.getsize(path) / 2 ** 20,
              "settings": {"tokens": args.tokens, "repeats": args.repeats, "dtype": "float32",
                           "note": "defaults otherwise; each configuration in its own process, alternating"},
              "summary": summary,
              "memory_ratio_plain_over_gguf": summary["plain"]["weights_and_engine_mib"]
              / summary["gguf"]["weights_and_engine_mib"],
              "decode_ratio_gguf_over_plain": summary["gguf"]["decode_tok_per_s"] / summary["plain"]["decode_tok_per_s"],
              "max_logprob_difference": max(abs(x - y) for x, y in zip(a, b)),
              "runs": {k: [{kk: vv for kk, vv in r.items() if kk != "logprobs"} for r in rs] for k, rs in runs.items()}}
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "runs")}, indent=1))
    save(result, args.json, args.plot, plot)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = result["summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = ["GGUF blocks", "dequantized (fp32)"]
    left.bar(names, [s["gguf"]["weights_and_engine_mib"], s["plain"]["weights_and_engine_mib"]], color=["C0", "C1"])
    left.axhline(result["file_mib"], color="k", ls="--", lw=1, label="the file")
    left.set_ylabel("MiB resident (engine built)")
    left.legend()
    right.bar(names, [s["gguf"]["decode_tok_per_s"], s["plain"]["decode_tok_per_s"]], color=["C0", "C1"])
    right.set_ylabel("decode tok/s (single stream)")
    fig.suptitle(f"{result['model']}, {result['machine'].get('cpu_model', '')}, median of {result['settings']['repeats']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
