"""Continuous batching with a token budget, chunked prefill, headroom and preemption. The
scheduler alone drives the KV cache's life cycle and alone advances `num_computed_tokens`.

Each step first serves running sequences, oldest first (a decode token, or the next chunk of a
prefill); if their pages cannot be mapped the newest running sequence is preempted. Then
swapped sequences come back, and only when none is left are waiting sequences admitted, while
the token budget, the sequence limit and free pages above a headroom allow.

Preemption (`preemption_mode`, vLLM's name): by recompute, its pages go back and it waits at
the front of the queue with every token it has generated, to prefill them all again. By swap,
its private pages' bytes go to the swap tier and it keeps its computed tokens; coming back
costs two copies of those bytes instead of a prefill. The cost estimate: a prefill of t tokens
costs about t times a decode token's compute, and copying a token's KV out and in costs well
under that (benchmarks/bench_swap.py measures both on this machine), so swap wins for every
sequence with at least `swap_min_tokens` computed; below that, and whenever the tier is full,
recompute is used.

Admission order: first come, first served, except that a group (the sequences of one client
request) that has had fewer sequences admitted goes before one that has had more, so a request
of many prompts cannot hold the head of the queue for everyone: groups take turns. With `policy="priority"` the lowest priority
value goes first (ties: fairness, then arrival) and the least urgent running sequence is the
one preempted; otherwise the newest is. With `policy="lpm"` (SGLang's longest prefix match)
the sequence with the most prompt pages already cached, in the pool or a KV tier, goes first
(ties: fairness, then arrival), so a prefix is used while it is still cached; a queue longer
than LPM_MAX_QUEUE is served FCFS (matching every prompt would cost more than it saves), and
a sequence passed over LPM_MAX_SKIPS times by later arrivals goes next: nobody starves.

A running sequence may have nothing to compute: a beam waiting for its siblings' logprobs.
If such idle sequences hold the seats or pages a waiting one needs, so that nothing at all
can run, they step aside (newest first, to the back of the queue) until it fits.
"""
from __future__ import annotations

import math
from collections import Counter, deque

from engine.config import PREEMPTION_MODES, SCHEDULING_POLICIES
from engine.kv.base import KVCacheBase
from engine.sequence import Sequence, SequenceStatus

SWAP_MIN_TOKENS = 16  # below this, recompute (see the note on preemption above)
LPM_MAX_QUEUE = 128  # SGLang's threshold: longer queues are served FCFS
LPM_MAX_SKIPS = 8  # times a waiting sequence may be passed over by later ones under lpm
Scheduled = list[tuple[Sequence, int]]  # (sequence, number of its tokens computed this step)


class Scheduler:
    def __init__(self, kv: KVCacheBase, max_num_seqs: int, max_num_batched_tokens: int,
                 headroom: float = 0.01, policy: str = "fcfs", preemption_mode: str = "recompute",
                 swap_min_tokens: int = SWAP_MIN_TOKENS):
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}: choose one of {SCHEDULING_POLICIES}")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"unknown preemption mode {preemption_mode!r}: choose one of {PREEMPTION_MODES}")
        self.kv, self.policy, self.preemption_mode = kv, policy, preemption_mode
        self.swap_min_tokens = swap_min_tokens
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.headroom_pages = max(1, math.ceil(headroom * kv.pool.num_pages))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.admitted: Counter[str] = Counter()  # per group with sequences here: admissions so far
        self.skips: Counter[int] = Counter()  # lpm: per waiting seq_id, times later ones went first
        self._names: dict[int, tuple[int, list[bytes]]] = {}  # lpm: seq_id -> (its length, page names)
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # -- one step -------------------------------------------------------------------------
    def schedule(self, token_budget: int | None = None) -> Scheduled:
        """What this step computes, at most token_budget tokens (default max_num_batched_tokens);
        every page it writes is mapped and private."""
        budget = min(self.max_num_batched_tokens, token_budget or self.max_num_batched_tokens)
        if len(self.admitted) > 2 * (len(self.waiting) + len(self.running)):  # forget groups gone
            live = {s.group for s in (*self.waiting, *self.running)}
            self.admitted = Counter({g: n for g, n in self.admitted.items() if g in live})
        scheduled = self._schedule_running(budget)
        budget -= sum(n for _, n in scheduled)
        resumed = self._resume_swapped(budget)
        budget -= sum(n for _, n in resumed)
        scheduled += resumed
        if not self.swapped:  # swapped sequences go first: no admission until they are back
            scheduled += self._admit_waiting(budget)
        if not scheduled and (self.waiting or self.swapped):
            while self.swapped:  # stuck: whatever holds their way, they recompute instead
                self._requeue(self.swapped.pop(), to_front=True)
            self._unblock(budget)
            scheduled = self._admit_waiting(budget)
        return scheduled

    def update_after_step(self, scheduled: Scheduled, rejected: dict[Sequence, int] | None = None) -> None:
        """The step computed what it was given, less the drafted tokens the model refused
        (their rows are overwritten later): count it, and offer complete pages to the prefix
        cache. Sequences that ended during the step are gone already."""
        for seq, n in scheduled:
            if seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens += n - (rejected or {}).get(seq, 0)
                self.kv.commit(seq)

    def _schedule_running(self, budget: int) -> Scheduled:
        scheduled, i = [], 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending_tokens + len(seq.draft), budget)
            seq.draft = seq.draft[:max(0, n - seq.num_pending_tokens)]  # drafts the budget leaves room for
            if n == 0:  # idle: a beam waiting for its siblings
                i += 1
            elif self._map_or_preempt(seq, seq.num_computed_tokens + n, i):
                scheduled.append((seq, n))
                budget -= n
                i += 1
        return scheduled

    def _map_or_preempt(self, seq: Sequence, num_tokens: int, position: int) -> bool:
        """Map seq (at `position` in the running list) its pages, preempting the newest (or
        least urgent) sequences not yet scheduled this step; False if seq itself had to go."""
        while not self.kv.ensure_mapped(seq, num_tokens):
            victim = self._victim(self.running[position:])
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def _resume_swapped(self, budget: int) -> Scheduled:
        """Swapped sequences back in, the most urgent first, while they fit above the headroom."""
        scheduled = []
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = min(self.swapped, key=self._urgency)  # ties: the first swapped out
            n = min(seq.num_pending_tokens, budget)
            keep_free = self.headroom_pages if self.running else 0
            if not self.kv.swap_in(seq, seq.num_computed_tokens + n, keep_free):
                break
            self.swapped.remove(seq)
            self._run(seq)
            if n:  # an idle beam comes back with nothing to compute: it must not sample
                scheduled.append((seq, n))
                budget -= n
        return scheduled

    def _admit_waiting(self, budget: int) -> Scheduled:
        scheduled = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and self.kv.can_allocate():
            seq = self._next_waiting()
            if not self._fits(seq, budget):
                break
            seq.num_computed_tokens = self.kv.admit(seq)  # a cached prefix counts as computed
            n = min(seq.num_pending_tokens, budget)
            if not self.kv.ensure_mapped(seq, seq.num_computed_tokens + n):
                self.kv.release(seq, keep_pages=False)
                seq.num_computed_tokens = 0
                break
            if self.policy == "lpm":  # each sequence queued before seq is passed over once more
                for older in list(self.waiting)[:self.waiting.index(seq)]:
                    self.skips[older.seq_id] += 1
                self.skips.pop(seq.seq_id, None)
                self._names.pop(seq.seq_id, None)
            self.waiting.remove(seq)
            self.admitted[seq.group] += 1
            self._run(seq)
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    def _next_waiting(self) -> Sequence:
        """The waiting sequence to admit next (queue order breaks ties: preempted ones are at
        the front)."""
        if len(self.waiting) == 1:
            return self.waiting[0]
        waiting = self.waiting
        fair = lambda i: (self._urgency(waiting[i]), self.admitted[waiting[i].group], i)
        if self.policy != "lpm" or len(waiting) > LPM_MAX_QUEUE:
            return waiting[min(range(len(waiting)), key=fair)]
        starved = [i for i in range(len(waiting)) if self.skips[waiting[i].seq_id] >= LPM_MAX_SKIPS]
        if starved:
            return waiting[starved[0]]
        cached = [self.kv.cached_prefix_pages(self._page_names(seq)) for seq in waiting]
        return waiting[min(range(len(waiting)), key=lambda i: (-cached[i], fair(i)))]

    def _page_names(self, seq: Sequence) -> list[bytes]:
        length, names = self._names.get(seq.seq_id, (-1, []))
        if length != len(seq):
            names = self.kv.page_names(seq)
            self._names[seq.seq_id] = (len(seq), names)
        return names

    def _urgency(self, seq: Sequence) -> int:
        """Lower goes first: the request's priority under the priority policy, else all equal."""
        return seq.priority if self.policy == "priority" else 0

    def _fits(self, seq: Sequence, budget: int) -> bool:
        headroom = self.headroom_pages if self.running else 0
        return self.kv.num_free_pages >= self.kv.pages_for(min(len(seq), budget)) + headroom

    def _unblock(self, budget: int) -> None:
        idle = [s for s in self.running if s.num_pending_tokens == 0]
        head = self._next_waiting()
        while idle and (len(self.running) >= self.max_num_seqs or not self._fits(head, budget)):
            self.preempt(idle.pop(), to_front=False)

    def _run(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    # -- sequences coming and going -------------------------------------------------------
    def preempt(self, seq: Sequence, to_front: bool = True) -> None:
        """Make room: swap seq out when that is the cheaper way back, else recompute it later.
        to_front=False: an idle beam stepping aside, recomputed."""
        self.running.remove(seq)
        self.num_preemptions += 1
        if self.preemption_mode == "swap" and to_front and seq.num_computed_tokens >= self.swap_min_tokens \
                and self.kv.swap_out(seq):
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            return
        self._requeue(seq, to_front)

    def give_up(self, pages: int) -> None:
        """Another model of a shared pool, below its fair share, needs `pages` (vmm/share.py):
        preempt running sequences, the newest (or least urgent) first, until that many more
        are free. Called between this model's steps."""
        target = self.kv.pool.num_free + pages
        while self.running and self.kv.pool.num_free < target:
            self.preempt(self._victim(self.running))
            self.kv.reclaim(target)  # a preempted sequence's pages may stay cached: let them go

    def _victim(self, candidates: list[Sequence]) -> Sequence:
        """Who is preempted among running candidates (the tail of the running list): the least
        urgent under the priority policy, else the newest."""
        if self.policy == "priority":
            return max(candidates, key=lambda s: (s.priority, s.arrival, s.seq_id))
        return candidates[-1]

    def _requeue(self, seq: Sequence, to_front: bool) -> None:
        """seq gives its KV back and waits to compute all its tokens again."""
        self.kv.release(seq, keep_pages=False)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        if to_front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """child continues from parent sharing the pages of its computed tokens, and runs: True.
        With no seat or slot for it (or parent not running), child queues to compute its
        tokens itself: False."""
        if parent.status is not SequenceStatus.RUNNING or len(self.running) >= self.max_num_seqs \
                or not self.kv.can_allocate():
            self.add(child)
            return False
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self._run(child)
        return True

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finished, aborted or failed: leave the queues, give the KV back."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.kv.release(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.kv.release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.skips.pop(seq.seq_id, None)
            self._names.pop(seq.seq_id, None)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def finish_request(self, request_id: str, reason: str) -> None:
        """Finish every sequence of one request, wherever it is."""
        for seq in [s for s in (*self.running, *self.swapped, *self.waiting) if s.request_id == request_id]:
            self.finish(seq, reason)
