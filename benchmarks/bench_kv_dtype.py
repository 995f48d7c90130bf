"""What an 8-bit KV cache costs in accuracy and buys in capacity and speed, on the bundled model.

Formats: "auto" (the model's fp32: the reference), vLLM's fp8_e4m3 and fp8_e5m2 (unscaled), and
a simulated int8 with one scale per token and head (absmax / 127) -- simulated: K and V are
rounded to what such a cache would hold and kept in fp32, through the sdpa kernel, to decide
whether building that format would be worth it. It is not an option of the engine. Because it
runs on sdpa, "auto-sdpa" (the fp32 cache on sdpa) measures what the kernel change alone moves:
greedy tokens flip on near ties at fp32's last bit, so that is the floor of its agreement.

  accuracy    greedy agreement with the reference over ShareGPT prompts: the share of prompts
              whose first 32 and first 128 generated tokens are all the same, and the mean
              length of the agreeing start; and the perplexity of held-out text: the first
              replies of ShareGPT conversations not among the prompts, up to 512 tokens each
              (prompt_logprobs, every token after the first, one prefill per text)
  capacity    the most sequences running at once under a fixed KV budget (64 ShareGPT requests,
              64 seats, 4 KiB pages so that a page's granularity does not blur the count), and
              that run's output throughput
  speed       output throughput of the 32-request ShareGPT batch with the default budget

    python benchmarks/bench_kv_dtype.py --json benchmarks/results/cpu/kv_dtype.json \
        --plot benchmarks/results/cpu/kv_dtype.png
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, save  # noqa: E402
from sharegpt import load_conversations, sample_requests  # noqa: E402

import engine.attention  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.models import load_tokenizer  # noqa: E402

FORMATS = ("auto", "fp8_e4m3", "fp8_e5m2", "int8-simulated", "auto-sdpa")
SDPA = ("int8-simulated", "auto-sdpa")  # on the sdpa kernel over an fp32 cache: accuracy only


def int8_rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [tokens, heads, D] as an int8 cache with a scale per token and head would give it back."""
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return ((x / scale).round().clamp(-127, 127) * scale).to(dtype)


def engine_for(fmt: str, **options) -> LLM:
    if fmt in SDPA:
        return LLM(attention_backend="sdpa", **options)
    return LLM(kv_cache_dtype=fmt, **options)


class Simulated:
    """While active, the sdpa kernel stores K and V rounded as the int8 format would."""

    def __init__(self, fmt: str):
        self.on, self.saved = fmt == "int8-simulated", engine.attention.narrow

    def __enter__(self):
        if self.on:
            engine.attention.narrow = int8_rounded

    def __exit__(self, *exc):
        engine.attention.narrow = self.saved


def agreement(got: list[list[int]], want: list[list[int]]) -> dict:
    starts = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
    return {"same_first_32": sum(s >= 32 for s in starts) / len(starts),
            "same_first_128": sum(s >= 128 for s in starts) / len(starts),
            "mean_agreeing_tokens": sum(starts) / len(starts)}


def perplexity(llm: LLM, texts: list[list[int]]) -> float:
    outs = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    logprobs = [r.logprob for o in outs for r in o.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


def peak_concurrency(llm: LLM, requests, params) -> tuple[int, float, int]:
    """Run the requests by steps: the most running at once, output tokens/s, preemptions."""
    eng = llm.engine
    for i, (r, p) in enumerate(zip(requests, params)):
        eng.add_request(f"r{i}", r.prompt_ids, p)
    peak, tokens, start = 0, 0, time.perf_counter()
    while eng.has_unfinished():
        outs = eng.step()
        peak = max(peak, eng.stats().num_running)
        tokens += sum(len(c.token_ids) for o in outs if o.finished for c in o.outputs)
    return peak, tokens / (time.perf_counter() - start), eng.stats().preemptions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--texts", type=int, default=16, help="held-out replies for perplexity")
    ap.add_argument("--budget-mib", type=int, default=48, help="KV budget of the capacity run")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS, help="the first is the reference")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    tok = load_tokenizer(None)
    prompts = sample_requests(tok, args.prompts, seed=0, max_prompt=512)
    used = {r.prompt for r in prompts}
    texts = [tok.encode(reply)[:512] for prompt, reply in load_conversations()[-4 * args.texts:]
             if prompt not in used and len(tok.encode(reply)) >= 64][:args.texts]
    capacity_requests = sample_requests(tok, 64, seed=1, max_prompt=512, max_output=256)
    greedy = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    results, reference = {}, None
    for fmt in args.formats:
        print(f"[bench] {fmt}", flush=True)
        row = {}
        with Simulated(fmt):
            with engine_for(fmt, max_num_seqs=32) as llm:
                full, head_dim = llm.engine.kv.token_bytes, llm.engine.model_config.head_dim
                # int8 simulated: a byte per value and an fp32 scale per head (of head_dim values)
                row["kv_bytes_per_token"] = full // 4 + full // head_dim if fmt == "int8-simulated" else full
                start = time.perf_counter()
                outs = llm.generate([r.prompt_ids for r in prompts], greedy, use_tqdm=False)
                row["batch_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
                tokens = [o.outputs[0].token_ids for o in outs]
                reference = reference or tokens
                row.update(agreement(tokens, reference))
                row["perplexity"] = perplexity(llm, texts)
        if fmt not in SDPA:  # an fp32 cache on sdpa: nothing to measure
            params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
                      for r in capacity_requests]
            with engine_for(fmt, max_num_seqs=64, kv_cache_memory=args.budget_mib << 20, page_size=4096) as llm:
                row["peak_running"], row["capacity_tok_s"], row["capacity_preemptions"] = \
                    peak_concurrency(llm, capacity_requests, params)
        else:
            row["batch_tok_s"] = None  # the sdpa kernel over an fp32 cache: not a format's speed
        results[fmt] = row
        print(f"[bench] {fmt}: {row}", flush=True)
    result = {"benchmark": "kv_dtype", "command": "python " + " ".join(sys.argv), "machine": machine_info(),
              "model": "bundled SmolLM2-135M-Instruct: Q4_1 GGUF weights dequantized to fp32, fp32 arithmetic",
              "prompts": f"{args.prompts} ShareGPT prompts (seed 0, <= 512 tokens), 128 greedy tokens each",
              "held_out": f"{len(texts)} first replies of ShareGPT conversations from the dataset's end, "
                          f"not among the prompts, <= 512 tokens each ({sum(map(len, texts))} tokens)",
              "capacity_run": f"64 ShareGPT requests (seed 1, outputs <= 256), 64 seats, {args.budget_mib} MiB of KV "
                              "in 4 KiB pages",
              "results": results}
    save(result, args.json, args.plot, plot)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    r, names = result["results"], list(result["results"])
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    panels = [("same first 32 / 128 greedy tokens", ("same_first_32", "same_first_128")),
              ("held-out perplexity (lower is better)", ("perplexity",)),
              (f"most sequences running at once\n({result['capacity_run']})", ("peak_running",)),
              ("output tok/s (batch of 32; capacity run)", ("batch_tok_s", "capacity_tok_s"))]
    for ax, (title, keys) in zip(axes, panels):
        width = 0.8 / len(keys)
        for j, key in enumerate(keys):
            values = [r[n].get(key) or 0 for n in names]  # 0: not measured (the simulated format)
            bars = ax.bar([i + j * width for i in range(len(names))], values, width, label=key)
            ax.bar_label(bars, fmt="%.2f" if max(values) < 10 else "%.0f", fontsize=7)
        ax.set_xticks([i + width * (len(keys) - 1) / 2 for i in range(len(names))], names, rotation=20, fontsize=8)
        ax.set_title(title, fontsize=9)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(f"KV cache formats, {result['model']} -- {m.get('cpu_model', '')} "
                 f"({', '.join(m.get('isa', []))}); int8 simulated for accuracy only", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
