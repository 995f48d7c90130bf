"""A small GRPO-style loop: vkv samples, a transformers trainer learns, the new weights are pushed
into the running engine in place (update_weights_from_tensor), and the engine's logprobs of the
tokens it sampled are held against the trainer's.

Each round: vkv samples --group completions for each of --prompts prompts (temperature 1,
logprobs of the sampled tokens); the toy verifiable reward is the share of a completion's
characters that are digits; advantages are rewards less their group's mean (GRPO); the trainer
(the bundled model in transformers, fp32) recomputes the sampled tokens' logprobs, and one Adam
step follows on -advantage x logprob. Then the engine sleeps (level 2, vLLM's RL recipe: its KV
pages and its weights' pages go; --sleep-level 1 keeps the weights), wakes its weights
(`wake_up(["weights"])`, empty pages at the same addresses), takes the trainer's weights, and wakes
its KV cache. Reported per round: the mean and max absolute difference between vkv's and the
trainer's logprobs of the sampled tokens (before the step: the same weights); the seconds to
sleep, wake and update, beside the copy floor (the seconds to copy the same new weights once into
memory fresh from the system, in vkv's dtype, measured between the sleep and the wake-up:
`copy_floor`); the memory the process holds awake and
asleep (the KV cache's memfd pool and the weights' pages, and apart from them its anonymous
resident memory, the trainer's included); and, once, the seconds a fresh engine takes to start
on the same weights, with sleep mode and without.

    python benchmarks/rl_loop.py --json benchmarks/results/cpu/rl_loop.json --plot benchmarks/results/cpu/rl_loop.png
    python benchmarks/rl_loop.py --dtype bfloat16 --json benchmarks/results/cpu/rl_loop_bf16.json --plot ...
    python benchmarks/rl_loop.py --device cuda --dtype bfloat16 ...   (benchmarks/gpu_suite.py's "wake")
"""
from __future__ import annotations

import argparse
import itertools
import mmap
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, save, vkv_commit  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.models.loader import checkpoint_dir  # noqa: E402
from vmm.host import resident_bytes  # noqa: E402

PROMPTS = ["Count from one to ten:", "The year the war ended was", "My phone number is", "Add 17 and 25:",
           "The answer to the puzzle is", "In 1969, the crew"]


def held_bytes(llm, device: torch.device) -> tuple[int, int]:
    """What the process holds: its anonymous resident memory apart from the weights' pages (the
    trainer's included), and the pages of the engine's pools: the KV cache's memfd (committed
    whether mapped or not) and the weights' range (private memory: what is resident). On a GPU the
    second is the device memory in use, everyone's (the trainer's and the CUDA context's too)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon")), total - free
    pages = llm.engine.model.pages
    weights = resident_bytes(pages.range.addr, pages.range.nbytes) if pages else 0
    with open("/proc/self/status") as f:
        anon = next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon")) - weights
    pools = weights
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:vkv-pages"):
                pools += os.fstat(int(fd)).st_blocks * 512
        except OSError:
            continue
    return anon, pools


def copy_floor(state: dict, dtype: torch.dtype, device: torch.device, now) -> tuple[float, float]:
    """Seconds to copy the new weights once, in vkv's dtype, into memory fresh from the system, as
    the update writes into the weights' pages fresh from it: on the host an anonymous mapping of
    2 MiB pages where the kernel allows (as the weights' own pool), faulted by the copy; on a GPU
    new device memory. Measured between the sleep and the wake-up, so that the copy and the update
    after it meet the same state of the machine: memory the sleep has just given back (a virtual
    machine's freed memory, once reported to its host, is several times slower to touch again);
    a tensor that two names share (a tied embedding) is copied once, as the update writes it once.
    Returns it, and the seconds of the same copy again into the same memory (the copy's bandwidth
    alone, nothing faulted)."""
    tensors = list({t.data_ptr(): t for t in state.values()}.values())
    pages = None
    started = now()
    if device.type == "cuda":
        slots = [t.to(dtype, copy=True) for t in tensors]
    else:
        sizes = [-(-t.numel() * dtype.itemsize // 64) * 64 for t in tensors]
        pages = mmap.mmap(-1, sum(sizes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        pages.madvise(mmap.MADV_HUGEPAGE)
        raw, slots = torch.frombuffer(pages, dtype=torch.uint8), []
        for t, at in zip(tensors, itertools.accumulate(sizes, initial=0)):
            slots.append(raw[at:at + t.numel() * dtype.itemsize].view(dtype).view(t.shape))
        del raw
        for slot, t in zip(slots, tensors):
            slot.copy_(t)
    seconds = now() - started
    started = now()  # the same copy again, the memory now faulted: the copy's bandwidth alone
    for slot, t in zip(slots, tensors):
        slot.copy_(t)
    warm = now() - started
    del slots
    if pages is not None:
        pages.close()
    return seconds, warm
    sizes = [-(-t.numel() * dtype.itemsize // 64) * 64 for t in tensors]
    started = now()
    pages = mmap.mmap(-1, sum(sizes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages.madvise(mmap.MADV_HUGEPAGE)
    raw, at = torch.frombuffer(pages, dtype=torch.uint8), 0
    for t, size in zip(tensors, sizes):
        raw[at:at + t.numel() * dtype.itemsize].view(dtype).view(t.shape).copy_(t)
        at += size
    seconds = now() - started
    started = now()  # the same copy again, the pages now faulted: the copy's bandwidth alone
    at = 0
    for t, size in zip(tensors, sizes):
        raw[at:at + t.numel() * dtype.itemsize].view(dtype).view(t.shape).copy_(t)
        at += size
    warm = now() - started
    del raw
    pages.close()
    return seconds, warm


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (GRPO's group)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--sleep-level", type=int, choices=(1, 2), default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="vkv's (the trainer: fp32)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]: the engine's, the trainer's and the floor's")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM
    path = checkpoint_dir(None)
    device = torch.device(args.device)

    def now() -> float:  # (the device's queued work done first)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    optimizer = torch.optim.Adam(trainer.parameters(), lr=args.lr)
    engine = {"kv_cache_memory": 256 << 20, "dtype": args.dtype, "device": args.device,
              "quantization": "dequantize"}  # (as sleep mode serves the weights)
    LLM(**engine).close()  # imports and first-call costs, untimed
    started = now()
    LLM(**engine).close()  # a fresh start without sleep mode
    fresh_start_plain_s = now() - started
    started = now()
    llm = LLM(**engine, enable_sleep_mode=args.sleep_level == 2)
    fresh_start_s = now() - started
    tokenizer = llm.tokenizer
    rounds = []
    for r in range(args.rounds):
        prompts = [tokenizer.encode(p) for p in PROMPTS[:args.prompts]]
        params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, logprobs=0, n=args.group, seed=r)
        outs = llm.generate(prompts, params, use_tqdm=False)
        trainer.train()
        gaps, loss, rewards = [], 0.0, []
        for prompt, out in zip(prompts, outs):
            group = [(c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)], sum(ch.isdigit() for ch in c.text) / max(1, len(c.text)))
                     for c in out.outputs]
            mean = sum(g[2] for g in group) / len(group)
            for tokens, sampled, reward in group:
                ids = torch.tensor([prompt + tokens], device=device)
                logits = trainer(ids).logits[0, len(prompt) - 1:-1]
                logprobs = torch.log_softmax(logits.float(), -1).gather(1, ids[0, len(prompt):, None])[:, 0]
                gaps += (torch.tensor(sampled) - logprobs.detach().cpu()).abs().tolist()
                loss = loss - (reward - mean) * logprobs.sum()
                rewards.append(reward)
        optimizer.zero_grad()
        (loss / len(rewards)).backward()
        optimizer.step()
        trainer.eval()
        state = trainer.state_dict()
        awake = held_bytes(llm, device)
        t0 = now()
        llm.sleep(args.sleep_level)
        sleep_s = now() - t0
        asleep = held_bytes(llm, device)
        copy_s, copy_warm_s = copy_floor(state, getattr(torch, args.dtype), device, now)
        t1 = now()
        llm.wake_up(["weights"])
        t2 = now()
        llm.update_weights_from_tensor(state)
        t3 = now()
        llm.wake_up(["kv_cache"])
        t4 = now()
        rounds.append({"round": r, "mean_reward": sum(rewards) / len(rewards), "logprob_gap_mean": sum(gaps) / len(gaps),
                       "logprob_gap_max": max(gaps), "sleep_s": sleep_s, "wake_s": (t2 - t1) + (t4 - t3),
                       "update_s": t3 - t2, "copy_floor_s": copy_s,
                       "copy_into_touched_memory_s": copy_warm_s,
                       "wake_and_update_over_copy": (t4 - t1) / copy_s, "anon_awake_bytes": awake[0], "anon_asleep_bytes": asleep[0],
                       "pools_awake_bytes": awake[1], "pools_asleep_bytes": asleep[1]})
        print(f"round {r}: reward {rounds[-1]['mean_reward']:.3f}, logprob gap mean {rounds[-1]['logprob_gap_mean']:.2e} "
              f"max {rounds[-1]['logprob_gap_max']:.2e}; sleep {sleep_s:.3f} s, wake {t2 - t1 + t4 - t3:.3f} s, update "
              f"{t3 - t2:.3f} s (copy floor {copy_s:.3f} s; a fresh start: {fresh_start_s:.2f} s, {fresh_start_plain_s:.2f} s without sleep mode); "
              f"pools {awake[1] >> 20} -> {asleep[1] >> 20} MiB, anonymous {awake[0] >> 20} -> {asleep[0] >> 20} MiB",
              flush=True)
    weights = llm.engine.model.pages.nbytes if llm.engine.model.pages else 0
    kv = llm.engine.kv.pool.num_pages * llm.engine.kv.pool.page_size
    llm.close()
    result = {"benchmark": "rl_loop", "command": "python benchmarks/rl_loop.py " + " ".join(argv or sys.argv[1:]),
              "machine": machine_info(), "threads": torch.get_num_threads(), "vkv_commit": vkv_commit(),
              "model": f"bundled SmolLM2-135M-Instruct (Q4_1 weights dequantized to fp32), {args.dtype} in vkv, "
                       "fp32 in the trainer",
              "sleep_level": args.sleep_level, "dtype": args.dtype, "device": str(device),
              "pools_are": ("the device memory in use, everyone's (trainer and CUDA context included)"
                            if device.type == "cuda" else "the KV cache's memfd pages and the weights' resident pages"), "fresh_start_s": fresh_start_s,
              "fresh_start_without_sleep_mode_s": fresh_start_plain_s, "rounds": rounds,
              "weights_bytes": weights, "kv_bytes": kv,
              "pools_asleep_bytes_max": max(x["pools_asleep_bytes"] for x in rounds),
              "wake_and_update_over_copy": spread([x["wake_and_update_over_copy"] for x in rounds]),
              "wake_and_update_over_copy_into_touched_memory": spread([(x["wake_s"] + x["update_s"])
                                                                       / x["copy_into_touched_memory_s"] for x in rounds]),
              "wake_and_update_over_fresh_start": [(x["wake_s"] + x["update_s"]) / fresh_start_s for x in rounds],
              "wake_and_update_over_fresh_start_without_sleep_mode": [(x["wake_s"] + x["update_s"]) / fresh_start_plain_s
                                                                       for x in rounds],
              "update_over_fresh_start": [x["update_s"] / fresh_start_s for x in rounds]}
    save(result, args.json_path, args.plot_path, plot)
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = result["rounds"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    x = [r["round"] for r in rounds]
    axes[0].semilogy(x, [r["logprob_gap_max"] for r in rounds], "o-", label="max")
    axes[0].semilogy(x, [r["logprob_gap_mean"] for r in rounds], "s-", label="mean")
    axes[0].axhline(1e-3, color="grey", ls="--", lw=0.8, label="1e-3")
    axes[0].set_xlabel("round")
    axes[0].set_ylabel("|vkv - trainer| logprob")
    axes[0].legend(fontsize=8)
    width = 0.2
    axes[1].bar([i - 1.5 * width for i in x], [r["wake_s"] + r["update_s"] for r in rounds], width, label="wake + update")
    axes[1].bar([i - 0.5 * width for i in x], [r["copy_floor_s"] for r in rounds], width,
                label="copy into fresh memory (floor)")
    axes[1].bar([i + 0.5 * width for i in x], [r.get("copy_into_touched_memory_s", 0) for r in rounds], width,
                label="the same copy into touched memory")
    axes[1].bar([i + 1.5 * width for i in x], [result["fresh_start_s"]] * len(x), width, label="fresh engine start")
    axes[1].set_xlabel("round")
    axes[1].set_ylabel("seconds")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"RL loop: vkv sampling, transformers training ({result['machine'].get('cpu_model', '')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
