"""Several models over one physical KV pool (vmm/share.py, engine/multi.py): pages flow to the
model with traffic, limits hold, idle models sleep, each model computes what it does alone."""
import pytest
import torch
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import vmm
from engine import LLM, SamplingParams
from engine.kv.manager import KVManager
from engine.kv.memory import KVMemory
from engine.kv.virtual import VirtualLayout
from engine.models.config import ModelConfig
from engine.multi import MultiLLM
from engine.sample.sampler import Sampled
from engine.sched.scheduler import Scheduler
from engine.sched.tenant import SchedulerTenant
from engine.request.sequence import Sequence
from helpers import NARROW

GREEDY = SamplingParams(temperature=0, max_tokens=6)
PROMPTS = [f"Story {i}: " + " ".join(f"w{i}x{j}" for j in range(60)) for i in range(4)]
# Two models of SmolLM2's KV geometry with different weights (helpers.NARROW, seeds 0 and 1).
MODELS = {"smol": {"model": NARROW}, "other": {"model": NARROW, "seed": 1}}


@pytest.fixture(scope="module")
def alone() -> dict:
    """Each model's greedy tokens served alone (the default layout; the layouts agree to the
    token, test_engine_vs_hf)."""
    got = {}
    for name, options in MODELS.items():
        with LLM(**options, kv_cache_memory=48 << 20) as llm:
            got[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    return got


@pytest.mark.parametrize("layout", ["per_layer", "interleaved"])
def test_each_model_served_together_computes_what_it_computes_alone(layout, alone):
    assert alone["smol"] != alone["other"]  # two models: a page read by the wrong one would show
    with MultiLLM(MODELS, kv_layout=layout, kv_cache_memory=48 << 20) as llms:
        peak = {}
        for _ in range(2):  # each model in turn takes most of the pool, then gives it back
            for name in MODELS:
                got = [o.outputs[0].token_ids for o in llms.generate(PROMPTS, GREEDY, model=name)]
                assert got == alone[name], name
                peak[name] = max(peak.get(name, 0), llms.shared.tenants[name].peak_in_use)
                llms.audit()
        total = llms.shared.pool.num_pages
        assert all(p > total // 2 for p in peak.values()), (peak, total)  # more than a static half each
        assert llms.sleep_idle(0.0) == list(MODELS)
        assert all(t.used == 0 for t in llms.shared.tenants.values())
        got = [o.outputs[0].token_ids for o in llms.generate(PROMPTS, GREEDY, model="smol")]  # wakes it
        assert got == alone["smol"]
        llms.audit()


def test_a_dropped_multillm_lets_its_kv_memory_go():
    """A share holds its scheduler weakly: each reservation's finalizer holds the share, so a
    strong reference kept every KV manager (and the pool) of a dropped MultiLLM alive for good."""
    import gc
    import weakref
    multi = MultiLLM({"a": "random:tiny", "b": "random:tiny"}, kv_cache_memory=8 << 20)
    multi.generate([[1, 2, 3] * 5], SamplingParams(max_tokens=4, ignore_eos=True), model="a")
    kvs, pool = [weakref.ref(e.kv) for e in multi.engines.values()], weakref.ref(multi.shared.pool)
    gc.collect()
    gc.disable()
    try:
        del multi
        assert all(kv() is None for kv in kvs)  # at once, by reference count
    finally:
        gc.enable()
    gc.collect()  # the group and its shares hold each other: the pool goes with the collector
    assert pool() is None


def test_a_request_the_other_models_floors_leave_no_room_for_is_refused_not_left_waiting():
    """A model's most pages are its cap less the others' floors: a request needing more was
    accepted and then waited forever, the engine spinning."""
    with MultiLLM({"a": "random:tiny", "b": "random:tiny"}, kv_cache_memory=64 * 4096, page_size=4096,
                  kv_layout="interleaved", kv_limits={"a": (0.9, 1.0)}) as multi:
        with pytest.raises(ValueError, match="less the other models' floors"):
            multi.add_request("b", "b0", [5, 6, 7, 8] * 10, SamplingParams(max_tokens=40, ignore_eos=True))
        out = multi.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True), model="b")
        assert len(out[0].outputs[0].token_ids) == 4


def test_limits_that_would_strand_a_request_in_flight_are_refused_and_change_nothing():
    """A cap lowered below what a running request needs was accepted, and the request then waited
    forever (824,878 empty steps in 20 s)."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with MultiLLM({"a": "random:tiny", "b": "random:tiny"}, kv_cache_memory=64 * 4096, page_size=4096,
                  kv_layout="interleaved") as multi:
        multi.add_request("b", "b0", [5, 6, 7, 8] * 10, greedy)  # 80 tokens: 10 pages of 8
        for _ in range(3):
            multi.step()
        before = multi.limits()
        with pytest.raises(ValueError, match="'b0' in flight needs 10"):
            multi.set_limits("b", 0, 4 * 4096)
        with pytest.raises(ValueError, match="'b0' in flight needs 10"):
            multi.set_limits("a", 0.95, 1.0)  # a floor that leaves b too little
        assert multi.limits() == before
        done = False
        while multi.has_unfinished():
            done |= any(o.finished for _, o in multi.step())
        assert done


def test_models_of_other_dtypes_and_layouts_share_the_pool():
    prompts = [[5 + i] * 40 for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    own = {"a": {"model": "random:tiny", "dtype": "bfloat16"}, "b": {"model": "random:qwen3-small", "kv_layout": "interleaved"},
           "c": {"model": "random:tiny", "kv_cache_dtype": "fp8"}}
    with MultiLLM(own, kv_cache_memory=4 << 20) as llms:
        together = {name: [o.outputs[0].token_ids for o in llms.generate(prompts, greedy, model=name)] for name in own}
        assert llms.engines["a"].kv.layout.dtype == torch.bfloat16 and llms.engines["b"].kv.layout.name == "interleaved"
        assert llms.engines["c"].kv.layout.dtype == torch.float8_e4m3fn
        llms.audit()
    for name, options in own.items():
        with LLM(**options, kv_cache_memory=4 << 20) as llm:
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == together[name]
    with pytest.raises(ValueError, match="page_size belong to the shared pool"):
        MultiLLM({"a": {"model": "random:tiny", "page_size": 8192}}, kv_cache_memory=4 << 20)
    for own in ({"kv_layout": "paged"},):  # its blocks would be outside the pool
        with pytest.raises(ValueError, match="model 'a': several models share one pool on a virtual kv_layout"):
            MultiLLM({"a": {"model": "random:tiny", **own}, "b": "random:tiny"}, kv_cache_memory=4 << 20)


def test_limits_are_checked_by_name_and_a_failing_model_stops_start_up():
    with pytest.raises(ValueError, match="'nope'"):
        MultiLLM({"a": "random:tiny"}, kv_cache_memory=8 << 20, kv_limits={"nope": (0, 1.0)})
    with pytest.raises(ValueError, match="floors would sum"):
        MultiLLM({"a": "random:tiny", "b": "random:tiny"}, kv_cache_memory=8 << 20,
                 kv_limits={"a": (0.6, 1.0), "b": (0.6, 1.0)})
    with pytest.raises(ValueError, match="floor .* must be in"):
        MultiLLM({"a": "random:tiny"}, kv_cache_memory=8 << 20, kv_limits={"a": (0.5, 0.25)})
    with pytest.raises(ValueError, match="model 'broken'"):
        MultiLLM({"a": "random:tiny", "broken": "/no/such/checkpoint"}, kv_cache_memory=8 << 20)


def test_a_cap_bounds_a_model_and_a_floor_keeps_pages_for_another():
    with MultiLLM({"a": "random:tiny", "b": "random:tiny"}, kv_cache_memory=4 << 20, page_size=4096,
                  kv_limits={"a": (0, 0.5), "b": (0.25, 1.0)}) as llms:
        total = llms.shared.pool.num_pages
        a, b = llms.shared.tenants["a"], llms.shared.tenants["b"]
        assert a.cap == total // 2 and b.floor == total // 4
        llms.generate([[5 + i] * 300 for i in range(8)], SamplingParams(max_tokens=4, ignore_eos=True), model="a")
        assert 0 < a.peak_in_use <= total // 2
        llms.generate([[100 + i] * 600 for i in range(8)], SamplingParams(max_tokens=4, ignore_eos=True), model="b")
        assert b.peak_in_use > total // 2  # a gave its idle and cached pages back
        llms.set_limits("b", 0, 0.25)
        with pytest.raises(ValueError, match="'a': KV limit cap 2048 exceeds the pool's 1024 pages"):
            llms.set_limits("a", 0, 8 << 20)  # bytes
        with pytest.raises(ValueError, match=r"share must be in \[0, 1\]"):
            llms.set_limits("a", 0, 2.0)
        llms.audit()


def test_a_model_under_its_fair_share_preempts_a_burst_above_its_own():
    with MultiLLM({"a": "random:tiny", "b": "random:tiny"}, kv_cache_memory=1 << 20, page_size=4096,
                  max_num_seqs=8) as llms:
        burst = SamplingParams(max_tokens=40, ignore_eos=True)  # 5 x 400 tokens: 250 of the 256 pages
        for i in range(5):
            llms.add_request("a", f"a{i}", [5 + i] * 360, burst)
        for _ in range(4):
            llms.step()
        a, b = llms.shared.tenants["a"], llms.shared.tenants["b"]
        assert a.used > llms.shared.fair_share(a) and llms.stats("a").preemptions == 0
        assert llms.shared.pool.num_free < 38  # b's prompt needs 38 pages: it fits only if a gives some up
        llms.add_request("b", "b0", [9] * 300, SamplingParams(max_tokens=8, ignore_eos=True))
        steps, first_token_step = 0, None
        while llms.has_unfinished():
            steps += 1
            for name, out in llms.step():
                if out.request_id == "b0" and out.outputs[0].token_ids and first_token_step is None:
                    first_token_step = steps
            llms.audit()
        assert first_token_step <= 2, first_token_step  # without preemption: 22 steps, until a preempts itself
        assert llms.stats("a").preemptions > 0 and b.peak_in_use <= llms.shared.fair_share(b)


# -- the shared pool under random traffic, without models ---------------------------------
CFGS = [ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=3, num_kv_heads=3,
                    head_dim=40),
        ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                    head_dim=64)]


class SharedTraffic(RuleBasedStateMachine):
    """2-3 models' KV caches and schedulers over one shared pool: arrivals, aborts, limit
    changes and sleeps. After every step each model's pages match its mappings, every page has
    one owner, no model holds more than its cap (unless the cap was lowered under it), every
    unmet floor is free for its model to take (unless a floor was raised under the others),
    and at the end every page is free."""

    @initialize(models=st.integers(2, 3), pages=st.integers(16, 40), layout=st.sampled_from(["interleaved", "per_layer"]))
    def setup(self, models, pages, layout):
        self.shared = vmm.SharedPool(vmm.PagePool(vmm.HostBackend(4096), pages))
        self.kvs, self.scheds, self.tenants, self.live = [], [], [], []
        for m in range(models):
            share = self.shared.tenant(str(m))
            kv = KVManager(VirtualLayout(CFGS[m % 2], layout, 4, 48, torch.float32, share.backend, share.num_pages,
                                         pool=share), prefix_caching=True)
            self.kvs.append(kv)
            self.scheds.append(Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=32))
            self.tenants.append(SchedulerTenant(self.scheds[-1]))  # (the share holds it weakly)
            share.register(self.tenants[-1])
            self.live.append([])
        self.next_id, self.cap_over, self.floor_raised = 0, {}, False

    @rule(data=st.data(), tail=st.lists(st.integers(0, 63), min_size=1, max_size=20), out=st.integers(1, 12),
          copies=st.integers(1, 4))
    def arrive(self, data, tail, out, copies):
        m = data.draw(st.integers(0, len(self.kvs) - 1))
        if self.kvs[m].capacity.pages_for(len(tail) + 5 + out) > self.shared.tenants[str(m)].cap:
            return  # the engine refuses such a request at submission
        if KVMemory(self.kvs[m]).asleep:  # asleep, its floor was others' to use: on waking it may be owed
            KVMemory(self.kvs[m]).wake_up()
            self.floor_raised |= self.shared.tenants[str(m)].floor > 0
        for i in range(copies):  # a burst on one model
            seq = Sequence(str(self.next_id), 0, [1, 2, 3, 4, i] + tail, SamplingParams(max_tokens=out, ignore_eos=True),
                           0.0)
            self.next_id += 1
            self.scheds[m].queues.add(seq)
            self.live[m].append(seq)

    @precondition(lambda self: any(self.live))
    @rule(data=st.data())
    def abort(self, data):
        m = data.draw(st.sampled_from([i for i, live in enumerate(self.live) if live]))
        seq = data.draw(st.sampled_from(self.live[m]))
        self.scheds[m].queues.finish(seq, "abort")
        self.live[m].remove(seq)

    @rule(data=st.data(), floor=st.floats(0, 0.5), cap=st.floats(0.3, 1.0))
    def limits(self, data, floor, cap):
        m = data.draw(st.integers(0, len(self.kvs) - 1))
        total = self.shared.pool.num_pages
        floor, cap = int(floor * total), max(int(cap * total), int(floor * total))
        need = max((self.kvs[m].capacity.pages_for(len(s) + s.params.max_tokens) for s in self.live[m]), default=0)
        try:
            self.shared.set_limits(str(m), floor, max(cap, need))
        except ValueError as exc:  # refused by name: floors over the pool, or (a sequence needs more) a cap over it
            assert "floors would sum" in str(exc) or "exceeds the pool's" in str(exc), exc
            return
        share = self.shared.tenants[str(m)]
        self.floor_raised |= share.floor > share.used  # pages others already hold may be owed to it
        if share.used > share.cap:
            share.tenant.free_spare(share.used - share.cap)
        self.cap_over[m] = max(0, share.used - share.cap)  # what running sequences keep for now

    @rule(data=st.data())
    def sleep(self, data):
        m = data.draw(st.integers(0, len(self.kvs) - 1))
        if not self.scheds[m].queues.has_unfinished() and not KVMemory(self.kvs[m]).asleep:
            KVMemory(self.kvs[m]).sleep()
            assert self.shared.tenants[str(m)].used == 0
            event("a model slept")

    @rule()
    def step(self):
        for m, (kv, sched) in enumerate(zip(self.kvs, self.scheds)):
            out = sched.schedule()
            results = {seq: [Sampled(len(seq) % 64)] for seq, n in out.scheduled
                       if seq.num_computed_tokens + n >= len(seq)}
            for o in sched.update_from_output(out, results):
                if o.finish_reason:
                    self.live[m].remove(o.seq)

    @invariant()
    def pages_owned_and_bounded(self):
        if not hasattr(self, "shared"):
            return
        for m, kv in enumerate(self.kvs):
            kv.audit()
            share = self.shared.tenants[str(m)]
            assert share.used <= share.cap + self.cap_over.get(m, 0), (m, share.used, share.cap)
        if not self.floor_raised:  # every model's unmet floor is still free for it to take
            unmet = sum(max(0, t.floor - t.used) for t in self.shared.tenants.values() if not t.asleep)
            assert self.shared.pool.num_free >= unmet, (self.shared.pool.num_free, unmet)
        self.shared.audit()

    def teardown(self):
        if not hasattr(self, "shared"):
            return
        total, tenants = self.shared.pool.num_pages, self.shared.tenants.values()
        event(f"a model held more than its fair share: {any(t.peak_in_use > total // len(tenants) for t in tenants)}")
        event(f"preempted: {any(s.num_preemptions for s in self.scheds)}")
        for m, sched in enumerate(self.scheds):
            for seq in list(self.live[m]):
                sched.queues.finish(seq, "abort")
            kv = self.kvs[m]
            if not KVMemory(kv).asleep:
                kv.prefix_cache.clear()
                kv.reclaim(kv.pool.num_pages)
            kv.audit()
        assert self.shared.pool.num_free == self.shared.pool.num_pages
        for kv in self.kvs:
            kv.close()
        self.shared.close()


TestSharedTraffic = SharedTraffic.TestCase
TestSharedTraffic.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
