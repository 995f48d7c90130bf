"""AdmissionOrder alone: groups take turns, priorities order the queue and choose the victim,
the longest cached prefix goes first under lpm (and nobody starves), and a client waiting with
nothing running gets a seat from the client holding the most."""
import torch

import vmm
from engine.kv.manager import KVManager
from engine.kv.virtual import VirtualLayout
from engine.models.config import ModelConfig
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import Sequence
from engine.sched.admission import LPM_MAX_SKIPS, AdmissionOrder

CFG = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                  head_dim=64)


def kv() -> KVManager:
    return KVManager(VirtualLayout(CFG, "per_layer", 4, 128, torch.float32, vmm.HostBackend(4096), 32),
                     prefix_caching=True)


def seq(group: str, tokens=(1, 2, 3), priority: int = 0, arrival: float = 0.0) -> Sequence:
    return Sequence(group, 0, list(tokens), SamplingParams(max_tokens=2), arrival, group=group, priority=priority)


def test_groups_take_turns_in_fcfs():
    order = AdmissionOrder(kv(), "fcfs", None)
    waiting = [seq("a"), seq("a"), seq("a"), seq("b")]
    first = order.next(waiting, [])
    order.admitted(first, waiting)
    waiting.remove(first)
    assert first.group == "a" and order.next(waiting, []).group == "b"  # b has had none: its turn


def test_priority_orders_the_queue_and_picks_the_least_urgent_victim():
    order = AdmissionOrder(kv(), "priority", None)
    urgent, lazy = seq("x", priority=-5, arrival=2.0), seq("y", priority=9, arrival=1.0)
    assert order.next([lazy, urgent], []) is urgent
    assert order.victim([urgent, lazy]) is lazy
    assert AdmissionOrder(kv(), "fcfs", None).victim([urgent, lazy]) is lazy  # fcfs: the newest (last)


def test_lpm_prefers_the_longest_cached_prefix_and_starves_nobody():
    manager = kv()
    cached = seq("c", tokens=range(1, 30))
    cached.num_computed_tokens = manager.admit(cached)
    assert manager.ensure_mapped(cached, len(cached))
    cached.num_computed_tokens = len(cached)
    manager.commit(cached)
    manager.release(cached)
    order = AdmissionOrder(manager, "lpm", None)
    cold, warm = seq("cold", tokens=range(40, 60)), seq("warm", tokens=range(1, 25))
    waiting = [cold, warm]
    assert order.next(waiting, []) is warm
    for _ in range(LPM_MAX_SKIPS):  # later arrivals with a cached prefix keep passing `cold`
        later = seq("warm", tokens=range(1, 25))
        waiting.append(later)
        order.admitted(order.next(waiting, []), waiting)
        waiting.remove(next(s for s in waiting if s is not cold))
    assert order.next(waiting, []) is cold  # passed over LPM_MAX_SKIPS times: its turn


def test_a_client_with_nothing_running_gets_a_seat_from_the_busiest():
    order = AdmissionOrder(kv(), "fcfs", None)
    running = [seq("hog") for _ in range(4)]
    waiting = [seq("new")]
    hog = order.seat_to_free(waiting, running, max_num_seqs=4, fits=lambda s: False)
    assert hog is running[-1]
    assert order.seat_to_free(waiting, running, max_num_seqs=4, fits=lambda s: True) is None  # it fits: nobody moves
