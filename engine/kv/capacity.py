"""What the scheduler sizes its decisions by: a read-only view of the KV cache's room.

Who writes what: nothing here writes; the pool and the layout change under the KV manager's
verbs (engine/kv/manager.py), and this view reads them as they are. The names say which room:

  total       the pool's pages (this model's share's, over a pool several models draw from)
  most        the most pages this model can ever hold (a share's cap, less the others' floors)
  free_now    pages free this moment, without reclaiming anything
  spare       pages held that no running sequence needs: idle slots, then cached alone
  obtainable  free now, plus spare, plus what other tenants of a shared pool would lend
  pages_for   the pages a sequence of n tokens maps, over every region
  can_place   is there a place (a slot) for n more sequences?
  swaps       can a preempted sequence's pages go to the swap tier (a virtual layout with one)?
"""
from __future__ import annotations

from engine.kv.layout import KVLayout
from engine.kv.prefix_cache import PrefixCache


class KVCapacity:
    def __init__(self, layout: KVLayout, prefix_cache: PrefixCache | None):
        self.layout, self.pool, self.prefix_cache = layout, layout.pool, prefix_cache

    @property
    def total(self) -> int:
        return self.pool.num_pages

    @property
    def most(self) -> int:
        return self.pool.most_pages

    @property
    def free_now(self) -> int:
        return self.pool.num_free

    @property
    def spare(self) -> int:
        cached = self.prefix_cache.evictable_pages() if self.prefix_cache else 0
        return self.layout.reclaimable_pages() + cached

    @property
    def obtainable(self) -> int:
        """A lower bound: free now without preempting anyone."""
        return self.pool.num_free + self.spare + self.pool.borrowable()

    def pages_for(self, num_tokens: int) -> int:
        return self.layout.pages_for(num_tokens)

    def can_place(self, n: int = 1) -> bool:
        return self.layout.can_allocate(n)

    @property
    def swaps(self) -> bool:
        return self.layout.swaps
