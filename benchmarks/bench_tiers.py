"""KV tiers: multi-turn chat under eviction, a warm restart, and restore vs recompute per page.

1. Multi-turn chat. ShareGPT conversations replayed turn by turn: each turn's prompt is the
   whole conversation so far (the recorded replies, so the next turn extends the last prompt),
   its output length the recorded reply's, capped. All conversations are open at once, each
   sending its next turn when its last one is answered, and together they need several times
   the KV pool. Configurations: no tier; no tier with the host tier's memory added to the pool
   (the baseline with the same total memory); a host tier smaller than the conversations; that
   host tier plus a disk tier; the same with `--scheduling-policy lpm`. Reported: TTFT p50/p99 of
   the turns after the first, wall time, output tokens/s, tokens the model computed (every
   scheduled token: prefills, recomputation after preemption, decodes), tokens found in the
   pool and restored from each tier, preemptions. Greedy outputs must match across
   configurations.
2. Warm restart. A ~1,000-token system prompt and a question: the first request's TTFT on a
   fresh engine with an empty disk tier (cold), and on a second engine over the same directory
   (warm); engine start times (the disk tier hashes the weights); tokens identical.
3. Restore vs recompute, by prefix length: the TTFT of a prompt computed, then the same prompt
   restored from the host tier (after sleep/wake moved the pool's entries there) and from
   the disk tier (a fresh engine), and per page the restore time against the compute time.

    python benchmarks/bench_tiers.py --json benchmarks/results/cpu/tiers.json \\
        --plot benchmarks/results/cpu/tiers.png
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from itertools import count

import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, save  # noqa: E402
from sharegpt import load_conversations, load_dialogues  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402

_ids = count()


def make_chats(tokenizer, num: int, turns: int, max_context: int, max_output: int, seed: int) -> list[list[tuple]]:
    """num conversations of `turns` turns each: per turn (prompt ids, output length). A prompt
    is the chat template over the conversation so far, so each extends the previous turn's."""
    dialogues = [d for d in load_dialogues() if len(d) >= turns]
    rng = np.random.default_rng(seed)
    chats = []
    for i in rng.permutation(len(dialogues)):
        messages, chat = [], []
        for human, reply in dialogues[i][:turns]:
            messages.append({"role": "user", "content": human})
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompt = tokenizer.encode(text, add_special_tokens=False)
            output = min(max_output, len(tokenizer.encode(reply, add_special_tokens=False)))
            if len(prompt) + output > max_context or output < 4:
                break
            chat.append((prompt, output))
            messages.append({"role": "assistant", "content": reply})
        if len(chat) == turns:
            chats.append(chat)
        if len(chats) == num:
            return chats
    raise ValueError(f"only {len(chats)} ShareGPT conversations have {turns} turns within {max_context} tokens")


def replay(llm: LLM, chats: list[list[tuple]]) -> dict:
    """Every conversation open at once; a turn is sent when the conversation's last one ends."""
    engine = llm.engine
    next_turn = [0] * len(chats)
    sent, ttft, outputs, first_turn, turn_of = {}, {}, {}, set(), {}

    def send(c: int) -> None:
        prompt, output = chats[c][next_turn[c]]
        request_id = f"c{c}t{next_turn[c]}-{next(_ids)}"
        turn_of[request_id] = (c, next_turn[c])
        if next_turn[c] == 0:
            first_turn.add(request_id)
        engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=output, ignore_eos=True))
        sent[request_id] = (c, time.perf_counter())
        next_turn[c] += 1

    computed, schedule = [0], engine.scheduler.schedule

    def counting_schedule(*args):  # every token the model computes: prefills, recomputation, decodes
        out = schedule(*args)
        computed[0] += sum(n for _, n in out.scheduled)
        return out

    engine.scheduler.schedule = counting_schedule
    start = time.perf_counter()
    for c in range(len(chats)):
        send(c)
    while engine.has_unfinished():
        for out in engine.step():
            c, at = sent[out.request_id]
            if out.request_id not in ttft and out.outputs[0].token_ids:
                ttft[out.request_id] = time.perf_counter() - at
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
                if next_turn[c] < len(chats[c]):
                    send(c)
    wall = time.perf_counter() - start
    stats = llm.stats()
    later = np.array([t for r, t in ttft.items() if r not in first_turn]) * 1e3
    restored = {t.tier: t.tokens_restored for t in stats.kv.tiers}
    out_tokens = sum(len(o) for o in outputs.values())
    return {"wall_s": wall, "output_tok_s": out_tokens / wall, "ttft_p50_ms": float(np.median(later)),
            "ttft_p99_ms": float(np.percentile(later, 99)), "turns": len(outputs),
            "prompt_tokens": stats.prompt_tokens, "pool_hit_tokens": stats.kv.prefix_cache_hits,
            "restored_tokens": restored,
            "tokens_computed": computed[0], "output_tokens": out_tokens,
            "evictions": stats.kv.evictions, "preemptions": stats.preemptions,
            "restore_s": stats.kv.tier_restore_seconds, "offload_s": stats.kv.tier_offload_seconds,
            "tiers": [dataclasses.asdict(t) for t in stats.kv.tiers],
            "outputs": [outputs[r] for r in sorted(outputs, key=lambda r: turn_of[r])]}


def multi_turn(chats, kv_memory: int, host_gib: float, seed_dir: str) -> list[dict]:
    host_bytes = int(host_gib * (1 << 30))
    # the tiers' host memory given to the pool instead: the baseline with the same total memory
    configs = [("no tier", {}), (f"no tier, pool + {host_gib:g} GiB", {"kv_cache_memory": kv_memory + host_bytes}),
               (f"host {host_gib:g} GiB", {"kv_offloading_size": host_gib}),
               (f"host {host_gib:g} GiB + disk", {"kv_offloading_size": host_gib, "kv_offloading_path": None}),
               (f"host {host_gib:g} GiB + disk, lpm", {"kv_offloading_size": host_gib, "kv_offloading_path": None,
                                                       "scheduling_policy": "lpm"})]
    runs = []
    for name, options in tqdm(configs, desc="multi-turn chat"):
        if "kv_offloading_path" in options:  # an empty directory each: no warm start here
            options["kv_offloading_path"] = tempfile.mkdtemp(dir=seed_dir)
        with LLM(**{"kv_cache_memory": kv_memory, **options}, max_num_seqs=len(chats)) as llm:
            runs.append({"config": name, **replay(llm, chats)})
    return runs


def ttft(llm: LLM, prompt: list[int], max_tokens: int = 1) -> tuple[float, list[int]]:
    start = time.perf_counter()
    request_id = f"r{next(_ids)}"
    llm.engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    first, tokens = None, []
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - start
            tokens = out.outputs[0].token_ids
    return first, tokens


def warm_restart(prompt: list[int], directory: str) -> dict:
    result = {}
    for run in ("cold", "warm"):
        start = time.perf_counter()
        with LLM(kv_offloading_path=directory) as llm:
            started = time.perf_counter() - start
            first, tokens = ttft(llm, prompt, 16)
            disk = llm.stats().kv.tiers[0]
            result[run] = {"engine_start_s": started, "ttft_ms": first * 1e3, "tokens": tokens,
                           "restored_tokens": disk.tokens_restored}
    result["tokens_identical"] = result["cold"]["tokens"] == result["warm"]["tokens"]
    result["ttft_ratio"] = result["cold"]["ttft_ms"] / result["warm"]["ttft_ms"]
    return result


def restore_cost(long_ids: list[int], lengths: list[int], directory: str) -> list[dict]:
    rows = []
    for n in tqdm(lengths, desc="restore vs recompute"):
        prompt, path = long_ids[:n], tempfile.mkdtemp(dir=directory)
        with LLM(kv_offloading_size=1, kv_offloading_path=path) as llm:
            computed, tokens = ttft(llm, prompt)
            pool_hit, _ = ttft(llm, prompt)  # in the pool still
            llm.sleep()  # the pool's entries go to the host tier
            llm.wake_up()
            before = llm.stats().kv.tier_restore_seconds
            host, host_tokens = ttft(llm, prompt)
            kv = llm.stats().kv
            pages = kv.tiers[0].entries_restored
            page_tokens = kv.tiers[0].tokens_restored / max(pages, 1)
            host_restore = kv.tier_restore_seconds - before
        with LLM(kv_offloading_path=path) as llm:
            disk, disk_tokens = ttft(llm, prompt)
            kv = llm.stats().kv
            disk_restore, disk_pages = kv.tier_restore_seconds, kv.tiers[0].entries_restored
        compute_per_page = computed / (n / page_tokens) if page_tokens else float("nan")
        rows.append({"prefix_tokens": n, "pages": pages, "tokens_per_page": page_tokens,
                     "ttft_computed_ms": computed * 1e3, "ttft_pool_hit_ms": pool_hit * 1e3,
                     "ttft_host_ms": host * 1e3, "ttft_disk_ms": disk * 1e3,
                     "compute_ms_per_page": compute_per_page * 1e3,
                     "host_restore_ms_per_page": host_restore / max(pages, 1) * 1e3,
                     "disk_restore_ms_per_page": disk_restore / max(disk_pages, 1) * 1e3,
                     "tokens_identical": tokens == host_tokens == disk_tokens})
    return rows


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    runs = result["multi_turn"]
    x = np.arange(len(runs))
    ax = axes[0]
    ax.bar(x - 0.2, [r["ttft_p50_ms"] for r in runs], 0.4, label="TTFT p50")
    ax.bar(x + 0.2, [r["ttft_p99_ms"] for r in runs], 0.4, label="TTFT p99")
    ax.set_xticks(x, [r["config"].replace(" + ", "\n+ ").replace(", ", ",\n") for r in runs], fontsize=7)
    ax.set_ylabel("ms")
    ax2 = ax.twinx()
    ax2.plot(x, [r["tokens_computed"] for r in runs], "ko-", label="tokens the model computed")
    ax2.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize=8)
    ax2.legend(loc="lower left", fontsize=8)
    ax.set_title(f"multi-turn chat: {result['conversations']} conversations x {result['turns']} turns", fontsize=10)
    w = result["warm_restart"]
    ax = axes[1]
    ax.bar(["cold start", "warm restart"], [w["cold"]["ttft_ms"], w["warm"]["ttft_ms"]], color=["gray", "tab:green"])
    ax.set_ylabel("first request's TTFT, ms")
    ax.set_title(f"{result['system_prompt_tokens']}-token system prompt, disk tier", fontsize=10)
    rows = result["restore_cost"]
    ax = axes[2]
    lengths = [r["prefix_tokens"] for r in rows]
    for key, label in (("ttft_computed_ms", "computed"), ("ttft_disk_ms", "restored from disk"),
                       ("ttft_host_ms", "restored from host"), ("ttft_pool_hit_ms", "in the pool")):
        ax.plot(lengths, [r[key] for r in rows], "o-", label=label)
    ax.set_xlabel("prefix tokens")
    ax.set_ylabel("TTFT, ms")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("restore vs recompute", fontsize=10)
    fig.suptitle(f"KV tiers, {result['model']}, {result['machine'].get('cpu_model', 'CPU')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-context", type=int, default=1536)
    parser.add_argument("--max-output", type=int, default=24)
    parser.add_argument("--kv-memory-mib", type=int, default=96)
    parser.add_argument("--host-gib", type=float, default=0.25)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--lengths", default="256,512,1024,1536")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    args = parser.parse_args()

    from engine.models import load_tokenizer
    tokenizer = load_tokenizer(None)
    chats = make_chats(tokenizer, args.conversations, args.turns, args.max_context, args.max_output, args.seed)
    long_ids = next(ids for ids in (tokenizer.encode(p, add_special_tokens=False) for p, _ in load_conversations())
                    if len(ids) >= max(args.system_tokens, *map(int, args.lengths.split(","))) + 32)
    scratch = tempfile.mkdtemp(prefix="vkv-bench-tiers-")
    try:
        runs = multi_turn(chats, args.kv_memory_mib << 20, args.host_gib, scratch)
        system = long_ids[:args.system_tokens] + tokenizer.encode(" Summarize the above.", add_special_tokens=False)
        restart = warm_restart(system, tempfile.mkdtemp(dir=scratch))
        cost = restore_cost(long_ids, [int(n) for n in args.lengths.split(",")], scratch)
    finally:
        shutil.rmtree(scratch)
    identical = all(r["outputs"] == runs[0]["outputs"] for r in runs)
    for r in runs:
        del r["outputs"]
    context = [sum(len(p) for p, _ in chat[-1:]) for chat in chats]
    result = {"benchmark": "kv_tiers", "command": " ".join(["python"] + sys.argv),
              "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32)", "kv_layout": "per_layer (CPU default)",
              "conversations": len(chats), "turns": args.turns, "kv_memory_bytes": args.kv_memory_mib << 20,
              "last_turn_context_tokens_total": int(sum(context)), "host_tier_gib": args.host_gib,
              "system_prompt_tokens": len(system), "outputs_identical": identical,
              "machine": machine_info(), "multi_turn": runs, "warm_restart": restart, "restore_cost": cost}
    print(f"\n{'config':<28}{'TTFT p50':>10}{'p99':>9}{'wall s':>8}{'tok/s':>7}{'computed':>10}{'pool hit':>9}"
          f"{'preempt':>8}  restored")
    for r in runs:
        print(f"{r['config']:<28}{r['ttft_p50_ms']:>8.0f}ms{r['ttft_p99_ms']:>7.0f}ms{r['wall_s']:>8.1f}"
              f"{r['output_tok_s']:>7.1f}{r['tokens_computed']:>10}{r['pool_hit_tokens']:>9}{r['preemptions']:>8}"
              f"  {r['restored_tokens']}")
    print(f"warm restart: TTFT {restart['cold']['ttft_ms']:.0f} ms cold, {restart['warm']['ttft_ms']:.0f} ms warm "
          f"({restart['ttft_ratio']:.1f}x); start {restart['cold']['engine_start_s']:.1f} s / "
          f"{restart['warm']['engine_start_s']:.1f} s; tokens identical: {restart['tokens_identical']}")
    for r in cost:
        print(f"{r['prefix_tokens']:>5} tokens: computed {r['ttft_computed_ms']:.0f} ms, disk {r['ttft_disk_ms']:.0f} ms, "
              f"host {r['ttft_host_ms']:.0f} ms, pool {r['ttft_pool_hit_ms']:.0f} ms; per page: compute "
              f"{r['compute_ms_per_page']:.1f} ms, host {r['host_restore_ms_per_page']:.2f} ms, disk "
              f"{r['disk_restore_ms_per_page']:.2f} ms")
    print(f"outputs identical across configurations: {identical}")
    save(result, args.json_path, args.plot_path, plot)
    if not identical or not restart["tokens_identical"] or not all(r["tokens_identical"] for r in cost):
        sys.exit("outputs differ between runs")


if __name__ == "__main__":
    main()
