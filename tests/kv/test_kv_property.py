"""The engine's KV caches and scheduler under random traffic, without a model.

Every "step" writes, into each scheduled row, a value that names the token's whole prefix
(what a real model's K/V depends on). Requests arrive with shared prefixes, fork (n > 1), get
aborted, and run under memory pressure so preemption and eviction happen. After every step:
pool accounting holds (free xor referenced; counts = mappings + prefix-cache holds) and every
running sequence reads back exactly its own prefix values, so sharing and copy-on-write never
leak one sequence's bytes into another. At the end the pool is whole again.
"""
import shutil
import tempfile

import pytest
import torch
from conftest import cuda_unavailable, make_cuda_backend
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import vmm
from engine.kv.manager import KVManager
from engine.kv.memory import KVMemory
from engine.kv.paged import PagedLayout
from engine.kv.disk_tier import DiskTier
from engine.kv.tiers import HostTier, KVTiers
from engine.kv.virtual import VirtualLayout
from engine.worker.map_ahead import MapAhead
from engine.models.config import ModelConfig
from engine.request.sampling_params import SamplingParams
from engine.sample.sampler import Sampled
from engine.sched.scheduler import Scheduler
from engine.request.sequence import Sequence

# Rows of 1,920 bytes (interleaved) and 480 bytes (per layer) straddle 4 KiB pages.
CFG = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=3,
                  num_kv_heads=3, head_dim=40)
MAX_LEN = 64


# On the CUDA backend (2 MiB pages) rows are made as large, so sequences still span pages.
CFG_2MIB = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2,
                       num_kv_heads=2, head_dim=8 * 1024)  # interleaved rows of 256 KiB: 8 to a page


def make_layout(layout: str, pages: int, cuda: bool = False, swap_pages: int = 0):
    cfg = CFG_2MIB if cuda else CFG
    if layout == "paged":
        return PagedLayout(cfg, 4, pages, torch.float32, torch.device("cpu"))
    backend = make_cuda_backend() if cuda else vmm.HostBackend(4096)
    swap = vmm.SwapSpace(backend, swap_pages * backend.page_size) if swap_pages else None
    return VirtualLayout(cfg, layout, 12 if swap else 6, MAX_LEN, torch.float32, backend, pages, swap=swap)


def prefix_value(tokens: list[int], salt: str | None = None) -> float:
    """What a row holds: a function of the tokens up to it and of the request's cache_salt, so
    a page shared across salts would show wrong bytes."""
    return float(hash((salt, tuple(tokens))) % (1 << 20))


class TrafficMachine(RuleBasedStateMachine):
    cuda = False

    @initialize(layout=st.sampled_from(["interleaved", "per_layer", "paged"]), pages=st.integers(24, 48),
                swap_pages=st.sampled_from([0, 0, 4, 16, 64]), swap_min_tokens=st.integers(1, 24),
                ahead=st.sampled_from([0, 0, 1, 6]), window=st.sampled_from([None, None, 5, 12]),
                host_entries=st.sampled_from([0, 0, 1, 3, 64]), disk_entries=st.sampled_from([0, 0, 0, 2, 64]),
                policy=st.sampled_from(["fcfs", "lpm"]))
    def setup(self, layout, pages, swap_pages, swap_min_tokens, ahead, window, host_entries, disk_entries, policy):
        swap_pages = 0 if layout == "paged" else swap_pages  # swapping needs a virtual layout
        kv_layout = make_layout(layout, pages, self.cuda and layout != "paged", swap_pages)
        self.tier_dir, tiers = None, None
        if host_entries or disk_entries:  # evicted entries go down, and come back at admission
            size, cpu = kv_layout.entry_bytes, torch.device("cpu")
            host = HostTier(cpu, size, host_entries * size) if host_entries else None
            if disk_entries:
                self.tier_dir = tempfile.mkdtemp(prefix="vkv-tier-test-")
            disk = DiskTier(self.tier_dir, b"p" * 32, size, disk_entries * (size + 128)) if disk_entries else None
            tiers = KVTiers(host, disk)
        # window: sliding window, pages before it are let go as sequences grow
        self.kv = KVManager(kv_layout, True, namespace=b"property" if tiers else b"", window=window, tiers=tiers)
        self.layout = kv_layout
        self.sched = Scheduler(self.kv, max_num_seqs=6, max_num_batched_tokens=48, policy=policy,
                               preemption_mode="swap" if swap_pages else "recompute", swap_min_tokens=swap_min_tokens)
        # The map-ahead worker maps pages while the "forward pass" below writes rows.
        self.ahead = MapAhead(self.kv, ahead, self.sched.headroom_pages) if ahead else None
        self.live: list[Sequence] = []
        self.next_id = 0

    def rows(self, seq: Sequence, layer: int, first: int, count: int) -> torch.Tensor:
        """K of `layer` for seq's tokens [first, count), first element of each row."""
        if isinstance(self.layout, PagedLayout):
            bs = self.layout.block_size
            blocks = torch.tensor(seq.kv.table[first // bs:-(-count // bs)], dtype=torch.long)
            return self.layout.k_caches[layer][blocks].flatten(0, 1)[first % bs:count - first // bs * bs, 0, 0]
        return self.layout.k_caches[layer][seq.kv.slot, first:count, 0, 0]

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [7] * 20]),
          tail=st.lists(st.integers(0, 63), min_size=1, max_size=12), out=st.integers(1, 16),
          n=st.integers(1, 3), salt=st.sampled_from([None, None, "a", "b"]))
    def arrive(self, prefix, tail, out, n, salt):
        if self.kv.capacity.pages_for(len(prefix) + len(tail) + out) > self.kv.capacity.total:
            return  # the engine refuses such a request at submission
        params = SamplingParams(max_tokens=out, ignore_eos=True)
        seq, *siblings = [Sequence(str(self.next_id), i, prefix + tail, params, 0.0, cache_salt=salt) for i in range(n)]
        seq.siblings = siblings  # they fork from it when its prompt is computed, or queue
        self.next_id += 1
        self.sched.queues.add(seq)
        self.live += [seq, *siblings]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.sched.queues.finish(seq, "abort")
        for s in [seq, *seq.siblings]:  # siblings not forked yet go with it
            if s in self.live:
                self.live.remove(s)

    @precondition(lambda self: not self.sched.queues.has_unfinished())
    @rule()
    def sleep_and_wake(self):
        KVMemory(self.kv).sleep()
        assert KVMemory(self.kv).asleep
        self.kv.audit()
        KVMemory(self.kv).wake_up()
        assert self.kv.pool.num_free == self.kv.pool.num_pages
        event("slept")

    @rule()
    def step(self):
        out = self.sched.schedule()
        if self.ahead:
            self.ahead.start(out.scheduled)
        for seq, n in out.scheduled:
            first = seq.num_computed_tokens
            for layer in range(CFG.num_layers):
                values = torch.tensor([prefix_value(seq.token_ids[:p + 1], seq.cache_salt)
                                       for p in range(first, first + n)])
                self.write(seq, layer, first, values)
        if self.ahead:
            self.ahead.wait()
        results = {}  # "sampling": a token for each sequence whose step reaches its end
        for seq, n in out.scheduled:
            if seq.num_computed_tokens + n >= len(seq):
                results[seq] = [Sampled((len(seq) * 7) % 64)]
                for child in out.forks.get(seq, ()):
                    results[child] = [Sampled(len(seq) % 64)]  # diverges from its parent at once
        for o in self.sched.update_from_output(out, results):
            if o.finish_reason:
                self.live.remove(o.seq)

    def write(self, seq, layer, first, values):
        count = first + len(values)
        if isinstance(self.layout, PagedLayout):
            bs = self.layout.block_size
            for i, v in enumerate(values):
                pos = first + i
                self.layout.k_caches[layer][seq.kv.table[pos // bs], pos % bs] = v
        else:
            self.layout.k_caches[layer][seq.kv.slot, first:count] = values[:, None, None]

    @invariant()
    def pages_accounted_and_bytes_right(self):
        if not hasattr(self, "kv"):
            return
        self.kv.audit()
        for seq in self.sched.queues.running:
            count = seq.num_computed_tokens
            if not count:
                continue
            first = max(0, count - self.kv.window + 1) if self.kv.window else 0  # rows before it may be gone
            want = torch.tensor([prefix_value(seq.token_ids[:p + 1], seq.cache_salt) for p in range(first, count)])
            for layer in range(CFG.num_layers):
                assert torch.equal(self.rows(seq, layer, first, count).cpu(), want), (seq.request_id, layer)

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        stats = self.kv.stats()
        if self.ahead:
            self.ahead.close()
        for name, happened in [("preemption", self.sched.num_preemptions), ("copy-on-write", stats.cow_copies),
                               ("swap-in", stats.swap_ins), ("mapped ahead", self.ahead and self.ahead.seconds),
                               ("prefix hit", stats.prefix_cache_hits), ("eviction", stats.evictions),
                               ("tier restore", sum(t.tokens_restored for t in stats.tiers))]:
            event(f"{name}: {'yes' if happened else 'no'}")
        for seq in list(self.live):
            self.sched.queues.finish(seq, "abort")
        assert not self.sched.queues.running and not self.sched.queues.waiting and not self.sched.queues.swapped
        if self.kv.prefix_cache:
            self.kv.prefix_cache.clear()
        if isinstance(self.layout, VirtualLayout):
            self.kv.reclaim(self.kv.pool.num_pages)
        self.kv.audit()
        assert self.kv.pool.num_free == self.kv.pool.num_pages
        self.kv.close()
        if self.tier_dir:
            shutil.rmtree(self.tier_dir)


TestTraffic = TrafficMachine.TestCase
TestTraffic.settings = settings(max_examples=400, stateful_step_count=50, deadline=None,
                                suppress_health_check=[HealthCheck.too_slow])


class CudaTrafficMachine(TrafficMachine):
    """The same traffic over vkv's CUDA backend (on the driver emulator where there is no GPU)."""
    cuda = True


TestTrafficCuda = pytest.mark.cuda_emulated(pytest.mark.skipif(
    cuda_unavailable() is not None, reason=f"no CUDA backend: {cuda_unavailable()}")(CudaTrafficMachine.TestCase))
TestTrafficCuda.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                    suppress_health_check=list(HealthCheck))
