"""What serving LoRA adapters costs: a batch of 32 ShareGPT requests over 1, 4 and 16 adapters,
against the base model alone, on the bundled model.

Runs (each the same 32 prompts, 128 greedy tokens each, ignore_eos, 32 seats):
  base          LLM() without LoRA: the reference
  base+lora-on  enable_lora=True, every request on the base model (what switching it on costs)
  K adapters    K random rank-8 adapters on all seven projections (PEFT's format), the requests
                spread round-robin, max_loras=K: each step holds rows of all K

Reports output tok/s and its ratio to the base; adapters are loaded before the clock starts.
The delta of a segment is two small GEMMs per projection (engine/worker/lora.py), so the cost grows
with the number of distinct adapters in a step.

    python benchmarks/bench_lora.py --json benchmarks/results/cpu/lora.json \
        --plot benchmarks/results/cpu/lora.png
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from common import machine_info, save  # noqa: E402
from helpers import LORA_TARGETS, random_adapter  # noqa: E402
from sharegpt import sample_requests  # noqa: E402

from engine import LLM, LoRARequest, SamplingParams  # noqa: E402
from engine.models import load_tokenizer  # noqa: E402


def run(llm: LLM, prompts: list[list[int]], loras: list, max_tokens: int) -> float:
    """Output tokens/s of one batch (adapters loaded first)."""
    for lora in {l.lora_name: l for l in loras if l}.values():
        llm.engine.add_lora(lora)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, greedy, use_tqdm=False, lora_request=loras)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeat", type=int, default=2, help="runs per configuration; the best counts")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    tok = load_tokenizer(None)
    prompts = [r.prompt_ids for r in sample_requests(tok, args.prompts, seed=0, max_prompt=512)]
    root = Path(tempfile.mkdtemp(prefix="vkv-bench-lora-"))
    results = {}
    with LLM(max_num_seqs=32, quantization="dequantize") as base:  # (as LoRA serves it)
        cfg = base.engine.model_config
        results["base"] = max(run(base, prompts, [None] * len(prompts), args.max_tokens) for _ in range(args.repeat))
    print(f"[bench] base: {results['base']:.1f} tok/s", flush=True)
    adapters = [LoRARequest(f"a{i}", i + 1, random_adapter(root / f"a{i}", cfg, args.rank, LORA_TARGETS, seed=i,
                                                           std=0.02))
                for i in range(max(args.adapters))]
    for k in [0, *args.adapters]:
        name = "base+lora-on" if k == 0 else f"{k} adapter{'s' if k > 1 else ''}"
        loras = [adapters[i % k] if k else None for i in range(len(prompts))]
        with LLM(max_num_seqs=32, enable_lora=True, max_loras=max(k, 1), max_cpu_loras=max(args.adapters),
                 max_lora_rank=args.rank) as llm:
            results[name] = max(run(llm, prompts, loras, args.max_tokens) for _ in range(args.repeat))
        print(f"[bench] {name}: {results[name]:.1f} tok/s ({results[name] / results['base']:.2f}x base)", flush=True)
    result = {"benchmark": "lora", "command": "python " + " ".join(sys.argv), "machine": machine_info(),
              "model": "bundled SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32)",
              "workload": f"{args.prompts} ShareGPT prompts (seed 0, <= 512 tokens), {args.max_tokens} greedy tokens "
                          f"each, 32 seats; adapters random rank {args.rank} on q/k/v/o/gate/up/down, requests "
                          f"spread round-robin, max_loras = the number of adapters; best of {args.repeat}",
              "output_tok_s": results,
              "vs_base": {name: tps / results["base"] for name, tps in results.items()}}
    save(result, args.json, args.plot, plot)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names, values = list(result["output_tok_s"]), list(result["output_tok_s"].values())
    fig, ax = plt.subplots(figsize=(8, 4.2))
    bars = ax.bar(names, values, color=["#555"] + ["#4a7"] * (len(names) - 1))
    ax.bar_label(bars, [f"{v:.0f}\n{result['vs_base'][n]:.2f}x" for n, v in zip(names, values)], fontsize=8)
    ax.set_ylabel("output tok/s")
    ax.set_ylim(0, max(values) * 1.25)
    m = result["machine"]
    ax.set_title(f"LoRA: a batch of 32 over K adapters vs the base model\n{result['model']} -- "
                 f"{m.get('cpu_model', '')} ({', '.join(m.get('isa', []))})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
