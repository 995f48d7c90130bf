"""`vkv serve --data-parallel-size 2 --prefill-ranks 1`: two engine processes over one KV pool
behind one front door (engine/serving/dp/replicas.py). A prompt prefilled by one replica is decoded
by the other, which maps its pages (nothing copied, one token computed again); a prefix computed on one replica is a hit on
the other; outputs equal one process's; bad pins are refused by name; a replica killed with
SIGKILL is restarted and its pool references come back."""
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.worker.parallel import free_port
from engine.top import render, scrape
import helpers
from helpers import child_env, wait_until

KEY = "sk-front"
MODEL = ["--model", "random:smollm2-kv", "--kv-cache-memory", str(32 << 20), "--max-model-len", "512"]


def metric(text: str, name: str, rank: int | None = None) -> float:
    label = f'{{rank="{rank}"}}' if rank is not None else ""
    found = re.search(rf"^{re.escape(name + label)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def replica_pids(front: subprocess.Popen) -> dict[int, int]:
    pids = {}
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and open(f"/proc/{pid}/stat").read().split(")")[1].split()[1] == str(front.pid):
                title = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
                if found := re.search(r"vkv: rank (\d+)", title):
                    pids[int(found.group(1))] = int(pid)
        except OSError:
            continue
    return pids


@contextlib.contextmanager
def front_door(model: list[str], ready_seconds: float):
    """`vkv serve -dp 2 --prefill-ranks 1` over `model`: (its URL, its process) once it answers;
    stopped with SIGTERM after, and no replica outlives it."""
    port = free_port()
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", *model, "--port", str(port), "--api-key", KEY,
                             "--data-parallel-size", "2", "--prefill-ranks", "1", "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is None and _up(url), ready_seconds, "the front door answers")
        yield url, proc
    finally:
        replicas = replica_pids(proc)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        # no replica outlives its front door (they held 12 GB here once, orphaned)
        wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in replicas.values()), 30,
                   "the replicas exit with their front door")


@pytest.fixture(scope="module")
def front():
    with front_door(MODEL, 240) as running:
        yield running


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).json().get("replicas_up") == [0, 1]
    except (httpx.HTTPError, ValueError):
        return False


def complete(url: str, prompt: list[int], rank: int | None = None, max_tokens: int = 8) -> httpx.Response:
    return helpers.complete(url, prompt, key=KEY, headers={"x-data-parallel-rank": str(rank)} if rank is not None else {},
                            timeout=120, max_tokens=max_tokens)


def test_replicas_hand_prompts_over_by_mapping_share_prefixes_and_survive_a_kill(front):
    url, proc = front
    prompts = [random.Random(i).sample(range(100, 5000), 300) for i in range(2)]
    alone = LLM(model="random:smollm2-kv", kv_cache_memory=32 << 20, max_model_len=512)
    expected = [o.outputs[0].text for o in alone.generate(prompts, SamplingParams(temperature=0, max_tokens=8))]
    auth = {"authorization": f"Bearer {KEY}"}

    assert sorted(replica_pids(proc)) == [0, 1]  # each titled for ps
    # prefill on rank 0, decode on rank 1 over rank 0's pages
    first = complete(url, prompts[0])
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["text"] == expected[0]
    text = httpx.get(url + "/metrics", headers=auth).text
    # the decode replica mapped every page (the last one taken whole), copied none, computed one token
    assert metric(text, "vkv:kv_handoff_pages_total") > 0 and metric(text, "vkv:kv_handoff_bytes_copied_total") == 0
    assert metric(text, "vkv:prefix_cache_queries_total", 1) - metric(text, "vkv:prefix_cache_hits_total", 1) == 1
    # a prefix computed on one replica is mapped by the other: prefilled on rank 0, decoded on rank 1
    before = metric(httpx.get(url + "/metrics", headers=auth).text, "vkv:prefix_cache_imported_pages_total", 1)
    assert complete(url, prompts[1]).json()["choices"][0]["text"] == expected[1]
    after = metric(httpx.get(url + "/metrics", headers=auth).text, "vkv:prefix_cache_imported_pages_total", 1)
    assert after > before
    assert complete(url, prompts[1], rank=1).json()["choices"][0]["text"] == expected[1]
    view = render(scrape(url, KEY), url)  # vkv top: the shared pool, a row per replica
    assert "pool: 512 pages" in view and "rank 0" in view and "rank 1" in view, view
    # bad pins and keys, by name, in our words
    for pin in ("2", "-1", "one", "9" * 5000):
        bad = complete(url, prompts[0], rank=pin)
        assert bad.status_code == 400 and "X-data-parallel-rank must be a replica's number" in bad.text, bad.text
    twice = httpx.post(url + "/v1/completions", headers=[("authorization", f"Bearer {KEY}"),
                                                          ("x-data-parallel-rank", "1"), ("x-data-parallel-rank", "1")],
                       json={"prompt": prompts[0], "max_tokens": 2})
    assert twice.status_code == 400 and "sent 2 times" in twice.text
    prefill_only = complete(url, prompts[0], rank=0)  # it only prefills: it cannot answer a whole request
    assert prefill_only.status_code == 400 and "replica 0 only prefills" in prefill_only.text
    assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.get(url + "/metrics").status_code == 401
    # a replica killed mid-request: that request ends with a clear error, pinned requests to it are
    # refused by name until it is back, and the pages it held come back to the pool
    pids, answers = replica_pids(proc), []
    long = threading.Thread(target=lambda: answers.append(complete(url, prompts[0], rank=1, max_tokens=200)))
    long.start()
    wait_until(lambda: metric(httpx.get(url + "/metrics", headers=auth).text, "vkv:num_requests_running", 1), 30,
               "the long request runs on rank 1")
    os.kill(pids[1], signal.SIGKILL)
    long.join(timeout=60)
    assert answers[0].status_code == 503 and "replica 1" in answers[0].json()["error"]["message"]
    down = complete(url, prompts[0], rank=1)
    assert down.status_code == 503 and "replica 1 is down" in down.json()["error"]["message"]
    assert int(down.headers["retry-after"]) >= 1
    wait_until(lambda: _up(url), 240, "rank 1 restarted")
    assert complete(url, prompts[0]).json()["choices"][0]["text"] == expected[0]
    text = httpx.get(url + "/metrics", headers=auth).text
    assert metric(text, "vkv:replica_restarts_total") == 1 and metric(text, "vkv:pool_pages_recovered_total") > 0
    assert metric(text, "vkv:pool_processes") == 2


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_replicas_on_one_gpu_hand_prompts_over_by_mapping_its_exported_pages():
    """`-dp 2 --prefill-ranks 1 --device cuda`: the front door creates the GPU's pages shareable,
    each replica imports them; a prompt prefilled on rank 0 is decoded on rank 1 from the same
    physical pages (one token computed again, nothing copied) and equals one engine's output."""
    gpu = ["--model", "random:smollm2-kv", "--device", "cuda", "--kv-cache-memory", str(256 << 20),
           "--max-model-len", "512", "--kv-layout", "interleaved"]
    with front_door(gpu, 300) as (url, _):
        prompt = random.Random(0).sample(range(100, 5000), 300)
        alone = LLM(model="random:smollm2-kv", device="cuda", kv_cache_memory=256 << 20, max_model_len=512,
                    kv_layout="interleaved")
        expected = alone.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
        answer = complete(url, prompt)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected, answer.text
        text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {KEY}"}).text
        assert metric(text, "vkv:kv_handoff_pages_total") > 0 and metric(text, "vkv:kv_handoff_bytes_copied_total") == 0
        assert metric(text, "vkv:prefix_cache_queries_total", 1) - metric(text, "vkv:prefix_cache_hits_total", 1) == 1
