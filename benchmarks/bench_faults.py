"""Replicas and the shared pool under faults: real processes, real signals, a seeded schedule.

Part one: `vkv serve -dp 2 --prefill-ranks 1` under a steady load of clients (streamed and whole
answers, short prompts), while a schedule drawn from --seed stops the decode or the prefill
replica (SIGSTOP for a few seconds, then SIGCONT if it still lives) or kills one (SIGKILL), one
fault every --fault-every seconds. Measured against the goals of issue 66:
  - requests that waited past their deadline (--request-timeout, plus a second): goal 0
  - requests lost before they streamed while a replica able to serve them was up: goal 0
    (every request that failed without having streamed counts, whatever the state)
  - streams cut under way (an error event ends them: said, not silent)
  - /health's lag: from a fault to /health saying so, and from the replica's return to /health
    200 again (goal: under 2 s)
  - processes and pool directories left after the front door stops: goal none
Part two: a standalone `vkv pool-owner` and `vkv serve --kv-pool` under load; the owner killed
(-9) --owner-kills times; each time the engine must exit (status 3) and, started again beside a
new owner as a supervisor would, serve again: the seconds from the kill to the first answer
(goal: under 10 s).

    .venv/bin/python benchmarks/bench_faults.py --seconds 90 --json benchmarks/results/cpu/faults.json \\
        --plot benchmarks/results/cpu/faults.png

Run it alone (2 cores: any other load slows the replicas' restarts, which the figures include).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import machine_info, save  # noqa: E402

from engine.worker.parallel import free_port  # noqa: E402

KEY = "sk-faults"
MODEL = ["--model", "random:smollm2-kv", "--max-model-len", "512", "--log-level", "warning"]
ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(open(f"/proc/{entry}/stat").read().split(")")[1].split()[1]) == pid:
                found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def rank_pids(front: int) -> dict[int, int]:
    pids = {}
    for pid in children(front):
        try:
            title = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if (found := re.search(r"vkv: rank (\d+)", title)) or (found := re.search(r"--replica-rank (\d+)", title)):
            pids[int(found.group(1))] = pid  # (titled for ps once it runs; its command line before)
    return pids


def healthy(url: str) -> int | None:
    return health_of(url)[0]


def health_of(url: str) -> tuple[int | None, list[int]]:
    """/health's status and the replicas it says are up."""
    try:
        answer = httpx.get(url + "/health", timeout=1)
        return answer.status_code, answer.json().get("replicas_up", [])
    except (httpx.HTTPError, ValueError):
        return None, []


def client(url: str, rng: random.Random, stop: threading.Event, deadline: float, log: list, began: float) -> None:
    while not stop.is_set():
        stream = rng.random() < 0.5
        body = {"prompt": rng.sample(range(100, 5000), rng.randint(20, 200)), "max_tokens": 16, "ignore_eos": True,
                "temperature": 0, "stream": stream}
        start, streamed, status, error = time.monotonic(), False, None, None
        try:
            if stream:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=deadline,
                                  headers={"authorization": f"Bearer {KEY}"}) as r:
                    status = r.status_code
                    if status != 200:
                        error = json.loads(r.read()).get("error", {}).get("message", "")[:120]
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            event = json.loads(line[6:])
                            if "error" in event:
                                error = "cut" if streamed else event["error"]["message"]
                            else:
                                streamed = True
            else:
                r = httpx.post(url + "/v1/completions", json=body, timeout=deadline,
                               headers={"authorization": f"Bearer {KEY}"})
                status = r.status_code
                if status != 200:
                    error = r.json().get("error", {}).get("message", r.text)[:120]
        except httpx.HTTPError as exc:
            error = f"client: {type(exc).__name__}"
        log.append({"t": start - began, "seconds": time.monotonic() - start, "stream": stream, "status": status,
                    "streamed": streamed, "error": error})


def part_one(args, rng: random.Random) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "vkv-pool-*")))
    front = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", *MODEL, "--port", str(port),
                              "--api-key", KEY, "-dp", "2", "--prefill-ranks", "1", "--replica-hang-seconds",
                              str(args.hang), "--request-timeout", str(args.request_timeout)], env=ENV)
    deadline = time.monotonic() + 300
    while healthy(url) != 200:
        if time.monotonic() > deadline or front.poll() is not None:
            raise SystemExit("the front door did not come up")
        time.sleep(0.5)
    began, stop, requests, health, faults = time.monotonic(), threading.Event(), [], [], []
    clients = [threading.Thread(target=client, args=(url, random.Random(rng.random()), stop,
                                                     args.request_timeout + 5, requests, began))
               for _ in range(args.clients)]

    def watch():
        while not stop.is_set():
            health.append((time.monotonic() - began, *health_of(url)))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    for thread in (*clients, watcher):
        thread.start()
    try:
        while time.monotonic() - began < args.seconds:
            time.sleep(args.fault_every * rng.uniform(0.7, 1.3))
            kind, rank = rng.choice(("stop", "stop", "kill")), rng.choice((0, 1))
            pid = rank_pids(front.pid).get(rank)
            if pid is None:
                continue
            at = time.monotonic() - began
            if kind == "kill":
                os.kill(pid, signal.SIGKILL)
                faults.append({"t": at, "kind": "kill", "rank": rank})
            else:
                os.kill(pid, signal.SIGSTOP)
                held = rng.uniform(1.0, 2 * args.hang)
                time.sleep(held)
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                faults.append({"t": at, "kind": "stop", "rank": rank, "held": held})
    finally:
        stop.set()
        for thread in (*clients, watcher):
            thread.join(timeout=args.request_timeout + 10)
        pids = [*children(front.pid), front.pid]
        front.send_signal(signal.SIGTERM)
        front.wait(timeout=60)
        time.sleep(1.0)
    left = [p for p in pids if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split(")")[1].split()[0]
            != "Z"]
    dirs = sorted(set(glob.glob(os.path.join(tempfile.gettempdir(), "vkv-pool-*"))) - before)
    for fault in faults:  # /health's lag: the first 503 after the fault, then the first 200 after that
        after = [(t, s) for t, s, _ in health if t >= fault["t"]]
        down = next((t for t, s in after if s != 200), None)
        fault["health_down_lag"] = None if down is None else down - fault["t"]
        back = next((t for t, s in after if down is not None and t > down and s == 200), None)
        fault["health_back_at"] = back
    lags = [f["health_down_lag"] for f in faults if f["health_down_lag"] is not None]
    failed_unstreamed = [r for r in requests if r["error"] and not r["streamed"]]

    def up_at(t: float) -> list[int]:  # the replicas /health said were up at t (its sample before)
        before = [up for at, _, up in health if at <= t]
        return before[-1] if before else []

    # a replica able to serve it up through its whole time (any replica serves a whole request)
    served_around = [r for r in failed_unstreamed if up_at(r["t"]) and up_at(r["t"] + r["seconds"])]
    return {"requests": len(requests), "ok": sum(not r["error"] and r["status"] == 200 for r in requests),
            "lost_before_streaming": len(failed_unstreamed),
            "lost_while_a_replica_was_up": len(served_around),
            "streams_cut": sum(r["error"] == "cut" for r in requests),
            "waited_past_deadline": sum(r["seconds"] > args.request_timeout + 1 for r in requests),
            "longest_request_seconds": max((r["seconds"] for r in requests), default=0),
            "health_down_lag_seconds": {"median": statistics.median(lags) if lags else None,
                                        "max": max(lags) if lags else None, "n": len(lags)},
            "faults": faults, "processes_left": left, "pool_dirs_left": dirs, "lost_while_up_examples":
                [(round(r["t"], 2), r["error"]) for r in served_around[:10]], "timeline": requests, "health": health}


def part_two(args) -> dict:
    recoveries = []
    with tempfile.TemporaryDirectory() as where:
        path, port = os.path.join(where, "pool.sock"), free_port()
        url = f"http://127.0.0.1:{port}"

        def start_owner():
            proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "pool-owner", "--socket", path,
                                     "--kv-cache-memory", str(64 << 20)], env=ENV)
            end = time.monotonic() + 30
            while not os.path.exists(path) and time.monotonic() < end:
                time.sleep(0.05)
            return proc

        def start_engine():
            return subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", *MODEL, "--kv-pool", path,
                                     "--port", str(port), "--api-key", KEY], env=ENV)

        owner, engine = start_owner(), start_engine()
        statuses = []
        try:
            while healthy(url) != 200:
                time.sleep(0.2)
            for _ in range(args.owner_kills):
                time.sleep(1.0)
                owner.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                owner.wait()
                statuses.append(engine.wait(timeout=30))
                exited = time.monotonic() - killed
                owner, engine = start_owner(), start_engine()  # the supervisor's part
                while True:
                    try:
                        r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2},
                                       headers={"authorization": f"Bearer {KEY}"}, timeout=5)
                        if r.status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.1)
                recoveries.append({"engine_exited_seconds": exited, "serving_again_seconds": time.monotonic() - killed})
        finally:
            for proc in (engine, owner):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=30)
    again = [r["serving_again_seconds"] for r in recoveries]
    return {"kills": recoveries, "engine_exit_statuses": statuses,
            "serving_again_seconds": {"median": statistics.median(again), "min": min(again), "max": max(again)}}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    one = result["replicas"]
    fig, (ax, hx) = plt.subplots(2, 1, figsize=(10, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for r in one["timeline"]:
        color = "tab:green" if not r["error"] else ("tab:orange" if r["error"] == "cut" else "tab:red")
        ax.plot([r["t"], r["t"] + r["seconds"]], [r["seconds"]] * 2, color=color, lw=1)
    for f in one["faults"]:
        for a in (ax, hx):
            a.axvline(f["t"], color="black" if f["kind"] == "kill" else "tab:purple", ls="--", lw=0.8)
    ax.set_ylabel("request seconds (green ok, orange stream cut, red failed)")
    hx.step([t for t, _, _ in one["health"]], [len(up) for _, _, up in one["health"]], where="post")
    hx.set_ylabel("replicas up")
    hx.set_xlabel("seconds (dashed: black SIGKILL, purple SIGSTOP)")
    fig.suptitle(f"vkv -dp 2 --prefill-ranks 1 under faults: {one['requests']} requests, "
                 f"{one['lost_while_a_replica_was_up']} lost while a replica was up, "
                 f"{one['waited_past_deadline']} past deadline")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=90)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--fault-every", type=float, default=10.0)
    p.add_argument("--hang", type=float, default=3.0, help="--replica-hang-seconds of the front door")
    p.add_argument("--request-timeout", type=float, default=30.0)
    p.add_argument("--owner-kills", type=int, default=3)
    p.add_argument("--seed", type=int, default=None, help="the fault schedule's seed (default: drawn and recorded)")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    print(f"[bench_faults] seed {seed}", flush=True)
    result = {"benchmark": "faults", "seed": seed, "machine": machine_info(),
              "command": "benchmarks/bench_faults.py " + " ".join(sys.argv[1:]),
              "settings": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
              "replicas": part_one(args, random.Random(seed)), "owner": part_two(args)}
    one = result["replicas"]
    print(json.dumps({k: v for k, v in one.items() if k not in ("timeline", "health", "faults")}, indent=1))
    print(json.dumps(result["owner"], indent=1))
    save(result, args.json, args.plot, plot)


if __name__ == "__main__":
    main()
