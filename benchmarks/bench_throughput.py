"""Offline throughput: vkv's continuous batching vs Hugging Face `generate` with static batches,
same model, same ShareGPT requests, one run.

Each request asks for exactly its ShareGPT reply length (ignore EOS), as in vLLM's benchmark.
HF pads each static batch on the left and decodes until the batch's longest request is done;
only each request's own tokens count as useful output.

    python benchmarks/bench_throughput.py --num-requests 32 \
        --json benchmarks/results/cpu/throughput.json --plot benchmarks/results/cpu/throughput.png
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, save  # noqa: E402
from sharegpt import BenchRequest, sample_requests  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def run_vkv(requests: list[BenchRequest], model: str | None, layout: str, max_num_seqs: int, **options) -> dict:
    start = time.perf_counter()
    llm = LLM(model=model, kv_layout=layout, max_num_seqs=max_num_seqs, quantization="dequantize", **options)  # (as transformers)
    load = time.perf_counter() - start
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outs = llm.generate([r.prompt_ids for r in requests], params)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [r.output_len for r in requests]
    stats = llm.stats()
    llm.engine.close()
    del llm, outs  # this engine's weights gone before the next one loads (a GPU holds one 8B model at a time)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"system": f"vkv-{layout}", "elapsed_s": elapsed, "load_s": load,
            "preemptions": stats.preemptions, "peak_pages_mapped": stats.kv.peak_pages_mapped,
            "page_size": stats.kv.page_size, "map_seconds": stats.kv.map_seconds}


def run_hf(requests: list[BenchRequest], model_dir, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    start, padded = time.perf_counter(), 0
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    for batch in tqdm(batches, desc="HF static batches"):
        width, new = max(len(r.prompt_ids) for r in batch), max(r.output_len for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids):] = 1
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
        padded += len(batch) * new
    return {"system": f"hf-static-{batch_size}", "elapsed_s": time.perf_counter() - start,
            "generated_tokens_incl_padding": padded}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar([r["system"] for r in runs], [r["output_tokens_per_s"] for r in runs],
                  color=["tab:gray" if r["system"].startswith("hf") else "tab:blue" for r in runs])
    for bar, r in zip(bars, runs):
        label = f"{r['speedup_vs_hf']:.2f}x" if r["speedup_vs_hf"] else f"{r['output_tokens_per_s']:.0f}"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set_ylabel("useful output tokens / s")
    m = result["machine"]
    ax.set_title(f"{result['num_requests']} ShareGPT requests, {result['model']}\n"
                 f"{m.get('gpu') or m['processor']} ({m['cpu_count']} CPUs), torch {m['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--kv-layout", default="interleaved,per_layer", help="comma-separated layouts")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--max-output-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    args = parser.parse_args(argv)

    from engine.models import load_tokenizer
    from engine.models.loader import checkpoint_dir
    requests = sample_requests(load_tokenizer(args.model), args.num_requests, args.seed,
                               max_output=args.max_output_len)
    runs = [run_vkv(requests, args.model, layout, args.max_num_seqs, device=args.device, dtype=args.dtype)
            for layout in args.kv_layout.split(",")]
    if not args.no_hf:
        runs.append(run_hf(requests, checkpoint_dir(args.model), args.hf_batch_size))
    out_tokens = sum(r.output_len for r in requests)
    in_tokens = sum(len(r.prompt_ids) for r in requests)
    hf = next((r for r in runs if r["system"].startswith("hf")), None)
    for r in runs:
        r["requests_per_s"] = len(requests) / r["elapsed_s"]
        r["output_tokens_per_s"] = out_tokens / r["elapsed_s"]
        r["speedup_vs_hf"] = hf["elapsed_s"] / r["elapsed_s"] if hf else None
    result = {"benchmark": "offline_throughput",
              "command": "python benchmarks/bench_throughput.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "model": args.model or "SmolLM2-135M-Instruct (bundled GGUF, fp32)", "num_requests": len(requests),
              "prompt_tokens": in_tokens, "output_tokens": out_tokens,
              "mean_prompt_len": in_tokens / len(requests), "mean_output_len": out_tokens / len(requests),
              "max_output_len": max(r.output_len for r in requests), "machine": machine_info(), "runs": runs}
    for r in runs:
        print(f"{r['system']:<20} {r['elapsed_s']:8.1f} s {r['requests_per_s']:7.3f} req/s "
              f"{r['output_tokens_per_s']:8.1f} tok/s" + (f"  {r['speedup_vs_hf']:.2f}x HF" if hf else ""))
    save(result, args.json_path, args.plot_path, plot)
    return result


if __name__ == "__main__":
    main()
