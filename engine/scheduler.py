"""Continuous batching with a token budget, chunked prefill, headroom and preemption.

One step, in one direction (vLLM v1's shape):

    schedule() -> SchedulerOutput -> the model runs it -> the rows are sampled ->
    update_from_output() -> a SeqOutput per sequence that moved -> the output processor

The scheduler alone drives the KV cache's life cycle and alone writes a sequence's schedule
state: its tokens, `num_computed_tokens`, `draft`, status and finish reason. `schedule` decides
everything about the step, forks included (a request's n > 1 siblings fork from its first
sequence when its prompt is computed, sharing the prompt's pages, and sample from its row);
`update_from_output` applies what the step produced: computed tokens, forks, sampled tokens,
the grammar's advance, stops by token and by length, beam groups' choices, and failures (a row
that raised fails its request alone). Stop strings are found by the output processor, which
reads text; the engine then finishes those sequences here.

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

Admission order: first come, first served, except that a group (the sequences of one client)
that has had fewer sequences admitted goes before one that has had more, so a request of many
prompts cannot hold the head of the queue for everyone: groups take turns. And seats are
shared: a group waiting with nothing running while another holds more than its fair share of
the seats (or of the pages it needs) gets one, the other's newest sequence preempted. With `policy="priority"` the lowest priority
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

import logging
import math
from collections import Counter, deque

import torch

from engine.config import check_scheduling
from engine.kv.base import KVCacheBase
from engine.sampler import Sampled
from engine.sequence import Sequence, SequenceStatus
from engine.step import RowResult, Scheduled, SchedulerOutput, SeqOutput
from engine.structured import consume
from vmm import PoolShare

log = logging.getLogger("vkv.scheduler")

SWAP_MIN_TOKENS = 16  # below this, recompute (see the note on preemption above)
LPM_MAX_QUEUE = 128  # SGLang's threshold: longer queues are served FCFS
LPM_MAX_SKIPS = 8  # times a waiting sequence may be passed over by later ones under lpm


class Scheduler:
    def __init__(self, kv: KVCacheBase, max_num_seqs: int, max_num_batched_tokens: int,
                 headroom: float = 0.01, policy: str = "fcfs", preemption_mode: str = "recompute",
                 swap_min_tokens: int = SWAP_MIN_TOKENS, eos_ids: tuple[int, ...] = (),
                 max_model_len: int | None = None, max_loras: int | None = None):
        check_scheduling(policy, preemption_mode)
        self.kv, self.policy, self.preemption_mode = kv, policy, preemption_mode
        self.swap_min_tokens = swap_min_tokens
        self.eos_ids, self.max_model_len = eos_ids, max_model_len
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_loras = max_loras  # distinct LoRA adapters running at once (None: LoRA is off)
        if isinstance(kv.pool, PoolShare):  # one of several models over one pool: it asks us for pages
            kv.pool.register(self)
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
    def schedule(self, token_budget: int | None = None, drafts: dict[Sequence, list[int]] | None = None
                 ) -> SchedulerOutput:
        """What this step computes, at most token_budget tokens (default max_num_batched_tokens);
        every page it writes is mapped and private. drafts: speculative tokens proposed for
        running sequences, verified this step as far as the budget leaves room."""
        budget = min(self.max_num_batched_tokens, token_budget or self.max_num_batched_tokens)
        for seq in self.running:
            seq.draft = (drafts or {}).get(seq, [])
        if len(self.admitted) > 2 * (len(self.waiting) + len(self.running)):  # forget groups gone
            live = {s.group for s in (*self.waiting, *self.running)}
            self.admitted = Counter({g: n for g, n in self.admitted.items() if g in live})
        self._share_seats(budget)
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
        scheduled, failed = self._checked(scheduled)
        return SchedulerOutput(scheduled, self._plan_forks(scheduled), failed)

    def _checked(self, scheduled: Scheduled) -> tuple[Scheduled, list[SeqOutput]]:
        """Every scheduled sequence has a token left to compute, and computes at least one and
        none past what it knows (its tokens and drafts). One that breaks this (a bug: never
        expected) would fail the whole batch in the forward pass, read another's logits, or
        wait forever; its request fails alone instead, the numbers logged."""
        failed = []
        for seq, n in scheduled:
            pending = seq.num_pending_tokens
            if not seq.is_finished and not (pending >= 1 and 1 <= n <= pending + len(seq.draft)):
                log.error("scheduling %s: %d tokens at %d computed of %d (+%d drafted): its request fails",
                          seq.request_id, n, seq.num_computed_tokens, len(seq), len(seq.draft))
                failed += self.fail_request(seq.request_id, "internal error while scheduling this request")
        return [(seq, n) for seq, n in scheduled if not seq.is_finished], failed

    def _plan_forks(self, scheduled: Scheduled) -> dict[Sequence, list[Sequence]]:
        """Siblings of a sequence whose prompt this step completes fork from it after the step,
        while seats and slots last; the others queue to compute the prompt themselves."""
        forks, seats, taken = {}, self.max_num_seqs - len(self.running), 0
        for seq, n in scheduled:
            if not seq.siblings or seq.num_output_tokens or seq.num_computed_tokens + n < len(seq):
                continue
            for sibling in [s for s in seq.siblings if not s.is_finished]:  # (an aborted one stays out)
                if taken < seats and self.kv.can_allocate(taken + 1):
                    forks.setdefault(seq, []).append(sibling)
                    taken += 1
                else:
                    self.add(sibling)
            seq.siblings = []
        return forks

    def update_from_output(self, out: SchedulerOutput, results: dict[Sequence, RowResult]) -> list[SeqOutput]:
        """Apply what the step produced; a SeqOutput for each sequence that took tokens,
        finished or failed (those failed while scheduling first)."""
        for seq, n in out.scheduled:  # computed: all it was given, less the drafts refused
            if seq.status is SequenceStatus.RUNNING:
                result = results.get(seq)
                refused = len(seq.draft) + 1 - len(result) if seq.draft and isinstance(result, list) else 0
                seq.num_computed_tokens += n - refused  # (a refused draft's row is overwritten later)
                self.kv.commit(seq)
        results = dict(results)
        for parent, children in out.forks.items():
            for child in children:
                if not self.fork(parent, child):  # queued instead: it samples after its own prompt
                    results.pop(child, None)
        outputs, groups = list(out.failed), []
        for seq, result in results.items():
            if seq.is_finished:  # its request failed earlier in this step
                continue
            if isinstance(result, Exception):
                outputs += self.fail_request(seq.request_id, f"{type(result).__name__}: {result}")
            elif isinstance(result, torch.Tensor):
                seq.beam.offer(seq, result)
                groups += [seq.beam] if seq.beam not in groups else []
            else:
                outputs += self._guarded(seq, self._take, seq, result)
        for group in groups:
            if group.live and group.ready:
                outputs += self._guarded(next(iter(group.live)), self._advance_beams, group)
        for seq in self.running:
            seq.draft = []
        return outputs

    def _guarded(self, seq: Sequence, fn, *args) -> list[SeqOutput]:
        """fn's outputs; if it raises, seq's request fails alone."""
        try:
            return fn(*args)
        except Exception as exc:
            return self.fail_request(seq.request_id, f"{type(exc).__name__}: {exc}")

    def _take(self, seq: Sequence, sampled: list[Sampled]) -> list[SeqOutput]:
        """seq takes its tokens, up to the first that stops it."""
        taken = []
        for s in sampled:
            seq.token_ids.append(s.token_id)
            taken.append(s)
            reason = self._stop_reason(seq)
            if reason:
                self.finish(seq, reason)
                break
        return [SeqOutput(seq, taken, seq.finish_reason)]

    def _stop_reason(self, seq: Sequence) -> str | None:
        """Why seq stops at the token it just took, if it does (stop strings aside: text is the
        output processor's)."""
        p, token = seq.params, seq.token_ids[-1]
        if seq.grammar is not None and consume(seq.grammar, token):
            return "stop"
        if seq.num_output_tokens >= p.min_tokens:
            if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
                return "stop"
        if seq.num_output_tokens >= p.max_tokens or (self.max_model_len and len(seq) >= self.max_model_len):
            return "length"
        return None

    def _advance_beams(self, group) -> list[SeqOutput]:
        """Carry out a beam group's choice: forks first (a parent still holds only its own
        tokens), then parents nobody continues are dropped, then every beam takes its token."""
        continuations = group.advance()
        beams, continued = [], set()
        for c in continuations:
            if c.parent in continued:
                child = c.parent.branch()
                self.fork(c.parent, child)  # no room: it queues and recomputes
                beams.append(child)
            else:
                beams.append(c.parent)
            continued.add(c.parent)
        outputs = []
        for seq in group.live:
            if seq not in continued:
                self.finish(seq, "dropped")
                outputs.append(SeqOutput(seq, [], "dropped"))
        for beam, c in zip(beams, continuations):
            beam.token_ids.append(c.token_id)
            outputs.append(SeqOutput(beam, [Sampled(c.token_id)]))
        group.take(beams, continuations)
        return outputs

    def fail_request(self, request_id: str, error: str) -> list[SeqOutput]:
        """A request fails: every sequence of it ends with "error"; the others go on."""
        seqs = self.finish_request(request_id, "error")
        for seq in seqs:
            if seq.beam:
                seq.beam.fail()
        return [SeqOutput(seq, [], "error", error) for seq in seqs]

    def _share_seats(self, budget: int) -> None:
        """A group (a client) waiting with no sequence running while the seats or pages are
        taken: the group holding the most, above its fair share of seats, gives back its newest
        until the waiting one fits. A client's burst waits; it does not hold everyone.
        (Not under the priority policy: there urgency decides.)"""
        if self.policy == "priority":
            return
        while self.waiting and self.running:
            held = Counter(s.group for s in self.running)
            waiting = {s.group for s in self.waiting if self._adapter_fits(s)}  # (one whose adapter waits cannot run)
            if all(held[g] for g in waiting):  # every waiting client has something running (the usual case)
                return
            head = self._next_waiting()
            if head is None or (len(self.running) < self.max_num_seqs and self._fits(head, budget)):
                return
            hog, most = held.most_common(1)[0]
            if most <= max(1, self.max_num_seqs // len(held.keys() | waiting)):
                return
            self.preempt(next(s for s in reversed(self.running) if s.group == hog))

    def _schedule_running(self, budget: int) -> Scheduled:
        scheduled, i = [], 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending_tokens + len(seq.draft), budget)
            seq.draft = seq.draft[:max(0, n - seq.num_pending_tokens)]  # drafts the budget leaves room for
            if n == 0 and seq.beam:  # idle: a beam waiting for its siblings
                i += 1
            elif n <= 0 or self._map_or_preempt(seq, seq.num_computed_tokens + n, i):  # (n <= 0: see _checked)
                scheduled.append((seq, n))
                budget -= max(n, 0)
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
            if not self._adapter_fits(seq):
                break
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
            if seq is None or not self._fits(seq, budget):
                break
            seq.num_computed_tokens = self.kv.admit(seq)  # a cached prefix counts as computed
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = seq.num_computed_tokens
            if seq.num_pending_tokens <= 0:  # never expected: a step over no rows would fail the engine
                log.warning("admitting %s (%d tokens) found %d computed: its last token is computed again",
                            seq.request_id, len(seq), seq.num_computed_tokens)
                seq.num_computed_tokens = len(seq) - 1  # its logits sample the next token
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

    def _next_waiting(self) -> Sequence | None:
        """The waiting sequence to admit next (queue order breaks ties: preempted ones are at
        the front); None when every one waits for a LoRA adapter's turn."""
        waiting = self.waiting
        if self.max_loras is not None:
            waiting = [seq for seq in waiting if self._adapter_fits(seq)]
        if len(waiting) <= 1:
            return waiting[0] if waiting else None
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

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Can seq run beside the running sequences: its LoRA adapter is one of theirs, or
        fewer than max_loras distinct ones run (vLLM's rule)?"""
        if seq.lora is None or self.max_loras is None:
            return True
        running = {s.lora for s in self.running if s.lora is not None}
        return seq.lora in running or len(running) < self.max_loras

    def _urgency(self, seq: Sequence) -> int:
        """Lower goes first: the request's priority under the priority policy, else all equal."""
        return seq.priority if self.policy == "priority" else 0

    def _fits(self, seq: Sequence, budget: int) -> bool:
        headroom = self.headroom_pages if self.running else 0
        return self.kv.num_free_pages >= self.kv.pages_for(min(len(seq), budget)) + headroom

    def _unblock(self, budget: int) -> None:
        idle = [s for s in self.running if s.num_pending_tokens == 0]
        head = self._next_waiting()
        if head is None:
            return
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
        if self.preemption_mode == "swap" and self.kv.swaps and to_front \
                and seq.num_computed_tokens >= self.swap_min_tokens and self.kv.swap_out(seq):
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            return
        self._requeue(seq, to_front)

    # -- vmm.Tenant: what this model does for the others of a shared pool ----------------------
    def spare_pages(self) -> int:
        return self.kv.spare_pages()

    def give_back(self, pages: int) -> None:
        self.kv.give_back(pages)

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

    def retract_all(self) -> None:
        """Every running and swapped sequence gives its KV back and waits at the front, in the
        order it had: computed again when scheduling goes on (pause_generation "retract")."""
        retracted = [*self.running, *self.swapped]
        self.running.clear()
        self.swapped.clear()
        for seq in reversed(retracted):
            self._requeue(seq, to_front=True)

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

    def finish_request(self, request_id: str, reason: str) -> list[Sequence]:
        """Finish every sequence of one request, wherever it is; those sequences."""
        seqs = [s for s in (*self.running, *self.swapped, *self.waiting) if s.request_id == request_id]
        for seq in seqs:
            self.finish(seq, reason)
        return seqs
