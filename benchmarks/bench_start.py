"""How long a process of vkv takes to start: `LLM()` in a fresh interpreter, and `vkv serve` until its
/health first answers 200, the time a replica, a tensor-parallel rank or a restarted server is away.

    python benchmarks/bench_start.py --repeats 5 --baseline /tmp/before \\
        --json benchmarks/results/cpu/start.json --plot benchmarks/results/cpu/start.png

Each repeat starts a fresh process of each tree (this checkout and, with --baseline, another
checkout of vkv: `git worktree add /tmp/before <commit>`), alternating, one at a time, each on one
thread (OMP_NUM_THREADS=1, as replicas and the tests' children run). "llm": python -c "import
engine; LLM(model=...)", the whole process's wall time, interpreter start and imports included.
"serve": `vkv serve --model ...` from its start to its first 200 on /health. Both over the same
caches (the kernels built, the bundled GGUF converted and, from the first repeat on, what
$VKV_CACHE_DIR remembers): a later start, not a machine's first. Medians and ranges of the repeats.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, save  # noqa: E402
from engine.worker.parallel import free_port  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED = "bundled"  # --model bundled: the bundled GGUF, at each tree's defaults


def env(root: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}


def start_llm(root: str, model: str) -> float:
    began = time.perf_counter()
    spec = None if model == BUNDLED else model
    subprocess.run([sys.executable, "-c", f"from engine import LLM; LLM(model={spec!r}, kv_cache_memory=32 << 20)"],
                   env=env(root), cwd=root, check=True, capture_output=True)
    return time.perf_counter() - began


def start_serve(root: str, model: str, deadline: float = 300.0) -> float:
    port = free_port()
    began = time.perf_counter()
    named = [] if model == BUNDLED else ["--model", model]
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", *named, "--port", str(port),
                             "--kv-cache-memory", str(32 << 20), "--log-level", "warning"], env=env(root), cwd=root,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - began < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vkv serve in {root} exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - began
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        raise TimeoutError(f"vkv serve in {root} did not answer within {deadline} s")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:smollm2-kv",
                        help=f"the model each process loads ({BUNDLED!r}: the bundled GGUF, as each tree serves it by default)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", help="another checkout of vkv, alternated with this one")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args()
    trees = {"this": HERE, **({"baseline": os.path.abspath(args.baseline)} if args.baseline else {})}
    runs = {(tree, what): [] for tree in trees for what in ("llm", "serve")}
    for _ in range(args.repeats):
        for tree, root in trees.items():
            runs[(tree, "llm")].append(start_llm(root, args.model))
            runs[(tree, "serve")].append(start_serve(root, args.model))
    rows = [{"tree": tree, "commit": _commit(trees[tree]), "what": what, "median_s": statistics.median(times),
             "min_s": min(times), "max_s": max(times), "runs_s": times} for (tree, what), times in runs.items()]
    for row in rows:
        print(f"{row['tree']:>8} {row['commit']} {row['what']:>5}: {row['median_s']:.2f} s "
              f"({row['min_s']:.2f}-{row['max_s']:.2f})")
    result = {"benchmark": "start", "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
              "machine": machine_info(), "threads": 1, "model": args.model, "repeats": args.repeats, "rows": rows}
    save(result, args.json, args.plot, plot)


def _commit(root: str) -> str:
    done = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    labels = [f"{r['what']}\n{r['tree']} {r['commit']}" for r in rows]
    ax.bar(labels, [r["median_s"] for r in rows],
           yerr=[[r["median_s"] - r["min_s"] for r in rows], [r["max_s"] - r["median_s"] for r in rows]], capsize=4)
    ax.set_ylabel("seconds to start (median, range)")
    ax.set_title(f"{result['model']}, one thread, {result['repeats']} starts each")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
