"""Who goes next, and who makes room: the scheduler's admission order (engine/sched/scheduler.py).

First come, first served, except that a group (the sequences of one client) that has had fewer
sequences admitted goes before one that has had more, so a request of many prompts cannot hold
the head of the queue for everyone: groups take turns. With `policy="priority"` the lowest
priority value goes first (ties: fairness, then arrival) and the least urgent running sequence
is the one preempted; otherwise the newest is. With `policy="lpm"` (SGLang's longest prefix
match) the sequence with the most prompt pages already cached, in the pool or a KV tier, goes
first (ties: fairness, then arrival), so a prefix is used while it is still cached; a queue
longer than LPM_MAX_QUEUE is served FCFS (matching every prompt would cost more than it saves),
and a sequence passed over LPM_MAX_SKIPS times by later arrivals goes next: nobody starves.
With LoRA, a sequence whose adapter is neither running nor fits under max_loras waits its turn.

Who writes what: the scheduler tells this object what happened (`admitted`, `forget`); it
writes only its own counts (admissions per group, skips and page names per waiting sequence).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as Seq

from engine.kv.manager import KVManager
from engine.request.sequence import Sequence

LPM_MAX_QUEUE = 128  # SGLang's threshold: longer queues are served FCFS
LPM_MAX_SKIPS = 8  # times a waiting sequence may be passed over by later ones under lpm


class AdmissionOrder:
    def __init__(self, kv: KVManager, policy: str, max_loras: int | None):
        self.kv, self.policy, self.max_loras = kv, policy, max_loras
        self.counts: Counter[str] = Counter()  # per group with sequences here: admissions (see `count`)
        self.skips: Counter[int] = Counter()  # lpm: per waiting seq_id, times later ones went first
        self.names: dict[int, tuple[int, list[bytes]]] = {}  # lpm: seq_id -> (its length, page names)

    def next(self, waiting: Seq[Sequence], running: list[Sequence]) -> Sequence | None:
        """The waiting sequence to admit next (queue order breaks ties: preempted ones are at
        the front); None when every one waits for a LoRA adapter's turn."""
        if self.max_loras is not None:
            waiting = [seq for seq in waiting if self.adapter_fits(seq, running)]
        if len(waiting) <= 1:
            return waiting[0] if waiting else None
        fair = lambda i: (self.urgency(waiting[i]), self.count(waiting[i].group), i)
        if self.policy != "lpm" or len(waiting) > LPM_MAX_QUEUE:
            return waiting[min(range(len(waiting)), key=fair)]
        starved = [i for i in range(len(waiting)) if self.skips[waiting[i].seq_id] >= LPM_MAX_SKIPS]
        if starved:
            return waiting[starved[0]]
        cached = [self._cached_pages(seq) for seq in waiting]
        busy = {s.group for s in running}  # a client with nothing running first, as seat sharing wants:
        # else the sequence it preempted, cached and at the front, was admitted straight back
        return waiting[min(range(len(waiting)), key=lambda i: (waiting[i].group in busy, -cached[i], fair(i)))]

    def _cached_pages(self, seq: Sequence) -> int:
        """How many of seq's first pages the KV cache or its tiers hold (its page names are
        kept while its length stays)."""
        length, names = self.names.get(seq.seq_id, (-1, None))
        names, cached = self.kv.cached_prefix(seq, names if length == len(seq) else None)
        self.names[seq.seq_id] = (len(seq), names)
        return cached

    def adapter_fits(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Can seq run beside the running sequences: its LoRA adapter is one of theirs, or
        fewer than max_loras distinct ones run (vLLM's rule)?"""
        if seq.lora is None or self.max_loras is None:
            return True
        adapters = {s.lora for s in running if s.lora is not None}
        return seq.lora in adapters or len(adapters) < self.max_loras

    def urgency(self, seq: Sequence) -> int:
        """Lower goes first: the request's priority under the priority policy, else all equal."""
        return seq.priority if self.policy == "priority" else 0

    def seat_to_free(self, waiting: Seq[Sequence], running: list[Sequence], max_num_seqs: int,
                     fits: Callable[[Sequence], bool]) -> Sequence | None:
        """Seats are shared: when a group (a client) waits with no sequence running and the next
        one does not fit (`fits`: a seat and its pages), the group holding the most seats, above
        its fair share, gives back its newest; None when nobody needs to. (Not under the
        priority policy: there urgency decides.)"""
        if self.policy == "priority" or not waiting or not running:
            return None
        held = Counter(s.group for s in running)
        groups = {s.group for s in waiting if self.adapter_fits(s, running)}  # (one whose adapter waits cannot run)
        if all(held[g] for g in groups):  # every waiting client has something running (the usual case)
            return None
        head = self.next(waiting, running)
        if head is None or fits(head):
            return None
        hog, most = held.most_common(1)[0]
        if most <= max(1, max_num_seqs // len(held.keys() | groups)):
            return None
        return next(s for s in reversed(running) if s.group == hog)

    def victim(self, candidates: list[Sequence]) -> Sequence:
        """Who is preempted among running candidates (the tail of the running list): the least
        urgent under the priority policy, else the newest."""
        if self.policy == "priority":
            return max(candidates, key=lambda s: (s.priority, s.arrival, s.seq_id))
        return candidates[-1]

    def admitted(self, seq: Sequence, waiting: Seq[Sequence]) -> None:
        """seq leaves the queue for a seat: its group has had one more; under lpm each sequence
        queued before it was passed over once more."""
        if self.policy == "lpm":
            for older in list(waiting)[:list(waiting).index(seq)]:
                self.skips[older.seq_id] += 1
        self.forget(seq)
        self.counts[seq.group] = self.count(seq.group) + 1

    def count(self, group: str) -> int:
        """A group's admissions, as fairness reads them. A group that comes back after having
        nothing here starts just below every group here now (start-time fair queueing): its old
        history counts neither against it nor for it, and the seat a busier group gave up for it
        is its own, not the preempted sequence's again."""
        if group in self.counts:
            return self.counts[group]
        return min(self.counts.values(), default=1) - 1

    def forget(self, seq: Sequence) -> None:
        """seq left the queue (admitted, or finished while waiting)."""
        self.skips.pop(seq.seq_id, None)
        self.names.pop(seq.seq_id, None)

    def prune(self, live: list[Sequence]) -> None:
        """Forget the groups with no sequence left here (see `count`)."""
        groups = {s.group for s in live}
        if any(g not in groups for g in self.counts):
            self.counts = Counter({g: n for g, n in self.counts.items() if g in groups})
