"""What one model does for the others of a physical pool several models share (vmm.Tenant).

Over a share of a pool (vmm/share.py), a model that is short asks the others for room: first
the pages they hold that nothing running needs, then, where one holds more than its fair share,
that it preempt running sequences. This object answers for one engine, from its scheduler and
KV manager; the engine registers it with its share when it is built (engine/core/llm_engine.py)
and it is called between that engine's steps. Who writes what: it frees through the KV
manager's `reclaim` and preempts through the scheduler's `preempt`, the same verbs a step uses.
"""
from __future__ import annotations

from engine.sched.scheduler import Scheduler


class SchedulerTenant:
    def __init__(self, scheduler: Scheduler):
        self.scheduler, self.kv = scheduler, scheduler.kv

    def spare_pages(self) -> int:
        return self.kv.capacity.spare

    def free_spare(self, pages: int) -> None:
        self.kv.reclaim(self.kv.capacity.free_now + pages)

    def preempt_for(self, pages: int) -> None:
        """Preempt running sequences, the newest (or least urgent) first, until `pages` more are
        free; a preempted sequence's pages that stay cached are let go too."""
        scheduler, target = self.scheduler, self.kv.capacity.free_now + pages
        while scheduler.queues.running and self.kv.capacity.free_now < target:
            scheduler.preempt(scheduler.order.victim(scheduler.queues.running))
            self.kv.reclaim(target)
