"""The Scheduler alone, over a real KV manager: the token budget and chunked prefill, the
headroom, preemption of the newest by recompute or by swap, forks of n > 1 siblings, and that
a failing row fails its request alone. No model runs: each step's rows are 'sampled' here."""
import torch

import vmm
from engine.kv.manager import KVManager
from engine.kv.virtual import VirtualLayout
from engine.models.config import ModelConfig
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import Sequence, SequenceStatus
from engine.sample.sampler import Sampled
from engine.sched.scheduler import Scheduler

CFG = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                  head_dim=64)  # per_layer, one layer: 8 tokens a 4 KiB page, two regions (K and V)


def scheduler(pages: int, swap: bool = False, **options) -> Scheduler:
    backend = vmm.HostBackend(4096)
    tier = vmm.SwapSpace(backend, 64 * 4096) if swap else None
    layout = VirtualLayout(CFG, "per_layer", 8 if swap else 4, 128, torch.float32, backend, pages, 1, tier)
    return Scheduler(KVManager(layout), **({"max_num_seqs": 4, "max_num_batched_tokens": 64} | options))


def seq(name: str, prompt: int, out: int = 4, **params) -> Sequence:
    return Sequence(name, 0, list(range(1, prompt + 1)), SamplingParams(max_tokens=out, ignore_eos=True, **params),
                    0.0, group=name)


def step(s: Scheduler, fail: set[str] = frozenset()) -> dict[str, int]:
    """One step: what each sequence computes; each row that completes its tokens samples token 7."""
    out = s.schedule()
    results = {q: (RuntimeError("bad row") if q.request_id in fail else [Sampled(7)]) for q, n in out.scheduled
               if q.num_computed_tokens + n >= len(q)}
    for parent, children in out.forks.items():
        results.update({child: [Sampled(8)] for child in children})
    s.update_from_output(out, results)
    return {q.request_id: n for q, n in out.scheduled}


def test_prompts_are_chunked_under_the_token_budget_and_decodes_go_first():
    s = scheduler(64, max_num_batched_tokens=16)
    a, b = seq("a", 20), seq("b", 5)
    s.queues.add(a)
    s.queues.add(b)
    assert step(s) == {"a": 16}  # a's first chunk takes the whole budget
    assert step(s) == {"a": 4, "b": 5}  # a's rest, then b's prompt
    assert step(s) == {"a": 1, "b": 1}  # decodes
    assert a.token_ids[-2:] == [7, 7] and s.kv.capacity.free_now < 64


def test_the_newest_running_sequence_is_preempted_by_recompute_when_pages_run_out():
    s = scheduler(10)  # 5 pairs of pages (K and V) of 8 tokens: both prompts fit, not both grown
    old, new = seq("old", 16, out=20), seq("new", 15, out=20)
    s.queues.add(old)
    s.queues.add(new)
    assert step(s) == {"old": 16, "new": 15}
    for _ in range(10):
        if new.status is not SequenceStatus.RUNNING:
            break
        step(s)
    assert s.num_preemptions >= 1 and old.status is SequenceStatus.RUNNING
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0 and new.kv is None
    assert new.token_ids[15:] and set(new.token_ids[15:]) == {7}  # it keeps what it generated
    s.kv.audit()


def test_swap_preemption_keeps_the_computed_tokens_and_brings_them_back():
    s = scheduler(10, swap=True, preemption_mode="swap", swap_min_tokens=1)
    old, new = seq("old", 16, out=20), seq("new", 15, out=20)
    s.queues.add(old)
    s.queues.add(new)
    for _ in range(10):
        if new.status is SequenceStatus.SWAPPED:
            break
        step(s)
    computed = new.num_computed_tokens
    assert computed > 0 and s.kv.stats().swap_outs == 1
    s.queues.finish(old, "abort")
    step(s)
    assert new.status is SequenceStatus.RUNNING and new.num_computed_tokens > computed  # went on from where it was
    s.kv.audit()


def test_n_siblings_fork_from_the_first_when_its_prompt_is_computed():
    s = scheduler(64)
    first = seq("r", 10)
    first.siblings = [Sequence("r", i, list(first.token_ids), first.params, 0.0, group="r") for i in (1, 2)]
    s.queues.add(first)
    assert step(s) == {"r": 10}
    assert len(s.queues.running) == 3 and all(c.num_computed_tokens == 10 for c in s.queues.running)
    assert s.kv.stats().pages_shared > 0  # the prompt's pages, mapped once each by all three
    s.kv.audit()


def test_a_row_that_raises_fails_its_request_alone():
    s = scheduler(64)
    bad, good = seq("bad", 4), seq("good", 4)
    s.queues.add(bad)
    s.queues.add(good)
    out = s.schedule()
    outputs = s.update_from_output(out, {q: (RuntimeError("boom") if q is bad else [Sampled(7)])
                                         for q, _ in out.scheduled})
    failed = [o for o in outputs if o.finish_reason == "error"]
    assert [o.seq for o in failed] == [bad] and "boom" in failed[0].error
    assert good.status is SequenceStatus.RUNNING and bad.kv is None
    s.kv.audit()
