"""A Ray cluster of several nodes on this machine (a head and `ray start --address` nodes, each
with its own CPUs), started and stopped whole: for tests/serving/test_ray_serve.py and
benchmarks/bench_ray_router.py. Stopping kills only this cluster's processes (found by its
temporary directory and its port), never another Ray on the machine. A process that talks to the
cluster takes `env` (its address and its authentication token)."""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine.worker.parallel import free_port

RAY = str(Path(sys.executable).with_name("ray"))


class LocalRayCluster:
    def __init__(self, nodes: int = 2, cpus_per_node: int = 1, object_store_bytes: int = 100 << 20):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dir = tempfile.mkdtemp(prefix="vkvray-", dir="/tmp")  # short: Ray's socket paths live under it
        # Ray's token authentication, with a token of this cluster's own: `ray start` makes none
        # (a fresh machine has no ~/.ray/auth_token), and every process given self.env connects
        self.env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "RAY_USAGE_STATS_ENABLED": "0",
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(32)}
        small = ["--num-cpus", str(cpus_per_node), "--object-store-memory", str(object_store_bytes),
                 "--temp-dir", self.dir]
        try:
            self._ray("start", "--head", "--port", str(self.port), "--include-dashboard", "false",
                      "--disable-usage-stats", "--ray-client-server-port", str(free_port()), *small)
            for _ in range(nodes - 1):
                self._ray("start", "--address", self.address, *small)
        except BaseException:
            self.stop()
            raise

    def _ray(self, *args: str) -> None:
        done = subprocess.run([RAY, *args], env=self.env, capture_output=True, text=True, timeout=180)
        if done.returncode:
            raise RuntimeError(f"ray {' '.join(args[:2])} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")

    def _pids(self) -> set[int]:
        """This cluster's processes: those naming its directory or port, and their children."""
        parents, mine = {}, set()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
                parents[int(pid)] = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if self.dir.encode() in cmdline or f":{self.port}".encode() in cmdline:
                mine.add(int(pid))
        grew = True
        while grew:
            children = {pid for pid, parent in parents.items() if parent in mine} - mine
            mine |= children
            grew = bool(children)
        return mine - {os.getpid()}

    def stop(self) -> None:
        """TERM, then KILL what is left after 2 s (a throwaway cluster: some of Ray's processes
        outlive a TERM by 10 s and more, and nothing of this one is kept)."""
        for sig, grace in ((signal.SIGTERM, 2), (signal.SIGKILL, 10)):
            for pid in self._pids():
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            deadline = time.monotonic() + grace
            while self._pids() and time.monotonic() < deadline:
                time.sleep(0.2)
        shutil.rmtree(self.dir, ignore_errors=True)
