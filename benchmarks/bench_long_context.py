"""Decode attention against context length and batch on a GPU: FlashAttention over vkv's
virtual KV against FlexAttention's paged kernel over a block table, Llama-3-8B heads.

    python benchmarks/bench_long_context.py --json DIR/long_context.json --plot DIR/long_context.png

Each case is `batch` sequences decoding one token over `context` tokens of one layer's K and V
(32 query heads, 8 KV heads, head_dim 128, bf16), left out where batch x context passes
--max-tokens (1M: FlexAttention's general kernel indexes the key range in int32). Kernels and
the caches they read:
  flash virtual   PyTorch's built-in FlashAttention-2 over vkv's per_layer virtual cache (CUDA
                  VMM pages mapped as far as each sequence's context): the engine's default
  flex virtual    FlexAttention (compiled) over the same virtual cache, each slot read in
                  128-row pieces through a block mask
  flex paged-B    FlexAttention (compiled) over a block table of B-row blocks in random order,
                  the cache one plain tensor as PagedLayout allocates it: the library's paged
                  kernel (128 rows, the block its kernels prefer, and vLLM's 16)
FlexAttention is compiled for each batch size apart, so its decode kernel (which splits the
keys) runs; the engine compiles one kernel for every batch size, which torch 2.11 builds
without that split. Only the attention call is timed (`step.attend`: the rotary embedding and
the K/V store are the same for every kernel and left out), captured in a CUDA graph and
replayed (the launch cost left out), median of --repeats runs of 20 replays; the spread is the
runs' range. Reported: the bytes of K and V the call must read over its time, as a share of a
large device copy's bandwidth measured in the same run, and each kernel's time over flash
virtual's (the kernels' outputs are checked against sdpa in tests/worker/test_gpu.py and
test_attention_contracts.py). Results are written after every case, so a run cut short keeps
what it measured.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import batch_for, build, copy_bandwidth, graph_samples  # noqa: E402
from common import machine_info, save  # noqa: E402

from engine.worker.attention import Flex, StepAttention  # noqa: E402
from engine.models.ops import rope_table  # noqa: E402

HQ, HKV, DIM = 32, 8, 128
KERNELS = ("flash virtual", "flex virtual", "flex paged-128", "flex paged-16")


def paged_caches(seqs, block: int, dtype, device):
    """One layer's K and V as [blocks, block, heads, D] (plain tensors), each sequence's blocks
    drawn in random order, and the block table."""
    need = [-(-c // block) for _, c in seqs]
    k, v = (torch.randn(sum(need) + 1, block, HKV, DIM, dtype=dtype, device=device) for _ in range(2))
    order = torch.randperm(sum(need) + 1).tolist()
    return [k], [v], [[order.pop() for _ in range(n)] for n in need], block


def run_case(kernel: str, seqs, q, cos_sin, repeats: int):
    """(samples, KV object to close) for one kernel over a fresh cache of its layout."""
    dtype, device = q.dtype, q.device
    if kernel.endswith("virtual"):
        k_caches, v_caches, table, rows, kv = build("per_layer", seqs, (HQ, HKV, DIM, 1), dtype, device)
        paged = False
    else:
        k_caches, v_caches, table, rows = paged_caches(seqs, int(kernel.rsplit("-", 1)[1]), dtype, device)
        kv, paged = None, True
    batch = batch_for(seqs, table, rows, device)
    backend = Flex(static_batch=True) if kernel.startswith("flex") else "flash"  # flex at its best: its decode kernel
    step = StepAttention(backend, k_caches, v_caches, batch, cos_sin, paged=paged)
    samples = graph_samples(lambda: step.attend(q, k_caches[0], v_caches[0]), repeats)
    return samples, kv


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 4.2), squeeze=False, sharey=True)
    for ax, batch in zip(axes[0], batches):
        for kernel in KERNELS:
            mine = sorted((r["context"], 100 * r["share_of_copy_bandwidth"]) for r in rows
                          if r["batch"] == batch and r["kernel"] == kernel and r.get("ms"))
            if mine:
                ax.plot(*zip(*mine), marker="o", label=kernel)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(f"batch {batch}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("K+V bytes read / time, % of copy bandwidth")
    axes[0][0].legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(f"decode attention, Llama-3-8B heads, bf16 — {m.get('gpu')}, torch {m['torch']}; "
                 f"copy {result['copy_bandwidth_gb_s']:.0f} GB/s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="1024,4096,16384,32768,65536,131072")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--max-tokens", type=int, default=1 << 20, help="largest batch x context measured "
                   "(FlexAttention's general kernel indexes keys in int32: 2^21 rows of these heads at most)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", dest="json_path")
    p.add_argument("--plot", dest="plot_path")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_long_context: needs a CUDA GPU")
    device, dtype = torch.device("cuda"), torch.bfloat16
    kernels = [k for k in args.kernels.split(",") if k]
    unknown = set(kernels) - set(KERNELS)
    if unknown:
        p.error(f"unknown kernels {sorted(unknown)}: choose from {KERNELS}")
    torch.manual_seed(0)
    result = {"benchmark": "long_context_decode_attention", "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": DIM},
              "dtype": "bfloat16", "flex_compiled": "per batch size (torch._dynamo.mark_static on the batch)",
              "copy_bandwidth_gb_s": copy_bandwidth(device) / 1e9, "machine": machine_info(),
              "rows": [], "command": "python benchmarks/bench_long_context.py "
                                     + " ".join(sys.argv[1:] if argv is None else argv)}
    bandwidth = result["copy_bandwidth_gb_s"] * 1e9
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            if batch * context > args.max_tokens:
                continue
            seqs = [(1, context)] * batch
            cos_sin = rope_table(1.0 / 10000 ** (torch.arange(0, DIM, 2).float() / DIM), context + 1, dtype, device)
            q = torch.randn(batch, HQ, DIM, dtype=dtype, device=device)
            kv_bytes = batch * context * 2 * HKV * DIM * 2
            base = None
            for kernel in kernels:
                row = {"kernel": kernel, "batch": batch, "context": context, "kv_bytes": kv_bytes}
                start = time.perf_counter()
                try:
                    samples, kv = run_case(kernel, seqs, q, cos_sin, args.repeats)
                except Exception as exc:  # a kernel that cannot run this case: said, the others go on
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                    print(f"batch {batch:4d} context {context:7d} {kernel:15s} FAILED {row['error']}", flush=True)
                    result["rows"].append(row)
                    torch.cuda.empty_cache()
                    continue
                ms = statistics.median(samples) * 1e3
                row.update(ms=ms, ms_range=[min(samples) * 1e3, max(samples) * 1e3],
                           share_of_copy_bandwidth=kv_bytes / (ms / 1e3) / bandwidth,
                           seconds_to_build_and_time=time.perf_counter() - start)
                if kernel == "flash virtual":
                    base = ms
                row["over_flash_virtual"] = ms / base if base else None
                result["rows"].append(row)
                print(f"batch {batch:4d} context {context:7d} {kernel:15s} {ms:8.4f} ms "
                      f"({100 * row['share_of_copy_bandwidth']:5.1f}% of copy bandwidth"
                      + (f", {row['over_flash_virtual']:.2f}x flash virtual" if base else "") + ")", flush=True)
                if kv is not None:
                    kv.close()
                torch.cuda.empty_cache()
            if args.json_path:  # after every case: a run cut short keeps what it measured
                save(result, args.json_path, None, plot)
    save(result, args.json_path, args.plot_path, plot)
    return result


if __name__ == "__main__":
    main()
