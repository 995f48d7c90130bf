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

Admission order (fcfs with groups taking turns, priority, lpm; LoRA adapters' turns) and the
choice of whom to preempt are engine/sched/admission.py's. Seats are shared: a group waiting with
nothing running while another holds more than its fair share of the seats (or of the pages it
needs) gets one, the other's newest sequence preempted.

A running sequence may have nothing to compute: a beam waiting for its siblings' logprobs.
If such idle sequences hold the seats or pages a waiting one needs, so that nothing at all
can run, they step aside (newest first, to the back of the queue) until it fits. A beam search
is preempted whole: its other beams cannot advance without the one that goes, and holding
their pages idle while it computes its way back let two searches in one pool take each other's
beams for ever. Each search fits the pool alone (the admission check), so the one left running
finishes.
"""
from __future__ import annotations

import logging
import math
from collections import deque

import torch

from engine.sched.admission import AdmissionOrder
from engine.config import check_scheduling
from engine.kv.manager import KVManager
from engine.sample.sampler import Sampled
from engine.request.sequence import Sequence, SequenceStatus
from engine.sched.step import RowResult, Scheduled, SchedulerOutput, SeqOutput

log = logging.getLogger("vkv.scheduler")

SWAP_MIN_TOKENS = 16  # below this, recompute (see the note on preemption above)


class Scheduler:
    def __init__(self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int,
                 headroom: float = 0.01, policy: str = "fcfs", preemption_mode: str = "recompute",
                 swap_min_tokens: int = SWAP_MIN_TOKENS, eos_ids: tuple[int, ...] = (),
                 max_model_len: int | None = None, max_loras: int | None = None):
        check_scheduling(policy, preemption_mode)
        self.kv, self.policy, self.preemption_mode = kv, policy, preemption_mode
        self.swap_min_tokens = swap_min_tokens
        self.eos_ids, self.max_model_len = eos_ids, max_model_len
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_loras = max_loras  # distinct LoRA adapters running at once (None: LoRA is off)
        kv.join_pool(self)  # one of several models over one pool: the others ask us for pages
        self.headroom_pages = max(1, math.ceil(headroom * kv.num_pages))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.order = AdmissionOrder(kv, policy, max_loras)
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
        self.order.prune([*self.waiting, *self.running])
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

    def look_ahead(self, out: SchedulerOutput, steps: int) -> None:
        """Multi-step decode (engine/core/multi_step.py): map the rows each scheduled sequence
        writes in `steps` decode steps; out.steps is then `steps`, or 1 where memory is short (the
        pages mapped so far stay its, for its next steps)."""
        if steps > 1 and all(self.kv.ensure_mapped(seq, seq.num_computed_tokens + steps) for seq, _ in out.scheduled):
            out.steps = steps

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
        for seq, n in out.scheduled:  # computed: all it was given, less the drafts refused, plus
            if seq.status is SequenceStatus.RUNNING:  # the tokens a multi-step call fed back
                result = results.get(seq)
                fed = len(result) - 1 - len(seq.draft) if isinstance(result, list) else 0
                seq.num_computed_tokens += n + fed  # (a refused draft's row is overwritten later)
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
            reason = seq.stop_reason(self.eos_ids, self.max_model_len)
            if reason:
                self.finish(seq, reason)
                break
        return [SeqOutput(seq, taken, seq.finish_reason)]

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
        """A client waiting with nothing running while the seats or pages are taken gets one
        (AdmissionOrder.seat_to_free): a client's burst waits; it does not hold everyone."""
        fits = lambda seq: len(self.running) < self.max_num_seqs and self._fits(seq, budget)
        while (hog := self.order.seat_to_free(self.waiting, self.running, self.max_num_seqs, fits)) is not None:
            self.preempt(hog)

    def _schedule_running(self, budget: int) -> Scheduled:
        scheduled, i = [], 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending_tokens + len(seq.draft), budget)
            seq.draft = seq.draft[:max(0, n - seq.num_pending_tokens)]  # drafts the budget leaves room for
            if n == 0 and seq.beam:  # idle: a beam waiting for its siblings
                i += 1
                continue
            if n <= 0:  # (see _checked)
                scheduled.append((seq, n))
                i += 1
                continue
            ok, before, refund = self._map_or_preempt(seq, seq.num_computed_tokens + n, i, scheduled)
            i -= before  # sequences before it that were preempted
            budget += refund  # their tokens, scheduled earlier in this step
            if ok:
                scheduled.append((seq, n))
                budget -= n
                i += 1
        return scheduled

    def _map_or_preempt(self, seq: Sequence, num_tokens: int, position: int,
                        scheduled: Scheduled) -> tuple[bool, int, int]:
        """Map seq (at `position` in the running list) its pages, preempting the newest sequence
        not yet scheduled this step, or under the priority policy the least urgent running one
        (as vLLM: one scheduled earlier in this step is taken back out of it). Returns whether
        seq stays, how many preempted sequences stood before it, and the tokens taken back."""
        before = refund = 0
        while not self.kv.ensure_mapped(seq, num_tokens):
            candidates = self.running if self.order.policy == "priority" else self.running[position - before:]
            victim = self.order.victim(candidates)
            if victim is seq:  # another search's beam idle for its siblings gives its pages first
                idle = [s for s in self.running if s.beam and s.beam is not seq.beam and s.num_pending_tokens == 0]
                victim = idle[-1] if idle else seq
            gang, at = self._gang(victim), self.running.index(seq)
            for gone in gang:
                if self.running.index(gone) < at:
                    before += 1
                    for k, (done, n) in enumerate(scheduled):
                        if done is gone:
                            refund += max(n, 0)
                            del scheduled[k]
                            break
            self.preempt(victim)
            if seq in gang:
                return False, before, refund
        return True, before, refund

    def _resume_swapped(self, budget: int) -> Scheduled:
        """Swapped sequences back in, the most urgent first, while they fit above the headroom."""
        scheduled = []
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = min(self.swapped, key=self.order.urgency)  # ties: the first swapped out
            if not self.order.adapter_fits(seq, self.running):
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
            seq = self.order.next(self.waiting, self.running)
            if seq is None or not self._fits(seq, budget):
                break
            n = self._place(seq, budget, cached=True)
            if n is None and not any(s.num_pending_tokens > 0 for s in self.running):
                # Short with nothing running that will give pages back (alone, or beside beams idle
                # for their siblings): a hit whose last row runs into the next page makes that page a
                # private copy while the cache keeps its original mapped (a page or two more than
                # _fits counted). Without the hit it needs what _fits counted: computed again rather
                # than retried for ever.
                seq.num_cached_tokens = None
                n = self._place(seq, budget, cached=False)
            if n is None:
                break
            self.order.admitted(seq, self.waiting)
            self.waiting.remove(seq)
            self._run(seq)
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    def _place(self, seq: Sequence, budget: int, cached: bool) -> int | None:
        """Admit seq (with its cached prefix, if `cached`) and map the rows it computes first: how
        many, or None, with nothing held, when memory is short."""
        seq.num_computed_tokens = self.kv.admit(seq, cached)  # a cached prefix counts as computed
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
            return None
        return n

    def _fits(self, seq: Sequence, budget: int) -> bool:
        headroom = self.headroom_pages if self.running else 0
        return self.kv.num_free_pages >= self.kv.pages_for(min(len(seq), budget)) + headroom

    def _unblock(self, budget: int) -> None:
        idle = [s for s in self.running if s.num_pending_tokens == 0]
        head = self.order.next(self.waiting, self.running)
        if head is None:
            return
        while idle and (len(self.running) >= self.max_num_seqs or not self._fits(head, budget)):
            seq = idle.pop()
            if seq.status is SequenceStatus.RUNNING:  # (not gone with a beam of its search)
                self.preempt(seq, to_front=False)

    def _run(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    # -- sequences coming and going -------------------------------------------------------
    def preempt(self, seq: Sequence, to_front: bool = True) -> None:
        """Make room: swap seq out when that is the cheaper way back, else recompute it later;
        a beam goes with every running beam of its search (`_gang`), in their order.
        to_front=False: an idle beam stepping aside, recomputed."""
        gang = self._gang(seq)
        for s in reversed(gang) if to_front else gang:  # (each to the front: the first ends first)
            self._preempt_one(s, to_front)

    def _gang(self, seq: Sequence) -> list[Sequence]:
        """The running sequences that leave with seq: itself, and its beam search's other beams."""
        if seq.beam is None:
            return [seq]
        return [s for s in self.running if s is seq or s.beam is seq.beam]

    def _preempt_one(self, seq: Sequence, to_front: bool) -> None:
        self.running.remove(seq)
        self.num_preemptions += 1
        seq.draft = []  # (drafts belong to a step it is no longer in: kept, the next update rewound it)
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
        target = self.kv.free_pages + pages
        while self.running and self.kv.free_pages < target:
            self.preempt(self.order.victim(self.running))
            self.kv.reclaim(target)  # a preempted sequence's pages may stay cached: let them go

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
        seq.draft = []
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
            self.order.forget(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def finish_request(self, request_id: str, reason: str) -> list[Sequence]:
        """Finish every sequence of one request, wherever it is; those sequences."""
        seqs = [s for s in (*self.running, *self.swapped, *self.waiting) if s.request_id == request_id]
        for seq in seqs:
            self.finish(seq, reason)
        return seqs
