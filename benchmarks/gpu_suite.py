"""Everything vkv measures on a GPU, in one call (never run on a GPU yet: no time is claimed).

    python benchmarks/gpu_suite.py --out benchmarks/results/<gpu-name>

  1. tests     the CUDA tests on the real driver: `pytest -m "cuda_emulated or gpu or contracts"`
               (the tests that run against the driver emulator elsewhere, and the attention
               contracts, whose test_the_real_kernels_on_cuda_give_what_sdpa_gives calls the
               real kernels on CUDA tensors there and skips elsewhere)
  2. mapping   page-mapping latency of the CUDA backend (create, map, set-access, unmap,
               release; batched runs) at 1, 2, 4 and 8 x the granularity: mapping.json / .png
  3. attention FlashAttention over virtual KV: decode and prefill, SmolLM2 and Llama-3-8B head
               shapes, contiguous vs per_layer vs interleaved vs block table, each kernel
               present, against a device-to-device copy measured in the same run:
               attention.json / .png
  4. e2e       offline throughput of random-weight Llama-3-8B (bf16) on ShareGPT requests,
               for each KV layout: throughput.json / .png
  5. swap      resuming a preempted sequence by swap (pinned host memory) vs recompute:
               swap.json / .png
  6. map_ahead page-mapping time exposed and hidden with the map-ahead worker, 2 MiB pages:
               map_ahead.json / .png
  7. handoff   a prompt's KV handed to another process's cache by mapping GPU pages exported
               by a pool owner (cuMemExportToShareableHandle) against restoring it from pinned
               host memory, 256 to 8,192 tokens: handoff.json / .png
Writes suite.json (device, driver, torch and CUDA versions, each part's outcome and time)
and prints a summary. Without a GPU it says so and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", required=True, help="directory for the JSON and PNG results")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: tests,mapping,attention,e2e,swap,"
                                                  "map_ahead,handoff")
    p.add_argument("--e2e-requests", type=int, default=256)
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_suite: no CUDA GPU here (torch.cuda.is_available() is False): nothing to measure", file=sys.stderr)
        sys.exit(2)
    from common import machine_info

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    parts, summary = {}, []

    def part(name: str, fn) -> None:
        if name in skip:
            return
        start = time.perf_counter()
        try:
            parts[name] = {"ok": True, **(fn() or {})}
        except Exception as exc:  # one part failing still leaves the others' results
            parts[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        parts[name]["seconds"] = time.perf_counter() - start
        summary.append(f"{name:10s} {'ok' if parts[name]['ok'] else 'FAILED'} in {parts[name]['seconds']:.0f} s"
                       + ("" if parts[name]["ok"] else f": {parts[name]['error'][:300]}"))
        print(summary[-1], flush=True)

    def tests():
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                               "cuda_emulated or gpu or contracts", "tests/"],
                              cwd=ROOT, capture_output=True, text=True)
        (out / "tests.txt").write_text(done.stdout + done.stderr)
        if done.returncode:
            raise RuntimeError(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:])
        return {"result": done.stdout.strip().splitlines()[-1]}

    def mapping():
        import bench_mapping
        r = bench_mapping.main(["--backend", "cuda", "--pages", "256", "--json", str(out / "mapping.json"),
                                "--plot", str(out / "mapping.png")])
        return {"median_us": {f"{run['page_size'] >> 20} MiB": {op: s["median_us"] for op, s in run["per_page"].items()}
                              for run in r["sweep"]}}

    def attention():
        import bench_attention
        r = bench_attention.main(["--device", "cuda", "--json", str(out / "attention.json"),
                                  "--plot", str(out / "attention.png")])
        best = {}
        for row in r["rows"]:
            key = f"{row['shape']} {row['case']} {row['layout']}"
            if row["kernel"] != "sdpa" and (key not in best or row["ms"] < best[key][1]):
                best[key] = (row["kernel"], row["ms"], row["share_of_copy_bandwidth"])
        return {"copy_bandwidth_gb_s": r["copy_bandwidth_gb_s"], "fastest": best}

    def e2e():
        import bench_throughput
        r = bench_throughput.main(["--model", "random:llama-3-8b", "--device", "cuda", "--dtype", "bfloat16",
                                   "--num-requests", str(args.e2e_requests), "--max-num-seqs", "128",
                                   "--kv-layout", "interleaved,per_layer,paged", "--no-hf",
                                   "--json", str(out / "throughput.json"), "--plot", str(out / "throughput.png")])
        return {r2["system"]: r2["output_tokens_per_s"] for r2 in r["runs"]}

    def swap():
        import bench_swap
        r = bench_swap.main(["--device", "cuda", "--dtype", "bfloat16", "--lengths", "64,512,2048", "--repeats", "2",
                             "--json", str(out / "swap.json"), "--plot", str(out / "swap.png")])
        return {row["prompt_tokens"]: (row["resume_swap_s"], row["resume_recompute_s"]) for row in r["rows"]}

    def map_ahead():
        import bench_map_ahead
        r = bench_map_ahead.main(["--device", "cuda", "--dtype", "bfloat16", "--page-sizes", "2097152",
                                  "--num", "64", "--max-tokens", "128", "--repeats", "1",
                                  "--json", str(out / "map_ahead.json"), "--plot", str(out / "map_ahead.png")])
        return {row["map_ahead_tokens"]: row["exposed_ms_per_step"] for row in r["rows"]}

    def handoff():
        import bench_handoff
        r = bench_handoff.main(["--backend", "cuda", "--repeats", "3", "--json", str(out / "handoff.json"),
                                "--plot", str(out / "handoff.png")])
        return {f"{row['layout']} {row['prompt_tokens']}": (row["mapping"]["seconds"], row["copy"]["seconds"])
                for row in r["rows"]}

    started = time.perf_counter()
    os.chdir(ROOT)
    part("tests", tests)
    part("mapping", mapping)
    part("attention", attention)
    part("e2e", e2e)
    part("swap", swap)
    part("map_ahead", map_ahead)
    part("handoff", handoff)
    result = {"suite": "gpu", "machine": machine_info(), "parts": parts, "seconds": time.perf_counter() - started,
              "command": "python benchmarks/gpu_suite.py " + " ".join(sys.argv[1:])}
    (out / "suite.json").write_text(json.dumps(result, indent=1))
    print(f"\nvkv GPU suite on {result['machine']['gpu']} (driver {result['machine'].get('cuda_driver')}, "
          f"CUDA {result['machine'].get('cuda_runtime')}, torch {result['machine']['torch']}) in "
          f"{result['seconds']:.0f} s:")
    print("\n".join(summary))
    sys.exit(0 if all(p["ok"] for p in parts.values()) else 1)


if __name__ == "__main__":
    main()
