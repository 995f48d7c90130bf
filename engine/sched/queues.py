"""A scheduler's sequences in their three queues, and the moves between them.

Who writes what: `SeqQueues` alone writes which queue a sequence is in and its status, and moves
its KV with it through the KV manager: a sequence that leaves running for waiting gives its KV
back (`requeue`), one that leaves for swapped has its private pages swapped out (`swap_out`),
one that finishes releases its place (`finish`). The scheduler (engine/sched/scheduler.py)
decides every move; admission's bookkeeping (engine/sched/admission.py) hears of each admission
and of each waiting sequence that finishes.

    waiting --admit--> running --requeue--> waiting      running --swap_out--> swapped
    swapped --resume--> running      (new) --fork--> running      any --finish--> (gone)
"""
from __future__ import annotations

from collections import deque

from engine.kv.manager import KVManager
from engine.request.sequence import Sequence, SequenceStatus
from engine.sched.admission import AdmissionOrder


class SeqQueues:
    def __init__(self, kv: KVManager, order: AdmissionOrder, max_num_seqs: int):
        self.kv, self.order, self.max_num_seqs = kv, order, max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()

    def add(self, seq: Sequence, to_front: bool = False) -> None:
        seq.status = SequenceStatus.WAITING
        if to_front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def run(self, seq: Sequence) -> None:
        """A sequence that holds its KV place (admitted, forked) joins the running batch."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def admit(self, seq: Sequence) -> None:
        """A waiting sequence the KV manager admitted runs."""
        self.order.admitted(seq, self.waiting)
        self.waiting.remove(seq)
        self.run(seq)

    def resume(self, seq: Sequence) -> None:
        """A swapped sequence whose pages came back runs."""
        self.swapped.remove(seq)
        self.run(seq)

    def requeue(self, seq: Sequence, to_front: bool) -> None:
        """A running (or swapped) sequence gives its KV back and waits to compute all its tokens again."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        self.kv.release(seq, keep_pages=False)
        seq.num_computed_tokens = 0
        seq.draft = []
        self.add(seq, to_front)

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """child continues from parent sharing the pages of its computed tokens, and runs: True.
        With no seat or place for it (or parent not running), child waits to compute its tokens
        itself: False."""
        if parent.status is not SequenceStatus.RUNNING or len(self.running) >= self.max_num_seqs \
                or not self.kv.capacity.can_place():
            self.add(child)
            return False
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.run(child)
        return True

    def swap_out(self, seq: Sequence) -> bool:
        """A running sequence's private pages to the swap tier; False, nothing done, if it is full."""
        if not self.kv.swap_out(seq):
            return False
        self.running.remove(seq)
        seq.status = SequenceStatus.SWAPPED
        self.swapped.append(seq)
        return True

    def retract_all(self) -> None:
        """Every running and swapped sequence gives its KV back and waits at the front, in the
        order it had: computed again when scheduling goes on (pause_generation "retract")."""
        for seq in reversed([*self.running, *self.swapped]):
            self.requeue(seq, to_front=True)

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
