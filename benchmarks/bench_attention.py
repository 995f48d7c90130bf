"""Attention time per layer over each KV layout, same kernel, same shapes, on the CPU or a GPU.

    python benchmarks/bench_attention.py --json benchmarks/results/cpu/attention.json \
        --plot benchmarks/results/cpu/attention.png
    python benchmarks/bench_attention.py --device cuda --json DIR/attention.json --plot DIR/attention.png

Layouts, each built as the engine builds it:
  contiguous   a plain [sequences, longest, H, D] tensor per layer (no virtual memory): the baseline
  per_layer    vkv's virtual KV cache, one range per layer's K and V, pages mapped on demand
  interleaved  vkv's virtual KV cache, one range per slot for every layer (a layer's K is strided)
  paged        the block table: [blocks, 16, H, D] per layer, blocks in random order
Virtual caches map pages only as far as each sequence's context (host pages of 64 KiB on the
CPU, the CUDA granularity on a GPU). Kernels: on the CPU `native` (one call for the batch) and
`sdpa` (per sequence); on CUDA `flash` (PyTorch's built-in FlashAttention-2), `flash-attn` and
`flash-attn-4` when installed, and `sdpa`. Cases: decode of 32 sequences at 256 and 1,024 tokens
of context, and a 512-token prefill. Reported: median time per call (CUDA events on a GPU) and
the bytes of K and V the call must read over that time, as a share of a large copy's bandwidth
measured in the same run. On a GPU a single call is mostly the host launching it (0.25-0.6 ms on
an H100 whatever the size), so the call is also captured in a CUDA graph and replayed:
`device_ms`, the kernels alone (working sets under the L2's 50 MB are read from L2 there).
Shapes: SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64, 30 layers) and Llama-3-8B (32, 8,
128, 32 layers).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, save  # noqa: E402

import vmm  # noqa: E402
from engine.worker.attention import StepAttention, pick_attention  # noqa: E402
from engine.kv.batch import StepBatch  # noqa: E402
from engine.kv.manager import KVManager  # noqa: E402
from engine.kv.paged import PagedLayout  # noqa: E402
from engine.kv.virtual import VirtualLayout  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.models.ops import rope_table  # noqa: E402
from engine.request.sampling_params import SamplingParams  # noqa: E402
from engine.request.sequence import Sequence  # noqa: E402

SHAPES = {"smollm2-135m": (9, 3, 64, 30), "llama-3-8b": (32, 8, 128, 32)}
CASES = {"decode-32x256": [(1, 256)] * 32, "decode-32x1024": [(1, 1024)] * 32, "prefill-512": [(512, 512)]}
LAYOUTS = ("contiguous", "per_layer", "interleaved", "paged")


def build(layout: str, seqs, shape, dtype, device):
    """(K caches, V caches, block table rows, rows per block, KV object to close) for `seqs`."""
    hq, hkv, dim, layers = shape
    longest = max(c for _, c in seqs)
    if layout == "contiguous":
        k, v = (torch.randn(len(seqs), longest, hkv, dim, dtype=dtype, device=device) for _ in range(2))
        return [k], [v], [[i] for i in range(len(seqs))], longest, None
    cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=layers, num_heads=hq,
                      num_kv_heads=hkv, head_dim=dim)
    held = [Sequence("b", 0, [1] * c, SamplingParams(), 0.0) for _, c in seqs]
    token_bytes = cfg.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())
    if layout == "paged":
        kv = KVManager(PagedLayout(cfg, 16, sum(-(-c // 16) for _, c in seqs) + len(seqs), dtype, device))
    else:
        regions, row = (1, token_bytes) if layout == "interleaved" else (2 * layers, token_bytes // (2 * layers))
        for host_page in (64 << 10, 2 << 20):  # 64 KiB host pages, or 2 MiB where the mappings would not fit
            backend = vmm.make_backend(device.type if device.type == "cuda" else "host",
                                       None if device.type == "cuda" else host_page)
            pages = regions * sum(-(-c * row // backend.page_size) + 1 for _, c in seqs)
            limit = backend.max_mapped_pages()
            if device.type == "cuda" or limit is None or pages <= limit or host_page == 2 << 20:
                break
            print(f"  {layout}: {pages} pages of 64 KiB exceed the {limit} mappings this host allows "
                  f"(vm.max_map_count): 2 MiB pages instead")
            backend.close()
        kv = KVManager(VirtualLayout(cfg, layout, len(seqs), longest, dtype, backend, pages))
    for s, (_, c) in zip(held, seqs):
        kv.admit(s)
        assert kv.ensure_mapped(s, c)
    for s, (_, c) in zip(held, seqs):  # fill each sequence's rows, mapped ones only
        table, rows = kv.layout.block_table([s], [c])
        for cache in (kv.layout.k_caches[0], kv.layout.v_caches[0]):
            for i, block in enumerate(table[0]):
                n = min(rows, c - i * rows)
                cache[block, :n] = torch.randn(n, hkv, dim, dtype=dtype, device=device)
    table, rows = kv.layout.block_table(held, [c for _, c in seqs])
    return kv.layout.k_caches[:1], kv.layout.v_caches[:1], table, rows, kv


def batch_for(seqs, table, block_size, device) -> StepBatch:
    starts, row = [], 0
    for q_len, _ in seqs:
        starts.append(row)
        row += q_len
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)
    width = max(map(len, table))
    return StepBatch([None] * len(seqs), starts, [q for q, _ in seqs], [c for _, c in seqs],
                     torch.tensor([p for q, c in seqs for p in range(c - q, c)], device=device),
                     i32([i for i, (q, _) in enumerate(seqs) for _ in range(q)]), i32(starts), i32([q for q, _ in seqs]),
                     i32([c for _, c in seqs]), i32([0] + [s + q for s, (q, _) in zip(starts, seqs)]),
                     i32([t + [0] * (width - len(t)) for t in table]), block_size)


def timed(fn, repeats: int, device) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            start_s = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start_s)
    return statistics.median(samples)


def graph_samples(fn, repeats: int, calls: int = 20) -> list[float]:
    """Seconds per call of each of `repeats` runs of `calls` replays of fn captured in a CUDA
    graph (two warm-up calls first, outside the capture: kernels chosen, compiled, autotuned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return samples


def graph_time(fn, repeats: int, calls: int = 20) -> tuple[float | None, str | None]:
    """(seconds per call on the device alone, why not): the call captured in a CUDA graph and
    replayed `calls` times between two events, so the host's launch cost (which `timed` counts,
    as the engine meets it) drops out and what is left is the kernels' time."""
    try:
        return statistics.median(graph_samples(fn, repeats, calls)), None
    except Exception as exc:  # a call that syncs with the host cannot be captured: timed() alone then
        torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]


def copy_bandwidth(device) -> float:
    """Bytes per second of a 1 GiB copy (read + write) on the device."""
    src = torch.ones(256 << 20, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), 5, device)


def kernels_for(device, dtype, layout: str, dim: int) -> list[str]:
    names = ["native", "sdpa"] if device.type == "cpu" else ["flash-attn-4", "flash-attn", "flash", "sdpa"]
    usable = []
    for name in names:
        try:
            pick_attention(name, device, dtype, "paged" if layout == "paged" else "per_layer", dim)
            usable.append(name)
        except ValueError:
            pass
    return usable


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(7 * len(shapes), 4.8), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = [r for r in rows if r["shape"] == shape]
        labels = sorted({(r["case"], r["dtype"]) for r in mine})
        series = sorted({(r["kernel"], r["layout"]) for r in mine})
        width = 0.8 / len(series)
        for i, (kernel, layout) in enumerate(series):
            ms = [next((r.get("device_ms") or r["ms"] for r in mine if (r["case"], r["dtype"]) == lab
                        and r["kernel"] == kernel and r["layout"] == layout), 0) for lab in labels]
            ax.bar([j + i * width for j in range(len(labels))], ms, width, label=f"{kernel} {layout}")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
        ax.set_xticklabels([f"{c}\n{d}" for c, d in labels], fontsize=7)
        ax.set_yscale("log")
        captured = any(r.get("device_ms") for r in mine)
        ax.set_ylabel("ms per layer call" + (" (device time where captured)" if captured else ""))
        ax.set_title(shape)
        ax.legend(fontsize=6, ncol=2)
    m = result["machine"]
    fig.suptitle(f"attention per layer — {m.get('gpu') or m['processor']} ({m['cpu_count']} CPUs), torch {m['torch']}; "
                 f"copy bandwidth {result['copy_bandwidth_gb_s']:.0f} GB/s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--json", dest="json_path")
    p.add_argument("--plot", dest="plot_path")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtypes = (torch.float32, torch.bfloat16) if device.type == "cpu" else (torch.bfloat16,)
    torch.manual_seed(0)
    bandwidth, rows = copy_bandwidth(device), []
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        hq, hkv, dim, _ = shape
        for dtype in dtypes:
            cos_sin = rope_table(1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), 1024, dtype, device)
            for case, seqs in CASES.items():
                tokens = sum(q for q, _ in seqs)
                q, k, v = (torch.randn(tokens, h, dim, dtype=dtype, device=device) for h in (hq, hkv, hkv))
                kv_bytes = sum(c for _, c in seqs) * 2 * hkv * dim * q.element_size()
                for layout in LAYOUTS:
                    k_caches, v_caches, table, block_size, kv = build(layout, seqs, shape, dtype, device)
                    batch = batch_for(seqs, table, block_size, device)
                    for kernel in kernels_for(device, dtype, layout, dim):
                        attn = StepAttention(kernel, k_caches, v_caches, batch, cos_sin, paged=layout == "paged")
                        seconds = timed(lambda: attn(0, q, k, v), args.repeats, device)  # re-rotating is fine here
                        rows.append({"shape": shape_name, "dtype": str(dtype).removeprefix("torch."), "case": case,
                                     "layout": layout, "kernel": kernel, "ms": seconds * 1e3, "kv_bytes": kv_bytes,
                                     "share_of_copy_bandwidth": kv_bytes / seconds / bandwidth})
                        r = rows[-1]
                        if device.type == "cuda":  # the kernels alone, launch cost left out
                            on_device, why = graph_time(lambda: attn(0, q, k, v), args.repeats)
                            captured = on_device is not None
                            r.update(device_ms=on_device * 1e3 if captured else None, device_ms_unavailable=why,
                                     device_share_of_copy_bandwidth=(kv_bytes / on_device / bandwidth
                                                                     if captured else None))
                        alone = ""
                        if r.get("device_ms") is not None:
                            alone = (f"; kernels alone {r['device_ms']:.4f} ms "
                                     f"({100 * r['device_share_of_copy_bandwidth']:5.1f}%)")
                        elif r.get("device_ms_unavailable"):
                            alone = f"; no graph: {r['device_ms_unavailable']}"
                        print(f"{shape_name:13s} {r['dtype']:8s} {case:15s} {layout:11s} {kernel:12s} {r['ms']:9.3f} ms "
                              f"({100 * r['share_of_copy_bandwidth']:5.1f}% of copy bandwidth){alone}", flush=True)
                    if kv is not None:
                        kv.close()
    result = {"benchmark": "attention_layouts", "device": str(device), "copy_bandwidth_gb_s": bandwidth / 1e9,
              "machine": machine_info(), "rows": rows,
              "command": "python benchmarks/bench_attention.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    save(result, args.json_path, args.plot_path, plot)
    return result


if __name__ == "__main__":
    main()
