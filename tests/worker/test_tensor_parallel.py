"""Tensor parallelism over torch.distributed (gloo) on the CPU: greedy output identical to one
rank on every layout, with prefix caching, forks, preemption (recompute and swap) and sleep;
every rank's page pool in lockstep with rank 0's; 1/N of the KV bytes per rank; a dead worker
fails the step instead of hanging; the server works with N > 1."""
import asyncio

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.worker.parallel import pool_state
from engine.serving.loop.async_engine import AsyncEngine
from engine.serving.api.server import build_app
from helpers import NARROW, assert_pool_whole
from lossy import prompt_scores

SHARED = "You are a terse assistant. Answer in one short sentence. Question: "
PROMPTS = [SHARED + q for q in ("What is the capital of France?", "Why is the sky blue?", "What is rain?")]
GREEDY = SamplingParams(temperature=0, max_tokens=12, n=2)


def tokens(outs) -> list:
    return [[c.token_ids for c in o.outputs] for o in outs]


def assert_in_lockstep(llm: LLM) -> None:
    """Every worker's pool equals rank 0's page for page, and audits whole."""
    kv = llm.engine.kv
    kv.audit()
    llm.engine.sync_workers()  # the calls made since the last step (commits, releases) first
    mine = pool_state(kv)
    assert all(state == mine for state in llm.engine.workers.pool_states())


@pytest.fixture(scope="module")
def reference():
    one = LLM(model=NARROW, kv_cache_memory=64 << 20)
    outs = tokens(one.generate(PROMPTS, GREEDY, use_tqdm=False))
    one.engine.close()
    return outs


# Per rank: interleaved 14 pages of 64 KiB (4 tokens each), per_layer 180 (3 per region), paged
# 10 blocks of 16 tokens: two or three of the six sequences at a time.
BUDGET_PER_RANK = {"interleaved": 14 * 65536, "per_layer": 180 * 65536, "paged": 10 * 16 * 15360}


@pytest.mark.parametrize("kv_layout", ["interleaved", "per_layer", "paged"])
def test_three_ranks_equal_one_rank(kv_layout, reference):
    # SmolLM2's 9 query heads, 3 KV heads: three query heads and one KV head per rank.
    llm = LLM(model=NARROW, tensor_parallel_size=3, kv_layout=kv_layout, kv_cache_memory=3 * BUDGET_PER_RANK[kv_layout],
              max_num_seqs=4)
    try:
        kv = llm.engine.kv
        assert kv.layout.token_bytes * 3 == 2 * 30 * 3 * 64 * 4  # 1/N of every token's K/V (fp32)
        assert kv.pool.num_pages * kv.pool.page_size <= BUDGET_PER_RANK[kv_layout]
        engine = llm.engine
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, GREEDY, group="one client")  # one caller: no seat sharing
        done, steps = {}, 0
        while engine.has_unfinished():
            done |= {o.request_id: o for o in engine.step() if o.finished}
            steps += 1
            if steps % 7 == 0:
                assert_in_lockstep(llm)
        assert tokens([done[str(i)] for i in range(3)]) == reference
        stats = llm.stats()
        assert stats.kv.cow_copies > 0, stats  # n=2: the forks' first writes copy the prompt's last page
        if kv_layout == "interleaved":
            assert stats.preemptions > 0 and stats.kv.prefix_cache_hits > 0, stats
        assert_pool_whole(llm)
        assert_in_lockstep(llm)
    finally:
        llm.engine.close()


def test_two_ranks_swap_and_sleep_in_lockstep():
    # random:tiny: 4 query heads, 2 KV heads, MLP 128 wide; random weights, same on every rank.
    # Per rank 5 pages of 16 tokens: two of these 38-token sequences at a time, then swapping.
    config = dict(model="random:tiny", kv_layout="interleaved", kv_cache_memory=2 * 5 * 4096, page_size=4096,
                  max_num_seqs=4)
    prompts = [[5 + i, 17, 300 + i, 41, 9, 1000 + 3 * i] * 3 for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)  # admitted without the cached prefix
    one = LLM(**config | {"kv_cache_memory": 1 << 20})
    want = tokens(one.generate(prompts, greedy, use_tqdm=False))
    want_scores = prompt_scores(one.generate(prompts[0], scored, use_tqdm=False)[0])
    one.engine.close()
    two = LLM(tensor_parallel_size=2, preemption_mode="swap", swap_space=0.01, **config)
    try:
        two.engine.scheduler.swap_min_tokens = 1
        assert tokens(two.generate(prompts, greedy, use_tqdm=False)) == want
        assert two.stats().kv.swap_ins > 0
        assert_in_lockstep(two)
        two.sleep()
        assert_in_lockstep(two)
        two.wake_up()
        assert tokens(two.generate(prompts[:1], greedy, use_tqdm=False)) == want[:1]
        got = prompt_scores(two.generate(prompts[0], scored, use_tqdm=False)[0])
        assert got == pytest.approx(want_scores, abs=1e-4)
        assert_pool_whole(two)
        assert_in_lockstep(two)
    finally:
        two.engine.close()


def test_sizes_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="must divide the model's attention heads"):
        LLM(tensor_parallel_size=2)  # SmolLM2 has 9 query heads


def test_a_dead_worker_fails_the_step_and_the_server_reports_unhealthy():
    engine = AsyncEngine(LLMEngine(EngineConfig(model="random:tiny", tensor_parallel_size=2,
                                                kv_cache_memory=1 << 20, page_size=4096)))
    app = build_app(engine, "tiny")
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "ignore_eos": True}

    async def request():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://vkv") as c:
            return await c.post("/v1/completions", json=body), await c.get("/health")

    try:
        ok, health = asyncio.run(request())
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) > 0 and health.status_code == 200
        worker = engine.engine.workers.procs[0].proc
        worker.kill()
        worker.wait(timeout=10)
        failed, health = asyncio.run(request())
        assert failed.status_code in (500, 503) and health.status_code == 503
        assert isinstance(engine.dead.__cause__ or engine.dead, Exception)
        assert "worker" in str(engine.dead)
    finally:
        engine.shutdown()
    assert all(w.proc.poll() is not None for w in engine.engine.workers.procs)


DRIVER = """
from engine import LLM, SamplingParams
two = LLM(model="random:tiny", kv_cache_memory=1 << 20, page_size=4096, tensor_parallel_size=2)
outs = two.generate([[5, 17, 300, 41]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
print("tokens", outs[0].outputs[0].token_ids)
two.close()
"""


def test_a_script_on_standard_input_without_a_main_guard_runs_tensor_parallel():
    """Workers are fresh interpreters running the engine's own entry point, so a driver with no
    main module to re-import (python - <<EOF, no `if __name__ == "__main__"`) works."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-"], input=DRIVER, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    one = LLM(model="random:tiny", kv_cache_memory=1 << 20, page_size=4096)
    want = one.generate([[5, 17, 300, 41]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    one.close()
    assert f"tokens {want}" in done.stdout


def test_a_worker_that_dies_at_start_up_fails_the_engine_at_once_with_its_own_error(tmp_path):
    import os
    import subprocess
    import sys
    import time

    (tmp_path / "sitecustomize.py").write_text(  # only in the workers' fresh interpreters
        "import sys\n"
        "if sys.orig_argv[1:3] == ['-m', 'engine.worker.parallel']:\n"
        "    raise SystemExit('simulated worker start-up failure: no such device')\n")
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-"], input=DRIVER, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert "WorkerDied" in done.stderr and "simulated worker start-up failure" in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - start < 30  # not the rendezvous timeout (60 s)


def test_a_worker_started_by_the_cli_joins_an_external_rendezvous():
    # The multi-host way: rank 0 waits at --distributed-init; rank 1 is `vkv tp-worker` with the
    # same engine flags (here on this host, over TCP).
    import subprocess
    import sys

    from engine.worker.parallel import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    flags = ["--model", "random:tiny", "--kv-cache-memory", str(1 << 20), "--page-size", "4096",
             "--tensor-parallel-size", "2", "--distributed-init", init, "--tensor-parallel-workers", "external"]
    worker = subprocess.Popen([sys.executable, "-c", "from engine.cli import main; main()", "tp-worker", "--rank", "1",
                               *flags])
    prompts = [[5, 17, 300, 41, 9, 1000], [6, 18, 301, 42]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    try:
        two = LLM(model="random:tiny", kv_cache_memory=1 << 20, page_size=4096, tensor_parallel_size=2,
                  distributed_init=init, tensor_parallel_workers="external")
        got = tokens(two.generate(prompts, greedy, use_tqdm=False))
        assert_in_lockstep(two)
        two.engine.close()
        assert worker.wait(timeout=30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    one = LLM(model="random:tiny", kv_cache_memory=1 << 20, page_size=4096)
    assert got == tokens(one.generate(prompts, greedy, use_tqdm=False))
    one.engine.close()


def test_a_worker_started_with_other_flags_is_refused_by_name():
    """A `vkv tp-worker` with another --model-seed (other random weights) computed other tokens without
    a word; the ranks now compare their settings and weights' fingerprints at the rendezvous."""
    import subprocess
    import sys

    from engine.worker.parallel import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    flags = ["--model", "random:tiny", "--kv-cache-memory", str(1 << 20), "--page-size", "4096",
             "--tensor-parallel-size", "2", "--distributed-init", init, "--tensor-parallel-workers", "external"]
    worker = subprocess.Popen([sys.executable, "-c", "from engine.cli import main; main()", "tp-worker", "--rank", "1",
                               *flags, "--model-seed", "7"], stderr=subprocess.PIPE, text=True)
    try:
        with pytest.raises(ValueError, match="disagree on seed, weights"):
            LLM(model="random:tiny", kv_cache_memory=1 << 20, page_size=4096, tensor_parallel_size=2,
                distributed_init=init, tensor_parallel_workers="external")
        assert worker.wait(timeout=60) != 0 and "disagree on seed, weights" in worker.stderr.read()
    finally:
        if worker.poll() is None:
            worker.kill()


def test_two_ranks_in_two_network_namespaces():
    """Two "hosts": network namespaces joined by a veth pair, rank 0 in one, `vkv tp-worker`
    in the other, meeting over TCP at rank 0's address. Needs root and iproute2, else skips."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    a, b = f"vkva{os.getpid()}", f"vkvb{os.getpid()}"
    ip = shutil.which("ip")
    if ip is None or subprocess.run([ip, "netns", "add", a], capture_output=True).returncode:
        pytest.skip("network namespaces need root and iproute2")
    try:
        for cmd in ([ip, "netns", "add", b], [ip, "link", "add", a + "v", "type", "veth", "peer", "name", b + "v"],
                    [ip, "link", "set", a + "v", "netns", a], [ip, "link", "set", b + "v", "netns", b],
                    [ip, "-n", a, "addr", "add", "10.213.0.1/24", "dev", a + "v"],
                    [ip, "-n", b, "addr", "add", "10.213.0.2/24", "dev", b + "v"],
                    [ip, "-n", a, "link", "set", a + "v", "up"], [ip, "-n", b, "link", "set", b + "v", "up"],
                    [ip, "-n", a, "link", "set", "lo", "up"], [ip, "-n", b, "link", "set", "lo", "up"]):
            subprocess.run(cmd, check=True, capture_output=True)
        flags = ["--model", "random:tiny", "--kv-cache-memory", str(1 << 20), "--page-size", "4096",
                 "--tensor-parallel-size", "2", "--distributed-init", "tcp://10.213.0.1:29531",
                 "--tensor-parallel-workers", "external"]
        vkv = [sys.executable, "-c", "from engine.cli import main; main()"]
        worker = subprocess.Popen([ip, "netns", "exec", b, *vkv, "tp-worker", "--rank", "1", *flags],
                                  env=os.environ | {"GLOO_SOCKET_IFNAME": b + "v"})
        try:
            driver = subprocess.run([ip, "netns", "exec", a, *vkv, "generate", "--json", "--max-tokens", "8",
                                     *flags, "Hello there"], env=os.environ | {"GLOO_SOCKET_IFNAME": a + "v"},
                                    capture_output=True, text=True, timeout=180)
            assert driver.returncode == 0, driver.stderr[-2000:]
            assert worker.wait(timeout=30) == 0
        finally:
            if worker.poll() is None:
                worker.kill()
    finally:
        subprocess.run([ip, "netns", "del", a], capture_output=True)
        subprocess.run([ip, "netns", "del", b], capture_output=True)
    got = json.loads(driver.stdout.strip().splitlines()[-1])["outputs"][0]["token_ids"]
    one = LLM(model="random:tiny", kv_cache_memory=1 << 20, page_size=4096)
    want = one.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert got == want[0].outputs[0].token_ids
    one.engine.close()
