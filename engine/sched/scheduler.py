"""Continuous batching with a token budget, chunked prefill, headroom and preemption.

One step, in one direction (vLLM v1's shape):

    schedule() -> SchedulerOutput -> the model runs it -> the rows are sampled ->
    update_from_output() -> a SeqOutput per sequence that moved -> the output processor

Who writes what. The scheduler decides; its parts carry out: SeqQueues (queues.py) moves
sequences between waiting, running and swapped with their KV, Intake (intake.py) admits, the
admission order (admission.py) says who goes next and who is preempted, a beam group
(beam_search.py) chooses its beams. The scheduler alone writes a sequence's tokens,
`num_computed_tokens` and `draft`. `update_from_output` applies what a step produced; a row
that raised fails its request alone. Stop strings are the output processor's (it reads text).

A step first serves running sequences, oldest first (a decode token, or a prefill's next
chunk), preempting the newest when their pages cannot be mapped; then swapped sequences come
back, and only when none is left are waiting ones admitted. Preemption (vLLM's
`preemption_mode`): by recompute a sequence's pages go back and it waits at the front; by swap
its private pages go to the swap tier, two copies where a prefill of t tokens costs about t
decode tokens (benchmarks/bench_swap.py), so swap is chosen from `swap_min_tokens` computed on.
Idle sequences (beams waiting for their siblings) that hold what a waiting one needs step
aside; a beam search is preempted whole, and fits the pool alone, so one search always ends.
"""
from __future__ import annotations

import logging
import math

import torch

from engine.sched.admission import AdmissionOrder
from engine.sched.intake import Intake
from engine.sched.queues import SeqQueues
from engine.sched.beam_search import BeamGroup, gang as beam_gang
from engine.config import check_scheduling
from engine.kv.manager import KVManager
from engine.sample.sampler import Sampled
from engine.request.sequence import Sequence, SequenceStatus
from engine.sched.step import RowResult, Scheduled, SchedulerOutput, SeqOutput

log = logging.getLogger("vkv.scheduler")

SWAP_MIN_TOKENS = 16  # below this, recompute (the note above)


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
        self.headroom_pages = max(1, math.ceil(headroom * kv.capacity.total))
        self.order = AdmissionOrder(kv, policy, max_loras)
        self.queues = SeqQueues(kv, self.order, max_num_seqs)  # (the scheduler decides; the queues move)
        self.intake = Intake(kv, self.queues, self.order, max_num_seqs, self.headroom_pages)
        self.num_preemptions = 0

    # -- one step -------------------------------------------------------------------------
    def schedule(self, token_budget: int | None = None, drafts: dict[Sequence, list[int]] | None = None
                 ) -> SchedulerOutput:
        """What this step computes, at most token_budget tokens (default max_num_batched_tokens);
        every page it writes is mapped and private. drafts: speculative tokens proposed for
        running sequences, verified this step as far as the budget leaves room."""
        budget = min(self.max_num_batched_tokens, token_budget or self.max_num_batched_tokens)
        for seq in self.queues.running:
            seq.draft = (drafts or {}).get(seq, [])
        self.order.prune([*self.queues.waiting, *self.queues.running])
        self._share_seats(budget)
        scheduled = self._schedule_running(budget)
        budget -= sum(n for _, n in scheduled)
        resumed = self.intake.resume_swapped(budget)
        budget -= sum(n for _, n in resumed)
        scheduled += resumed
        if not self.queues.swapped:  # swapped sequences go first: no admission until they are back
            scheduled += self.intake.admit_waiting(budget)
        if not scheduled and (self.queues.waiting or self.queues.swapped):
            while self.queues.swapped:  # stuck: whatever holds their way, they recompute instead
                self.queues.requeue(self.queues.swapped[-1], to_front=True)
            self._unblock(budget)
            scheduled = self.intake.admit_waiting(budget)
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
        forks, seats, taken = {}, self.max_num_seqs - len(self.queues.running), 0
        for seq, n in scheduled:
            if not seq.siblings or seq.num_output_tokens or seq.num_computed_tokens + n < len(seq):
                continue
            for sibling in [s for s in seq.siblings if not s.is_finished]:  # (an aborted one stays out)
                if taken < seats and self.kv.capacity.can_place(taken + 1):
                    forks.setdefault(seq, []).append(sibling)
                    taken += 1
                else:
                    self.queues.add(sibling)
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
                if not self.queues.fork(parent, child):  # queued instead: it samples after its own prompt
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
        for seq in self.queues.running:
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
                self.queues.finish(seq, reason)
                break
        return [SeqOutput(seq, taken, seq.finish_reason)]

    def _advance_beams(self, group: BeamGroup) -> list[SeqOutput]:
        """Carry out a beam group's choice: forks first (a parent still holds only its own
        tokens; no room: the child queues and recomputes), then the beams nobody continues are
        dropped, then every beam takes its token."""
        continuations = group.advance()
        beams = [self._forked(c.parent) if c.branch else c.parent for c in continuations]
        outputs = []
        for seq in group.unchosen(continuations):
            self.queues.finish(seq, "dropped")
            outputs.append(SeqOutput(seq, [], "dropped"))
        for beam, c in zip(beams, continuations):
            beam.token_ids.append(c.token_id)
            outputs.append(SeqOutput(beam, [Sampled(c.token_id)]))
        group.take(beams, continuations)
        return outputs

    def fail_request(self, request_id: str, error: str) -> list[SeqOutput]:
        """A request fails: every sequence of it ends with "error"; the others go on."""
        seqs = self.queues.finish_request(request_id, "error")
        for seq in seqs:
            if seq.beam:
                seq.beam.fail()
        return [SeqOutput(seq, [], "error", error) for seq in seqs]

    def _share_seats(self, budget: int) -> None:
        """A client waiting with nothing running while the seats or pages are taken gets one
        (AdmissionOrder.seat_to_free): a client's burst waits; it does not hold everyone."""
        fits = lambda seq: len(self.queues.running) < self.max_num_seqs and self.intake.fits(seq, budget)
        q = self.queues
        while (hog := self.order.seat_to_free(q.waiting, q.running, self.max_num_seqs, fits)) is not None:
            self.preempt(hog)

    def _schedule_running(self, budget: int) -> Scheduled:
        scheduled, i = [], 0
        while i < len(self.queues.running) and budget > 0:
            seq = self.queues.running[i]
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
            running = self.queues.running
            candidates = running if self.order.policy == "priority" else running[position - before:]
            victim = self.order.victim(candidates)
            if victim is seq:  # another search's beam idle for its siblings gives its pages first
                idle = [s for s in running if s.beam and s.beam is not seq.beam and s.num_pending_tokens == 0]
                victim = idle[-1] if idle else seq
            gang, at = beam_gang(victim, self.queues.running), self.queues.running.index(seq)
            for gone in gang:
                if self.queues.running.index(gone) < at:
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

    def _unblock(self, budget: int) -> None:
        idle = [s for s in self.queues.running if s.num_pending_tokens == 0]
        head = self.order.next(self.queues.waiting, self.queues.running)
        if head is None:
            return
        while idle and (len(self.queues.running) >= self.max_num_seqs or not self.intake.fits(head, budget)):
            seq = idle.pop()
            if seq.status is SequenceStatus.RUNNING:  # (not gone with a beam of its search)
                self.preempt(seq, to_front=False)

    # -- sequences coming and going -------------------------------------------------------
    def preempt(self, seq: Sequence, to_front: bool = True) -> None:
        """Make room: swap seq out when that is the cheaper way back, else recompute it later;
        a beam goes with every running beam of its search (beam_search.gang), in their order.
        to_front=False: an idle beam stepping aside, recomputed."""
        gang = beam_gang(seq, self.queues.running)
        for s in reversed(gang) if to_front else gang:  # (each to the front: the first ends first)
            self._preempt_one(s, to_front)

    def _preempt_one(self, seq: Sequence, to_front: bool) -> None:
        self.num_preemptions += 1
        seq.draft = []  # (drafts belong to a step it is no longer in: kept, the next update rewound it)
        if not (self.preemption_mode == "swap" and self.kv.capacity.swaps and to_front
                and seq.num_computed_tokens >= self.swap_min_tokens and self.queues.swap_out(seq)):
            self.queues.requeue(seq, to_front)

    def _forked(self, parent: Sequence) -> Sequence:
        child = parent.branch()
        self.queues.fork(parent, child)
        return child
