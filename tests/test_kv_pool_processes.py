"""Engine processes over one physical KV pool (--kv-pool, vmm/owner.py): a prompt prefilled in
one process is not computed again in another, which maps the first one's pages in place; the
outputs equal a process of its own's; a process killed mid-life gives its pages back."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vmm import HostBackend, PoolOwner

HELPER = Path(__file__).with_name("engine_process.py")


def start(sock, layout, prompt):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(HELPER), sock, layout, json.dumps(prompt)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


def result(proc) -> dict:
    line = proc.stdout.readline()
    assert line, "the engine process died"
    return json.loads(line)


@pytest.mark.parametrize("layout", ["per_layer", "interleaved"])
def test_a_prefix_computed_in_one_process_is_mapped_in_another_and_outputs_equal(tmp_path, layout):
    owner = PoolOwner(HostBackend(64 << 10), 1024, str(tmp_path / "pool.sock")).start()
    prompt = random.Random(0).sample(range(100, 5000), 300)
    alone = start("-", layout, prompt)  # a process with a pool of its own: the reference
    first = start(owner.path, layout, prompt)
    procs = [alone, first]
    try:
        reference, a = result(alone), result(first)
        assert a["tokens"] == reference["tokens"] and a["imported"] == 0
        second = start(owner.path, layout, prompt)
        procs.append(second)
        b = result(second)
        assert b["tokens"] == reference["tokens"]
        assert b["imported"] > 0 and b["hits"] >= 255, b  # every whole page but the last token's: mapped, not computed
        owner.audit()
        killed = time.monotonic()
        os.kill(first.pid, signal.SIGKILL)
        while len(owner.held) > 1:
            assert time.monotonic() - killed < 1.0, "the killed process's references are still held"
            time.sleep(0.005)
        owner.audit()
        second.stdin.write("\n")
        second.stdin.flush()
        assert second.stdout.readline().strip() == "audited"  # its own count still equals its mappings
        second.wait(timeout=30)
        owner.audit()
        assert owner.stats()["held"] == {} and owner.pool.num_free + owner.stats()["cached"] == 1024
    finally:
        for p in procs:
            p.kill()
            p.wait()
        owner.stop()
