"""What an 8-bit KV cache costs in accuracy and buys in capacity and speed, on the bundled model.

Formats: "auto" (the model's fp32: the reference), vLLM's fp8_e4m3 and fp8_e5m2 (unscaled, as
vLLM's default scale of 1.0), and two simulated ones: e4m3 with a scale per layer for K and one
for V (vLLM's calculate_kv_scales: absmax of the first batch / 200 for K, / 100 for V; the first
batch here is the first prompt's prefill), and an int8 with one scale per token and head
(absmax / 127). Simulated: K and V are rounded to what such a cache would hold and kept in fp32,
through the sdpa kernel, to decide whether building that format would be worth it; neither is an
option of the engine. Because they run on sdpa, "auto-sdpa" (the fp32 cache on sdpa) measures
what the kernel change alone moves: greedy tokens flip on near ties at fp32's last bit, so that
is the floor of their agreement.

  accuracy    greedy agreement with the reference over ShareGPT prompts: the share of prompts
              whose first token, first 32 and first 128 generated tokens are all the same, and
              the mean length of the agreeing start; under teacher forcing (the reference's
              continuations scored by each format, so a tipped tie does not change what later
              tokens are compared on): the share of positions whose top token is the
              reference's, and the mean |logprob difference| of the reference's token; and the
              perplexity of held-out text: the first replies of ShareGPT conversations not among
              the prompts, up to 512 tokens each (prompt_logprobs, every token after the first)
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

import engine.worker.attention_step  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.models import load_tokenizer  # noqa: E402
from engine.request.outputs import top_of  # noqa: E402

FORMATS = ("auto", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3-scaled-simulated", "int8-simulated", "auto-sdpa")
SIMULATED = ("fp8_e4m3-scaled-simulated", "int8-simulated")
SDPA = (*SIMULATED, "auto-sdpa")  # on the sdpa kernel over an fp32 cache: accuracy only
K_RANGE, V_RANGE = 200.0, 100.0  # vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT


def int8_rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [tokens, heads, D] as an int8 cache with a scale per token and head would give it back."""
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return ((x / scale).round().clamp(-127, 127) * scale).to(dtype)


class LayerScaledE4M3:
    """x as an e4m3 cache with one scale per layer for K and one for V would give it back. The
    sdpa step stores K then V for each layer in turn, so the n-th call is layer n // 2 % layers;
    the first `layers` pairs of calls (the first batch) set the scales, as vLLM's do."""

    def __init__(self, layers: int):
        self.layers, self.calls, self.scales = layers, 0, {}

    def __call__(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (self.calls // 2 % self.layers, self.calls % 2)  # (layer, 0 for K or 1 for V)
        self.calls += 1
        if key not in self.scales:
            self.scales[key] = max(x.abs().max().item(), 1e-12) / (K_RANGE if key[1] == 0 else V_RANGE)
        scale = self.scales[key]
        top = torch.finfo(torch.float8_e4m3fn).max
        return ((x / scale).clamp(-top, top).to(torch.float8_e4m3fn).float() * scale).to(dtype)


def engine_for(fmt: str, **options) -> LLM:
    if fmt in SDPA:
        return LLM(attention_backend="sdpa", **options)
    return LLM(kv_cache_dtype=fmt, **options)


class Simulated:
    """While active, the sdpa kernel stores K and V rounded as a simulated format would."""

    def __init__(self, fmt: str, layers: int):
        self.saved = engine.worker.attention_step.narrow
        self.rounding = {"int8-simulated": int8_rounded, "fp8_e4m3-scaled-simulated": LayerScaledE4M3(layers)}.get(fmt)

    def __enter__(self):
        if self.rounding:
            engine.worker.attention_step.narrow = self.rounding

    def __exit__(self, *exc):
        engine.worker.attention_step.narrow = self.saved


def agreement(got: list[list[int]], want: list[list[int]]) -> dict:
    starts = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
    return {"same_first_token": sum(s >= 1 for s in starts) / len(starts),
            "same_first_32": sum(s >= 32 for s in starts) / len(starts),
            "same_first_128": sum(s >= 128 for s in starts) / len(starts),
            "mean_agreeing_tokens": sum(starts) / len(starts)}


def forced(llm: LLM, sequences: list[list[int]], first: list[int]) -> list[list[tuple[float, int]]]:
    """Each sequence scored from position `first` on: (the sequence's token's logprob, the top
    token), four sequences a step (each scored token costs a row of logits)."""
    scored = []
    for i in range(0, len(sequences), 4):
        outs = llm.generate(sequences[i:i + 4], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        scored += [[(r[t].logprob, top_of(r, 1)[0][0]) for t, r in zip(o.prompt_token_ids[start:], o.prompt_logprobs[start:])]
                   for o, start in zip(outs, first[i:i + 4])]
    return scored


def teacher_forced_agreement(got: list[list[tuple[float, int]]], want: list[list[tuple[float, int]]]) -> dict:
    pairs = [(g, w) for gs, ws in zip(got, want) for g, w in zip(gs, ws)]
    return {"forced_top1": sum(g[1] == w[1] for g, w in pairs) / len(pairs),
            "forced_mean_abs_dlogprob": sum(abs(g[0] - w[0]) for g, w in pairs) / len(pairs)}


def perplexity(llm: LLM, texts: list[list[int]]) -> float:
    outs = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    logprobs = [r[t].logprob for o in outs for t, r in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]
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
    results, reference, reference_forced = {}, None, None
    for fmt in args.formats:
        print(f"[bench] {fmt}", flush=True)
        row = {}
        with engine_for("auto", max_num_seqs=1, kv_cache_memory=1 << 20, page_size=4096) as probe:
            layers = probe.engine.model_config.num_layers
        with Simulated(fmt, layers):
            with engine_for(fmt, max_num_seqs=32) as llm:
                full, head_dim = llm.engine.kv.layout.token_bytes, llm.engine.model_config.head_dim
                # simulated: a byte per value, and for int8 an fp32 scale per head (of head_dim values)
                row["kv_bytes_per_token"] = {"int8-simulated": full // 4 + full // head_dim,
                                             "fp8_e4m3-scaled-simulated": full // 4}.get(fmt, full)
                start = time.perf_counter()
                outs = llm.generate([r.prompt_ids for r in prompts], greedy, use_tqdm=False)
                row["batch_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
                tokens = [o.outputs[0].token_ids for o in outs]
                reference = reference or tokens
                row.update(agreement(tokens, reference))
                sequences = [r.prompt_ids + t for r, t in zip(prompts, reference)]
                scored = forced(llm, sequences, [len(r.prompt_ids) for r in prompts])
                reference_forced = reference_forced or scored
                row.update(teacher_forced_agreement(scored, reference_forced))
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
    panels = [("same first token / 32 / 128 greedy tokens;\nteacher-forced top-1",
               ("same_first_token", "same_first_32", "same_first_128", "forced_top1")),
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
