"""KV tiers (engine/kv/tiers.py): evicted prefix-cache entries go to host memory and disk and
come back into the sequence's own pages; a restarted engine finds the disk's; damaged files
are recomputed, never used; another model or dtype never restores a page."""
import time

import pytest
import torch
from helpers import NARROW, assert_pool_whole

from engine import LLM, SamplingParams
from engine.kv.manager import KVManager
from engine.kv.paged import PagedLayout
from engine.kv.disk_tier import HEADER, DiskTier
from engine.kv.tiers import HostTier, KVTiers
from engine.models.config import ModelConfig
from engine.sched.admission import LPM_MAX_SKIPS
from engine.sched.scheduler import Scheduler
from engine.serving.loop.metrics import Metrics
from engine.request.sequence import Sequence

# Three prompts of ~260 tokens on SmolLM2's KV geometry (helpers.NARROW) with nothing in common, and a pool that holds about one of
# them: the second round finds every prompt evicted from the pool.
PROMPTS = [f"Story {i}: " + " ".join(f"word{i}x{j}" for j in range(52)) for i in range(3)]
POOL = 20 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def rounds(llm, n=2) -> list[list[list[int]]]:
    return [[llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS] for _ in range(n)]


def tier(llm, name):
    return next(t for t in llm.stats().kv.tiers if t.tier == name)


@pytest.mark.parametrize("layout", ["per_layer", "interleaved", "paged"])
def test_restored_prefixes_give_the_tokens_that_computing_them_gives(layout):
    with LLM(model=NARROW, kv_layout=layout, kv_cache_memory=POOL, max_num_seqs=1, kv_offloading_size=0.25) as llm:
        computed, restored = rounds(llm)
        host = tier(llm, "host")
        assert llm.stats().kv.evictions > 0 and host.tokens_restored >= len(PROMPTS) * 85, host
        assert restored == computed
        assert_pool_whole(llm)
        metrics = Metrics().render(llm.stats()).decode()
        assert f'vkv:kv_tier_restored_tokens_total{{tier="host"}} {float(host.tokens_restored)}' in metrics
        assert 'vkv:kv_tier_used_bytes{tier="host"}' in metrics and "vkv:kv_tier_restore_seconds_total" in metrics


def test_a_restarted_engine_restores_from_disk_and_damage_is_recomputed(tmp_path):
    opts = dict(model=NARROW, kv_cache_memory=POOL, max_num_seqs=1, kv_offloading_path=str(tmp_path))
    with LLM(**opts) as llm:  # closing writes the pool's cached entries to disk too
        (cold,) = rounds(llm, 1)
    files = sorted(tmp_path.glob("*/*.kv"))
    assert len(files) >= 3 * len(PROMPTS)

    with LLM(**opts) as llm:
        (warm,) = rounds(llm, 1)
        assert warm == cold and tier(llm, "disk").tokens_restored >= 2 * len(PROMPTS) * 85

    # between runs, every file damaged (which files a prompt's entries are depends on the names'
    # order): a flipped payload byte, a truncation, another entry's bytes under its name
    originals = [bytearray(f.read_bytes()) for f in files]
    for i, (f, data) in enumerate(zip(files, originals)):
        if i % 3 == 0:
            data[HEADER.size + 1000] ^= 0x40
            f.write_bytes(data)
        elif i % 3 == 1:
            f.write_bytes(data[:len(data) // 2])
        else:
            f.write_bytes(originals[i - 1])
    with LLM(**opts) as llm:
        (after_damage,) = rounds(llm, 1)
        disk = tier(llm, "disk")
        assert after_damage == cold and disk.errors >= len(PROMPTS), disk

    with LLM(**opts) as llm:  # during a run: the files go after the engine indexed them
        for f in tmp_path.glob("*/*.kv"):
            f.unlink()
        (after_delete,) = rounds(llm, 1)
        assert after_delete == cold and tier(llm, "disk").errors >= 1


def test_another_dtype_or_model_never_restores_a_page(tmp_path):
    opts = dict(model=NARROW, kv_cache_memory=POOL, max_num_seqs=1, kv_offloading_path=str(tmp_path))
    with LLM(**opts) as llm:
        rounds(llm, 1)
    (fp32_dir,) = tmp_path.iterdir()
    before = {f.name: f.read_bytes() for f in fp32_dir.glob("*.kv")}
    for other in (dict(dtype="bfloat16"), dict(kv_cache_dtype="fp8"), dict(model="random:tiny")):
        with LLM(**opts | other) as llm:
            rounds(llm, 1)
            assert tier(llm, "disk").tokens_restored == 0, other
    assert len(list(tmp_path.iterdir())) == 4  # a directory per namespace
    assert {f.name: f.read_bytes() for f in fp32_dir.glob("*.kv")} == before


def test_tier_settings_are_checked_by_name():
    with pytest.raises(ValueError, match="prefix caching"):
        LLM(kv_offloading_size=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offloading_size"):
        LLM(kv_offloading_size=-1)
    with pytest.raises(ValueError, match="holds no KV entry"):
        LLM(kv_offloading_size=1e-6)


# -- the tiers alone ----------------------------------------------------------------------
def entry(value: int, size: int = 4096) -> list[torch.Tensor]:
    return [torch.full((size // 2,), value, dtype=torch.uint8), torch.full((size // 2,), value + 1, dtype=torch.uint8)]


def read(t, name: bytes, size: int = 4096) -> list[int] | None:
    parts = [torch.zeros(size // 2, dtype=torch.uint8), torch.zeros(size // 2, dtype=torch.uint8)]
    return [int(parts[0][0]), int(parts[1][-1])] if t.get(name, parts) else None


def test_host_tier_keeps_the_most_recently_used_entries():
    host = HostTier(torch.device("cpu"), 4096, 2 * 4096)
    host.put(b"a" * 32, entry(1))
    host.put(b"b" * 32, entry(3))
    assert read(host, b"a" * 32) == [1, 2]  # a is now the most recent
    host.put(b"c" * 32, entry(5))
    assert read(host, b"b" * 32) is None and read(host, b"c" * 32) == [5, 6]
    assert host.stats().dropped == 1 and host.stats().entries == 2
    host.close()


def test_disk_tier_persists_checks_and_bounds_its_files(tmp_path):
    names = [bytes([i]) * 32 for i in range(5)]
    disk = DiskTier(tmp_path, b"n" * 32, 4096, 3 * (4096 + HEADER.size))
    for i, name in enumerate(names[:2]):
        disk.put(name, entry(10 * i), wait=True)
    assert read(disk, names[0]) == [0, 1]  # from the writer's queue or the file: either is whole
    disk.close()

    disk = DiskTier(tmp_path, b"n" * 32, 4096, 3 * (4096 + HEADER.size))  # a restart
    assert read(disk, names[1]) == [10, 11] and read(disk, names[0]) == [0, 1]
    for i, name in enumerate(names[2:], 2):
        disk.put(name, entry(10 * i), wait=True)
    disk.close()
    assert disk.stats().entries == 3 and disk.stats().dropped == 2  # the least recently used went
    assert len(list(disk.dir.glob("*.kv"))) == 3

    disk = DiskTier(tmp_path, b"n" * 32, 4096, 3 * (4096 + HEADER.size))
    path = disk.dir / f"{names[4].hex()}.kv"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(data)
    assert read(disk, names[4]) is None and not path.exists() and disk.stats().errors == 1
    assert DiskTier(tmp_path, b"m" * 32, 4096, 1 << 20).dir != disk.dir  # another namespace, another place
    disk.close()


def test_disk_tier_files_are_its_owners_alone_and_a_dropped_tiers_writer_ends(tmp_path):
    """Salted tenants' KV on disk is no more readable to other local users than the pool's
    socket; an engine dropped without close() takes its tier and writer thread with it."""
    import gc
    import stat
    import threading
    import weakref

    def writers() -> int:
        return sum(t.name == "vkv-kv-disk-writer" for t in threading.enumerate())

    before = writers()
    with LLM(model="random:tiny", kv_offloading_path=str(tmp_path / "kv"), page_size=4096,
             kv_cache_memory=16 << 20) as llm:  # closing writes the cache
        llm.generate([[1, 2, 3] * 40, [4, 5, 6] * 40], SamplingParams(max_tokens=2), use_tqdm=False)
    modes = {str(p): (p.is_dir(), stat.S_IMODE(p.stat().st_mode)) for p in (tmp_path / "kv").rglob("*")}
    assert any(name.endswith(".kv") for name in modes), modes
    assert all(mode == (0o700 if is_dir else 0o600) for is_dir, mode in modes.values()), modes
    dropped = LLM(model="random:tiny", kv_offloading_path=str(tmp_path / "kv"))
    dropped.generate([[7, 8, 9] * 40], SamplingParams(max_tokens=2), use_tqdm=False)
    tier = weakref.ref(dropped.engine.kv.tiers.disk)
    assert writers() == before + 1
    del dropped, llm
    gc.collect()
    deadline = time.monotonic() + 10
    while writers() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tier() is None and writers() == before


def test_tiers_restore_from_the_fastest_that_has_the_entry(tmp_path):
    host = HostTier(torch.device("cpu"), 4096, 4096)
    tiers = KVTiers(host, DiskTier(tmp_path, b"n" * 32, 4096, 1 << 20))
    tiers.offload(b"a" * 32, entry(1), wait=True)
    tiers.offload(b"b" * 32, entry(3), wait=True)  # pushes a out of the one-entry host tier
    parts = entry(0)
    assert tiers.where(b"b" * 32) == "host" and tiers.restore(b"b" * 32, parts) == "host"
    assert tiers.where(b"a" * 32) == "disk" and tiers.restore(b"a" * 32, parts) == "disk"
    assert int(parts[0][0]) == 1
    tiers.close()
    host.close()


# -- prefix-aware scheduling --------------------------------------------------------------
CFG = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                  num_kv_heads=1, head_dim=8)


def test_lpm_admits_the_longest_cached_prefix_first_and_starves_nobody():
    kv = KVManager(PagedLayout(CFG, 4, 64, torch.float32, torch.device("cpu")), prefix_caching=True)
    params = SamplingParams(max_tokens=1)
    warm = Sequence("warm", 0, list(range(1, 17)), params, 0.0)
    kv.admit(warm)
    assert kv.ensure_mapped(warm, 16)
    warm.num_computed_tokens = 16
    kv.commit(warm)
    kv.release(warm)  # its 4 pages stay in the prefix cache

    def order(policy: str, later: int) -> list[str]:
        sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=64, policy=policy)
        sched.queues.add(Sequence("cold", 0, [60, 61, 62, 63, 59], params, 0.0))
        for i in range(later):  # arrive later, each with the warm prefix cached
            sched.queues.add(Sequence(f"hot{i}", 0, list(range(1, 17)) + [40 + i], params, 1.0))
        admitted = []
        while sched.queues.has_unfinished():
            ((seq, _),) = sched.schedule().scheduled
            admitted.append(seq.request_id)
            sched.queues.finish(seq, "length")
        return admitted

    assert order("fcfs", 3) == ["cold", "hot0", "hot1", "hot2"]
    assert order("lpm", 3) == ["hot0", "hot1", "hot2", "cold"]
    assert order("lpm", LPM_MAX_SKIPS + 4).index("cold") == LPM_MAX_SKIPS  # passed over at most that often
    kv.audit()
    kv.close()


@pytest.mark.parametrize("layout", ["per_layer", "paged"])
def test_a_prefix_that_ends_inside_a_page_a_tier_holds_is_restored_to_the_token(layout):
    """A prompt that ends inside a page which an earlier, longer prompt filled, after that page
    was evicted to the host tier: the page comes back from the tier (a hit to the token), and the
    tokens equal computing the prompt."""
    opts = dict(model=NARROW, kv_layout=layout, max_num_seqs=1)
    with LLM(**opts, kv_cache_memory=POOL, kv_offloading_size=0.25) as llm:
        ids = llm.tokenizer.encode(PROMPTS[0])
        rounds(llm, 1)  # PROMPTS[0] cached, then evicted to the tier by the two after it
        before = llm.stats().kv
        short = ids[:len(ids) - 37]  # ends inside a page PROMPTS[0] filled
        got = llm.generate([short], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        after = llm.stats().kv
        assert after.prefix_cache_partial_hits > before.prefix_cache_partial_hits, after
        assert tier(llm, "host").tokens_restored > next(t for t in before.tiers if t.tier == "host").tokens_restored
        assert_pool_whole(llm)
    with LLM(**opts, kv_cache_memory=POOL, enable_prefix_caching=False) as reference:
        assert got == reference.generate([short], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
