"""Several models, one KV budget: static partitioning against one elastic pool (kvcached's scenario).

Three models (the bundled SmolLM2-135M and two `random:` presets of other shapes,
`llama-small` and `qwen3-small`) share one KV budget that holds one model's burst but not
three at once. Traffic bursts on one model at a time, in turn: within a burst requests arrive
as a Poisson process, then the model is idle while the next one bursts; each model bursts
`--rounds` times. Both configurations run the same code (`engine.multi.MultiLLM`, one engine
thread stepping each model with work in turn) over the same arrival times:
  static   each model's floor = cap = a third of the pool: what three servers would have
  elastic  no limits: pages go where the traffic is
Reported per configuration: TTFT p50/p99, output tokens/s over the run, preemptions, and the
most sequences one model ran at once; greedy outputs must be identical.

Compute shared fairly: one stream decodes on `qwen3-small` while a burst of 12 prompts arrives
on SmolLM2. The stream's time between tokens before and during the burst, with each step of a
model capped at MultiLLM's `shared_step_tokens` (256) while another model has work, and
without the cap (a step may take max_num_batched_tokens, 2,048, of prefill).

    python benchmarks/bench_multi_model.py --json benchmarks/results/cpu/multi_model.json \\
        --plot benchmarks/results/cpu/multi_model.png
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, save  # noqa: E402
from sharegpt import load_conversations  # noqa: E402

from engine import SamplingParams  # noqa: E402
from engine.multi import MultiLLM  # noqa: E402

MODELS = {"smollm2": None, "llama-small": "random:llama-small", "qwen3-small": "random:qwen3-small"}


def make_traffic(tokenizer, per_burst: int, rounds: int, rate: float, gap: float, prompt_len: tuple[int, int],
                 seed: int) -> list[tuple[float, str, list[int]]]:
    """(arrival second, model, prompt ids), bursts on one model at a time, in turn."""
    rng = np.random.default_rng(seed)
    texts = [ids for ids in (tokenizer.encode(p, add_special_tokens=False) for p, _ in load_conversations()[:3000])
             if prompt_len[0] <= len(ids) <= prompt_len[1]]
    traffic, t = [], 0.0
    for _ in range(rounds):
        for model in MODELS:
            for _ in range(per_burst):
                t += rng.exponential(1 / rate)
                traffic.append((t, model, texts[rng.integers(len(texts))]))
            t += gap
    return traffic


def replay(llms: MultiLLM, traffic, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    pending, sent, ttft, outputs = list(enumerate(traffic)), {}, {}, {}
    most = {m: 0 for m in MODELS}
    start = time.perf_counter()
    with tqdm(total=len(traffic), desc="requests", leave=False) as bar:
        while pending or llms.has_unfinished():
            now = time.perf_counter() - start
            while pending and pending[0][1][0] <= now:
                i, (at, model, prompt) = pending.pop(0)
                llms.add_request(model, f"r{i}", prompt, params)
                sent[f"r{i}"] = start + at
            if not llms.has_unfinished():
                time.sleep(min(0.01, max(0.0, pending[0][1][0] - now)) if pending else 0)
                continue
            for model, out in llms.step():
                if out.request_id not in ttft and out.outputs[0].token_ids:
                    ttft[out.request_id] = time.perf_counter() - sent[out.request_id]
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
                    bar.update(1)
            for model in MODELS:
                most[model] = max(most[model], llms.stats(model).num_running)
    wall = time.perf_counter() - start
    ms = np.array(list(ttft.values())) * 1e3
    by_model = {m: np.array([ttft[f"r{i}"] for i, (_, model, _) in enumerate(traffic) if model == m]) * 1e3
                for m in MODELS}
    return {"wall_s": wall, "output_tok_s": sum(map(len, outputs.values())) / wall,
            "ttft_p50_ms": float(np.median(ms)), "ttft_p99_ms": float(np.percentile(ms, 99)),
            "ttft_p50_ms_by_model": {m: float(np.median(v)) for m, v in by_model.items()},
            "preemptions": sum(llms.stats(m).preemptions for m in MODELS),
            "most_running_by_model": most,
            "peak_pages_by_model": {m: llms.shared.tenants[m].peak_in_use for m in MODELS},
            "pool_pages": llms.shared.pool.num_pages,
            "outputs": [outputs[f"r{i}"] for i in range(len(traffic))]}


def fairness(prompts: list[list[int]], step_tokens: int | None) -> dict:
    """The qwen3-small stream's inter-token times (s) before and during a SmolLM2 burst."""
    with MultiLLM(MODELS, kv_cache_memory=512 << 20) as llms:
        llms.shared_step_tokens = step_tokens
        llms.add_request("qwen3-small", "stream", prompts[0][:100], SamplingParams(temperature=0, max_tokens=60,
                                                                                     ignore_eos=True))
        stamps, burst_at = [], None
        while llms.engines["qwen3-small"].has_unfinished():
            for name, out in llms.step():
                if out.request_id == "stream":
                    stamps.append(time.perf_counter())
            if len(stamps) == 10 and burst_at is None:
                burst_at = len(stamps)
                for i, prompt in enumerate(prompts[1:13]):
                    llms.add_request("smollm2", f"b{i}", prompt, SamplingParams(temperature=0, max_tokens=16,
                                                                                  ignore_eos=True))
        gaps = np.diff(stamps)
        before, during = gaps[1:burst_at - 1], gaps[burst_at - 1:burst_at + 29]
        return {"step_tokens": step_tokens, "before_ms": float(np.median(before) * 1e3),
                "during_median_ms": float(np.median(during) * 1e3), "during_max_ms": float(during.max() * 1e3),
                "gaps_ms": [float(g * 1e3) for g in gaps], "burst_after_token": burst_at}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    names = [r["config"] for r in runs]
    x = np.arange(len(runs))
    axes[0].bar(x - 0.2, [r["ttft_p50_ms"] for r in runs], 0.4, label="p50")
    axes[0].bar(x + 0.2, [r["ttft_p99_ms"] for r in runs], 0.4, label="p99")
    axes[0].set_xticks(x, names)
    axes[0].set_ylabel("TTFT, ms")
    axes[0].legend()
    axes[1].bar(x, [r["output_tok_s"] for r in runs], color=["gray", "tab:green"])
    axes[1].set_xticks(x, names)
    axes[1].set_ylabel("output tokens/s")
    w = 0.8 / len(MODELS)
    for j, m in enumerate(MODELS):
        axes[2].bar(x + (j - 1) * w, [r["peak_pages_by_model"][m] for r in runs], w, label=m)
    axes[2].axhline(runs[0]["pool_pages"], color="k", lw=0.8, ls="--", label="pool")
    axes[2].set_xticks(x, names)
    axes[2].set_ylabel("most KV pages held")
    axes[2].legend(fontsize=8)
    for f in result["fairness"]:
        axes[3].plot(f["gaps_ms"], label=f"step cap {f['step_tokens'] or 'none (2048)'}")
    axes[3].axvline(result["fairness"][0]["burst_after_token"], color="k", lw=0.8, ls="--", label="burst arrives")
    axes[3].set_yscale("log")
    axes[3].set_xlabel("token of the qwen3-small stream")
    axes[3].set_ylabel("time since its previous token, ms")
    axes[3].legend(fontsize=8)
    fig.suptitle(f"3 models, one {result['kv_memory_bytes'] >> 20} MiB KV budget, bursts in turn "
                 f"({result['machine'].get('cpu_model', 'CPU')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-burst", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", type=float, default=8.0, help="requests/s within a burst")
    parser.add_argument("--gap", type=float, default=4.0, help="seconds between bursts")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--kv-memory-mib", type=int, default=240)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    args = parser.parse_args()

    from engine.models import load_tokenizer
    traffic = make_traffic(load_tokenizer(None), args.per_burst, args.rounds, args.rate, args.gap, (150, 400), args.seed)
    third = 1 / len(MODELS)
    configs = [("static", {m: (third, third) for m in MODELS}), ("elastic", None)]
    runs = []
    for name, limits in tqdm(configs, desc="configurations"):
        with MultiLLM(MODELS, kv_cache_memory=args.kv_memory_mib << 20, kv_limits=limits, max_num_seqs=args.per_burst) as llms:
            runs.append({"config": name, **replay(llms, traffic, args.max_tokens)})
    prompts = [p for _, _, p in sorted(traffic, key=lambda t: -len(t[2]))]
    fair = [fairness(prompts, cap) for cap in tqdm((256, None), desc="decode under a burst")]
    identical = all(r["outputs"] == runs[0]["outputs"] for r in runs)
    for r in runs:
        del r["outputs"]
    result = {"benchmark": "multi_model", "command": " ".join(["python"] + sys.argv), "models": MODELS,
              "kv_layout": "per_layer (CPU default)", "kv_memory_bytes": args.kv_memory_mib << 20,
              "requests": len(traffic), "per_burst": args.per_burst, "rounds": args.rounds, "rate": args.rate,
              "gap_s": args.gap, "max_tokens": args.max_tokens, "outputs_identical": identical,
              "machine": machine_info(), "runs": runs, "fairness": fair}
    print(f"\n{'config':<9}{'TTFT p50':>10}{'p99':>10}{'tok/s':>8}{'preempt':>9}  most running / peak pages per model")
    for r in runs:
        print(f"{r['config']:<9}{r['ttft_p50_ms']:>8.0f}ms{r['ttft_p99_ms']:>8.0f}ms{r['output_tok_s']:>8.1f}"
              f"{r['preemptions']:>9}  {r['most_running_by_model']} {r['peak_pages_by_model']} of {r['pool_pages']}")
    for f in fair:
        print(f"qwen3-small stream, step cap {f['step_tokens'] or 'none'}: {f['before_ms']:.0f} ms between tokens "
              f"before the SmolLM2 burst, {f['during_median_ms']:.0f} ms median and {f['during_max_ms']:.0f} ms "
              f"max during it")
    print(f"outputs identical: {identical}")
    save(result, args.json_path, args.plot_path, plot)
    if not identical:
        sys.exit("outputs differ between static and elastic")


if __name__ == "__main__":
    main()
