"""End to end on a GPU: decode as CUDA graphs against eager steps, over vkv's virtual KV with
FlashAttention and over a block table with FlexAttention's paged kernel, same engine.

    python benchmarks/bench_gpu_serving.py --json DIR/gpu_serving.json --plot DIR/gpu_serving.png

A configuration is LAYOUT:KERNEL:BLOCK:MODE (MODE graphs, or eager: vLLM's --enforce-eager),
each one engine over random-weight Llama-3-8B in bf16 (max_num_seqs 256, the default
max_num_batched_tokens, prefix caching off so that every repeat computes its prompts), measured on three workloads, --repeats times each, in turn:
  single     one stream: a 128-token prompt, then 256 tokens decoded (ignore_eos); decode tok/s
             is 256 over the time of a 257-token request less a 1-token one, against the
             weight-read bound (the weights' bytes at the copy bandwidth measured in the run)
  sharegpt   64 and 256 ShareGPT requests (outputs capped at 128 tokens, each asking exactly
             its reply's length, ignore_eos), all submitted at once: output tok/s
FlexAttention runs as the engine compiles it, one kernel for every batch size: in torch 2.11
that is its general kernel, without the key split its decode kernel makes for a fixed batch
(bench_long_context.py measures that one). Reported per workload: the median and range of the
repeats; per configuration the graphs'
memory and capture time, the engine's start, and the KV pool. The JSON is written after each
configuration, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import copy_bandwidth  # noqa: E402
from common import machine_info, save  # noqa: E402
from sharegpt import sample_requests  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.models import load_tokenizer  # noqa: E402

CONFIGS = "interleaved:flash:16:graphs,interleaved:flash:16:eager,paged:flex:128:graphs,paged:flex:128:eager"


def timed_generate(llm, prompts, params) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    want = [p.max_tokens for p in params] if isinstance(params, list) else [params.max_tokens] * len(prompts)
    assert [len(o.outputs[0].token_ids) for o in outs] == want
    return elapsed


def spread(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "range": [min(samples), max(samples)], "runs": samples}


def run_config(spec: str, model: str, workloads: dict, repeats: int, bandwidth: float, device: str = "cuda") -> dict:
    layout, kernel, block, mode = spec.split(":")
    start = time.perf_counter()
    llm = LLM(model=model, device=device, dtype="bfloat16", kv_layout=layout, attention_backend=kernel,
              block_size=int(block), max_num_seqs=256, enforce_eager=mode == "eager",
              enable_prefix_caching=False)  # (each repeat computes its prompts again)
    row = {"config": spec, "layout": layout, "kernel": kernel, "block_size": int(block), "mode": mode,
           "start_s": time.perf_counter() - start, "decode_path": llm.engine.platform()["decode"]}
    graphs = llm.engine.core.runner.graphs
    if graphs is not None:
        row.update(graph_bytes=graphs.bytes, graph_capture_s=graphs.seconds, graph_sizes=graphs.sizes)
    weights = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    row["weight_bytes"] = weights
    prompt = [[100 + i % 5000 for i in range(128)]]
    single = []
    for _ in range(repeats):
        first = timed_generate(llm, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        whole = timed_generate(llm, prompt, SamplingParams(temperature=0, max_tokens=257, ignore_eos=True))
        single.append(256 / (whole - first))
    bound = bandwidth / weights
    row["single_decode_tok_s"] = spread(single)
    row["single_weight_read_bound_tok_s"] = bound
    row["single_share_of_bound"] = row["single_decode_tok_s"]["median"] / bound
    print(f"{spec:28s} single stream {row['single_decode_tok_s']['median']:8.1f} tok/s "
          f"({100 * row['single_share_of_bound']:.0f}% of the weight-read bound {bound:.0f})", flush=True)
    for name, requests in workloads.items():
        params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
        out_tokens = sum(r.output_len for r in requests)
        rates = [out_tokens / timed_generate(llm, [r.prompt_ids for r in requests], params) for _ in range(repeats)]
        row[f"{name}_output_tok_s"] = spread(rates)
        print(f"{spec:28s} {name:13s} {row[f'{name}_output_tok_s']['median']:8.1f} output tok/s "
              f"({min(rates):.0f}-{max(rates):.0f})", flush=True)
    kv = llm.stats().kv
    row.update(kv_pool_bytes=kv.pages_total * kv.page_size, preemptions=llm.stats().preemptions)
    llm.engine.close()
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["runs"] if "error" not in r]
    keys = ["single_decode_tok_s"] + [f"{w}_output_tok_s" for w in result["workloads"]]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 4.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        values = [r[key]["median"] for r in rows]
        errors = [[r[key]["median"] - r[key]["range"][0] for r in rows], [r[key]["range"][1] - r[key]["median"] for r in rows]]
        ax.bar(range(len(rows)), values, yerr=errors, color=["C0" if r["mode"] == "graphs" else "C1" for r in rows])
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["config"].replace(":", "\n", 1) for r in rows], fontsize=7)
        ax.set_title(key.replace("_", " "), fontsize=9)
        if key == "single_decode_tok_s" and rows:
            ax.axhline(rows[0]["single_weight_read_bound_tok_s"], color="k", ls="--", lw=1, label="weight-read bound")
            ax.legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(f"random Llama-3-8B bf16, medians and ranges of {result['repeats']} runs — {m.get('gpu')}, "
                 f"torch {m['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:llama-3-8b")
    p.add_argument("--configs", default=CONFIGS)
    p.add_argument("--requests", default="64,256", help="ShareGPT workloads: requests in each")
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # (cpu: a smoke run of the script)
    p.add_argument("--json", dest="json_path")
    p.add_argument("--plot", dest="plot_path")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gpu_serving: needs a CUDA GPU")
    tokenizer = load_tokenizer(args.model)
    workloads = {f"sharegpt_{n}": sample_requests(tokenizer, n, 0, max_output=args.max_output_len)
                 for n in map(int, filter(None, args.requests.split(",")))}
    result = {"benchmark": "gpu_serving", "model": args.model, "dtype": "bfloat16", "repeats": args.repeats,
              "workloads": list(workloads), "max_output_len": args.max_output_len,
              "copy_bandwidth_gb_s": copy_bandwidth(torch.device(args.device)) / 1e9, "machine": machine_info(), "runs": [],
              "command": "python benchmarks/bench_gpu_serving.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    for spec in args.configs.split(","):
        try:
            result["runs"].append(run_config(spec, args.model, workloads, args.repeats,
                                             result["copy_bandwidth_gb_s"] * 1e9, args.device))
        except Exception as exc:  # one configuration that cannot run: said, the others go on
            result["runs"].append({"config": spec, "mode": spec.rsplit(":", 1)[-1],
                                   "error": f"{type(exc).__name__}: {exc}"[:500]})
            print(f"{spec:28s} FAILED {result['runs'][-1]['error']}", flush=True)
            gc.collect()
        save(result, args.json_path, None, plot)
    save(result, args.json_path, args.plot_path, plot)
    return result


if __name__ == "__main__":
    main()
