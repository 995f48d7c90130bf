"""How sequences enter a step's running batch: swapped ones back first, then waiting ones
admitted with their cached prefix, while the token budget, the seats and the free pages above
a headroom allow (the scheduler's second and third passes, engine/sched/scheduler.py).

Who writes what: a sequence's computed and cached token counts as the KV manager admits it;
its queue moves go through SeqQueues (engine/sched/queues.py); which waiting sequence goes next
is AdmissionOrder's (engine/sched/admission.py).
"""
from __future__ import annotations

import logging

from engine.kv.manager import KVManager
from engine.request.sequence import Sequence
from engine.sched.admission import AdmissionOrder
from engine.sched.queues import SeqQueues
from engine.sched.step import Scheduled

log = logging.getLogger("vkv.scheduler")


class Intake:
    def __init__(self, kv: KVManager, queues: SeqQueues, order: AdmissionOrder, max_num_seqs: int,
                 headroom_pages: int):
        self.kv, self.queues, self.order = kv, queues, order
        self.max_num_seqs, self.headroom_pages = max_num_seqs, headroom_pages

    def fits(self, seq: Sequence, budget: int) -> bool:
        """Are there pages for its first chunk, above the headroom a running batch keeps?"""
        headroom = self.headroom_pages if self.queues.running else 0
        return self.kv.capacity.obtainable >= self.kv.capacity.pages_for(min(len(seq), budget)) + headroom

    def resume_swapped(self, budget: int) -> Scheduled:
        """Swapped sequences back in, the most urgent first, while they fit above the headroom."""
        scheduled, q = [], self.queues
        while q.swapped and budget > 0 and len(q.running) < self.max_num_seqs:
            seq = min(q.swapped, key=self.order.urgency)  # ties: the first swapped out
            if not self.order.adapter_fits(seq, q.running):
                break
            n = min(seq.num_pending_tokens, budget)
            keep_free = self.headroom_pages if q.running else 0
            if not self.kv.swap_in(seq, seq.num_computed_tokens + n, keep_free):
                break
            q.resume(seq)
            if n:  # an idle beam comes back with nothing to compute: it must not sample
                scheduled.append((seq, n))
                budget -= n
        return scheduled

    def admit_waiting(self, budget: int) -> Scheduled:
        scheduled, q = [], self.queues
        while q.waiting and budget > 0 and len(q.running) < self.max_num_seqs and self.kv.capacity.can_place():
            seq = self.order.next(q.waiting, q.running)
            if seq is None or not self.fits(seq, budget):
                break
            n = self._place(seq, budget, cached=True)
            if n is None and not any(s.num_pending_tokens > 0 for s in q.running):
                # Short with nothing running that will give pages back (alone, or beside beams idle
                # for their siblings): a hit whose last row runs into the next page makes that page a
                # private copy while the cache keeps its original mapped (a page or two more than
                # `fits` counted). Without the hit it needs what `fits` counted: computed again rather
                # than retried for ever.
                seq.num_cached_tokens = None
                n = self._place(seq, budget, cached=False)
            if n is None:
                break
            q.admit(seq)
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
        try:  # (an error, not only a shortage, gives back what admit took: vmm.NoMemory after a wake)
            if self.kv.ensure_mapped(seq, seq.num_computed_tokens + n):
                return n
        except BaseException:
            self._unplace(seq)
            raise
        self._unplace(seq)
        return None

    def _unplace(self, seq: Sequence) -> None:
        self.kv.release(seq, keep_pages=False)
        seq.num_computed_tokens = 0
