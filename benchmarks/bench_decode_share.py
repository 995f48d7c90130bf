"""Single-stream decode's share of the read bound, at each of the machine's bandwidth levels.

    python benchmarks/bench_decode_share.py --dtypes float32,bfloat16 --samples 40 \
        --json benchmarks/results/cpu/decode_share.json --plot benchmarks/results/cpu/decode_share.png

bench_vs_llamacpp.py takes decode's share over the mean of the probes around a 256-token run.
On this project's 2-core EPYC the read bandwidth sits at one of two levels, about 30-36 GB/s or
55-62, and switches within seconds, so one run's share mixes them. Here each sample is short:
a probe (roofline.read_gbps: a dot product of two arrays on 2 MiB pages, all threads), --tokens
greedy tokens decoded after a 4-token prompt (less a one-token request's time: the prompt's
prefill and the request's own costs), a probe (as many bytes as a step streams:
roofline.footprint_mib; --probe-mib sets another size). A sample counts when its two probes agree
within --steady, and falls in the level of their mean (split at --split GB/s). Its share: the
bytes a step streams over the step's time, over that mean. A step streams every projection's
panels and the LM head's, or with multi-step decode its half-size copy (the exact pick). The
engine is vkv's single-stream setup of bench_vs_llamacpp.py: --num-scheduler-steps 8, prefix
caching off, all threads. `--isa avx2` measures the AVX2 code paths (common.AVX2_ENV) on this
machine's memory. Run it alone.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import add_level_arguments, isa_label, machine_info, positive, run_as, save  # noqa: E402
from roofline import footprint_mib, read_gbps  # noqa: E402

import ext  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

PROMPT = [1, 504, 3458, 282]


def parse_dtypes(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """--dtypes as a list: float32 and bfloat16 only (the one-call decode path's)."""
    dtypes = text.split(",")
    if not set(dtypes) <= {"float32", "bfloat16"}:
        parser.error(f"--dtypes takes float32 and bfloat16, got {text!r}")
    return dtypes


@contextlib.contextmanager
def single_stream(dtype: str, steps: int):
    """vkv's single-stream engine (bench_vs_llamacpp.py's: prefix caching off, all threads); exits
    where the native kernels or the one-call decode path do not run."""
    if ext.cpu_kernels() is None:
        sys.exit(f"the native CPU kernels are unavailable: {ext.cpu_kernels_error()}")
    with LLM(dtype=dtype, quantization="dequantize", num_scheduler_steps=steps, enable_prefix_caching=False) as llm:
        if not llm.engine.model.decode:
            sys.exit(f"{dtype}: the one-call decode path does not run here ({llm.engine.model.gemm_path})")
        yield llm


def streamed_bytes(model) -> int:
    """What one decode step reads from memory: every projection's panels and the LM head's (its
    half-size copy where multi-step decode picks from it)."""
    head = model.lm_head
    layers = sum(t.nbytes for layer in model.decode for t in (layer[3], layer[5], layer[6], layer[7]))
    return layers + (head.pick if head.pick is not None else head.panels).nbytes


def timed(llm: LLM, params: SamplingParams) -> float:
    start = time.perf_counter()
    llm.generate([PROMPT], params, use_tqdm=False)
    return time.perf_counter() - start


def sample(llm: LLM, params: SamplingParams, tokens: int, nbytes: int, probe_mib: int) -> dict:
    """A sample: the decode steps' time, less the request's own costs (a one-token request, the
    prompt's prefill and its first token, timed right after)."""
    before = read_gbps(probe_mib, repeats=3)
    step = (timed(llm, params) - timed(llm, SamplingParams(temperature=0, max_tokens=1))) / tokens
    after = read_gbps(probe_mib, repeats=3)
    streamed = nbytes / step / 1e9
    return {"probe_before_gbps": before, "probe_after_gbps": after, "tok_s": 1 / step, "streamed_gbps": streamed,
            "share": streamed / ((before + after) / 2)}


def probe(s: dict) -> float:
    """A sample's bandwidth: the mean of its two probes."""
    return (s["probe_before_gbps"] + s["probe_after_gbps"]) / 2


def levels(samples: list[dict], split: float, steady: float) -> dict:
    kept = [s for s in samples if max(s["probe_before_gbps"], s["probe_after_gbps"])
            <= steady * min(s["probe_before_gbps"], s["probe_after_gbps"])]
    out = {}
    for name, inside in (("slow", lambda g: g < split), ("fast", lambda g: g >= split)):
        level = [s for s in kept if inside(probe(s))]
        out[name] = {"steady_samples": len(level)} | ({
            "probe_gbps": statistics.median(map(probe, level)),
            "streamed_gbps": statistics.median(s["streamed_gbps"] for s in level),
            "tok_s": statistics.median(s["tok_s"] for s in level),
            "share": statistics.median(s["share"] for s in level),
            "share_min": min(s["share"] for s in level), "share_max": max(s["share"] for s in level)} if level else {})
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    p.add_argument("--samples", type=positive, default=40, help="samples per dtype")
    p.add_argument("--tokens", type=positive, default=64, help="tokens decoded per sample")
    p.add_argument("--num-scheduler-steps", type=positive, default=8)
    p.add_argument("--steady", type=float, default=1.1, help="a sample's larger probe over its smaller, at most")
    p.add_argument("--probe-mib", type=positive, default=None,
                   help="the probe's size (default: as many MiB as a step streams, roofline.footprint_mib)")
    add_level_arguments(p)
    args = p.parse_args(argv)
    dtypes = parse_dtypes(p, args.dtypes)
    if args.steady < 1:
        p.error(f"--steady is a ratio of two probes, at least 1, got {args.steady}")
    run_as(args.isa, __file__, argv)
    rows = []
    for dtype in dtypes:
        with single_stream(dtype, args.num_scheduler_steps) as llm:
            model = llm.engine.model
            nbytes = streamed_bytes(model)
            probe_mib = args.probe_mib or footprint_mib(nbytes)
            params = SamplingParams(temperature=0, max_tokens=args.tokens + 1, ignore_eos=True)
            sample(llm, params, args.tokens, nbytes, probe_mib)  # first-call costs, not kept
            samples = []
            for i in range(args.samples):
                samples.append(sample(llm, params, args.tokens, nbytes, probe_mib))
                print(f"[bench] {dtype} {i + 1}/{args.samples}: probes {samples[-1]['probe_before_gbps']:.1f} / "
                      f"{samples[-1]['probe_after_gbps']:.1f} GB/s, decode {samples[-1]['streamed_gbps']:.1f} GB/s "
                      f"({samples[-1]['share'] * 100:.1f}%)", flush=True)
            row = {"dtype": dtype, "bytes_per_token": nbytes, "probe_mib": probe_mib, "gemm_path": model.gemm_path,
                   "levels": levels(samples, args.split, args.steady), "samples": samples}
        rows.append(row)
        for name, level in row["levels"].items():
            if level["steady_samples"]:
                print(f"{dtype}, {name} level ({level['steady_samples']} steady samples, probe {level['probe_gbps']:.1f} GB/s): "
                      f"decode streams {level['streamed_gbps']:.1f} GB/s, {level['share'] * 100:.1f}% of the bound "
                      f"({level['share_min'] * 100:.1f}-{level['share_max'] * 100:.1f})", flush=True)
    result = {"benchmark": "decode_share", "machine": machine_info(),
              "command": "python benchmarks/bench_decode_share.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "kernel_isa": ext.kernel_isa()[0], "threads": torch.get_num_threads(),
              "isa": isa_label(args.isa),
              "num_scheduler_steps": args.num_scheduler_steps, "tokens": args.tokens, "split_gbps": args.split,
              "steady": args.steady, "rows": rows}
    save(result, args.json, args.plot, plot)
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, row in enumerate(result["rows"]):
        ax.scatter([probe(s) for s in row["samples"]], [s["streamed_gbps"] for s in row["samples"]], color=f"C{i}", s=14,
                   label=f"{row['dtype']} ({row['bytes_per_token'] / 1e6:.0f} MB a token)")
    top = max(max(s["probe_before_gbps"], s["probe_after_gbps"]) for row in result["rows"] for s in row["samples"])
    ax.plot([0, top], [0, top], "k-", lw=0.8, label="the bound")
    ax.plot([0, top], [0, 0.85 * top], "k--", lw=0.8, label="85% of it")
    ax.axvline(result["split_gbps"], color="grey", lw=0.6, ls=":")
    ax.set_xlabel("read bandwidth probed around the sample (GB/s)")
    ax.set_ylabel("decode's weight streaming (GB/s)")
    ax.legend(fontsize=8)
    m = result["machine"]
    ax.set_title(f"vkv single-stream decode against the read bound, {result['tokens']} tokens a sample, "
                 f"{result['threads']} threads\n{m.get('cpu_model', '')}, kernels {result['kernel_isa']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
