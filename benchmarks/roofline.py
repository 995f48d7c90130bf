"""The machine's limits, measured where the benchmark runs, and a model's cost per token.

    memory bandwidth   a STREAM triad (a = b + s*c) over arrays far larger than the caches, all
                       threads; bytes = 3 arrays (the write-allocate is not counted, as STREAM);
                       and reading alone (a sum over one such array), what decode does
    FMA peak           fp32 FMAs a second on every thread at once (ext's `fma_rate`: 12
                       independent chains per thread in the kernels' widest vector), measured:
                       computed from /proc/cpuinfo's clock and a count of FMA units it was 1.5x
                       too high on a Zen 4 (its cores boost past that clock, and a 512-bit FMA
                       takes both of its 256-bit units)
    best GEMM          oneDNN with packed weights (what the engine's projections run) at a large
                       shape, fp32 and bf16 (bf16 where this CPU runs it natively; else the plain
                       emulated matmul, for the record)

Bounds for a decoder model: single-stream decode reads every weight byte and the KV rows of its
context once per token, so tokens/s <= bandwidth / bytes per token; a large batch is bound by
FLOPs per token (2 per weight of every projection and the LM head, plus 4 x context x heads x
head_dim per layer for attention) against the FMA peak.
"""
from __future__ import annotations

import statistics
import time

import torch

import ext
from engine.models.huge_pages import onto_huge_pages


def stream_triad_gbps(mib: int = 256, repeats: int = 5) -> float:
    n = (mib << 20) // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best = min(best, time.perf_counter() - start)
    return 3 * n * 4 / best / 1e9


def footprint_mib(nbytes: int) -> int:
    """A probe's size for a decode step that streams nbytes: as many MiB (at least 64). A probe
    smaller than the step reads from a cache the step's weights do not fit: on this project's
    Intel Xeon (480 MiB of L3 as the VM reports it) read_gbps gave 57-59 GB/s at 64 MiB, 40-47 at
    128, 33-40 at 256 and 33.5-36 at 512 and 1,024, within a minute. Sized to the step, the probe
    and the step's streams meet the same caches."""
    return max(64, -(-nbytes // (1 << 20)))


def read_gbps(mib: int = 512, repeats: int = 5) -> float:
    """Read-only bandwidth, all threads: the dot product of two arrays far larger than the
    caches (what single-stream decode does to its weights; measured here above a sum's 30 GB/s
    and a max's 33), on the pages the engine's weights stream from: 2 MiB where the kernel
    allows them (engine/models/huge_pages.py), so no share of this bound exceeds it for the
    page size alone."""
    a, b = torch.rand((mib << 20) // 8), torch.rand((mib << 20) // 8)
    # b placed 640 KiB + 64 B past a power of two after a: on 2 MiB pages the caches would
    # otherwise index a[i] and b[i] alike (measured: 26.5 against 37 GB/s with the gap)
    onto_huge_pages([a, torch.empty((640 << 10) // 4 + 16), b])
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.dot(a, b)
        best = min(best, time.perf_counter() - start)
    return (mib << 20) / best / 1e9


def clock_ghz() -> float:
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
        return max(mhz) / 1e3 if mhz else 0.0
    except OSError:
        return 0.0


def fma_peak_gflops(iterations: int = 20_000_000, repeats: int = 5) -> dict:
    """The FMA peak as ext's `fma_rate` measures it on torch's threads: the median of `repeats`
    (each about 0.2 s on one core), with the spread."""
    if ext.cpu_kernels() is None:
        raise RuntimeError(f"the FMA peak is measured by the native kernels: {ext.cpu_kernels_error()}")
    rates = sorted(torch.ops.vkv.fma_rate(iterations) for _ in range(repeats))
    isa = torch.ops.vkv.isa()
    return {"gflops": statistics.median(rates), "range": [rates[0], rates[-1]], "cores": torch.get_num_threads(),
            "kernel_isa": isa, "cpuinfo_clock_ghz": clock_ghz(), "method": "measured: ext fma_rate"}


def gemm_gflops(dtype: torch.dtype, m: int = 512, k: int = 2048, n: int = 2048, repeats: int = 5) -> dict:
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 128)
        run, path = (lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")), "oneDNN packed"
    except RuntimeError:
        run, path = (lambda: x @ w.T), "torch matmul (no native bf16: emulated)"
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return {"gflops": 2 * m * k * n / best / 1e9, "path": path, "shape": [m, k, n]}


def machine_limits() -> dict:
    return {"stream_triad_gbps": stream_triad_gbps(), "fma_peak": fma_peak_gflops(),
            "gemm_fp32": gemm_gflops(torch.float32), "gemm_bf16": gemm_gflops(torch.bfloat16)}


def model_costs(cfg, weight_itemsize: int, kv_itemsize: int, context: int) -> dict:
    """Bytes read and FLOPs per generated token at `context` tokens of context, with weights read
    at weight_itemsize bytes each (what the GEMMs read) and K/V at kv_itemsize."""
    weights = sum(projection_weights(cfg))
    return {"bytes_per_token": weights * weight_itemsize + context * cfg.kv_bytes_per_token(kv_itemsize),
            "flops_per_token": 2 * weights + 4 * context * cfg.num_heads * cfg.head_dim * cfg.num_layers,
            "context": context}


def projection_weights(cfg) -> list[int]:
    """Weights of every GEMM of one token: per layer QKV, O, gate/up, down; then the LM head."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    per_layer = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h + 3 * h * i
    return [per_layer] * cfg.num_layers + [cfg.vocab_size * h]


def fractions(limits: dict, costs: dict, single_tok_per_s: float, batch_tok_per_s: float) -> dict:
    """Single stream against the bandwidth bound; batch (all tokens, prompt and output, per
    second) against the FMA peak and the best GEMM."""
    bandwidth = limits["stream_triad_gbps"] * 1e9
    batch_gflops = costs["flops_per_token"] * batch_tok_per_s / 1e9
    return {"single_bandwidth_bound_tok_per_s": bandwidth / costs["bytes_per_token"],
            "single_fraction_of_bandwidth_bound": single_tok_per_s * costs["bytes_per_token"] / bandwidth,
            "batch_gflops": batch_gflops,
            "batch_fraction_of_fma_peak": batch_gflops / limits["fma_peak"]["gflops"],
            "batch_fraction_of_best_gemm": batch_gflops / limits["gemm_fp32"]["gflops"]}
