"""Automatic prefix caching: a page whose tokens are all computed is named by a hash of its
tokens chained to its parent page's hash, and kept for later sequences with the same prefix.

The cache holds one reference on every page of an entry (an entry is the page of each KV
region that covers those tokens), so a cached page outlives the sequence that wrote it. Entries
sit in LRU order; `evict` drops the least recently used entries nobody else maps, only when
the pool needs the memory.
"""
from __future__ import annotations

from collections import Counter, OrderedDict

from vmm import PageAllocator

NO_PARENT = 0


def chain_hash(parent: int, token_ids: list[int] | tuple[int, ...]) -> int:
    return hash((parent, tuple(token_ids)))


class PrefixCache:
    def __init__(self, pool: PageAllocator):
        self.pool = pool
        self.entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self.queries = self.hits = self.evictions = 0  # queries and hits count tokens

    def match(self, hashes: list[int]) -> list[tuple[int, ...]]:
        """The entries of the longest cached prefix of `hashes`, now most recently used."""
        found = []
        for h in hashes:
            pages = self.entries.get(h)
            if pages is None:
                break
            self.entries.move_to_end(h)
            found.append(pages)
        return found

    def insert(self, h: int, pages: tuple[int, ...]) -> None:
        if h in self.entries:
            self.entries.move_to_end(h)
            return
        for page in pages:
            self.pool.hold(page)
        self.entries[h] = pages

    def evictable_pages(self) -> int:
        """Pages only the cache references: what evict() could free now."""
        return sum(1 for pages in self.entries.values() for p in pages if self.pool.ref_counts[p] == 1)

    def evict(self, want_free: int) -> None:
        """Drop least recently used entries that no sequence maps until the pool has want_free
        free pages or nothing more can go."""
        for h in list(self.entries):
            if self.pool.num_free >= want_free:
                return
            pages = self.entries[h]
            if all(self.pool.ref_counts[p] == 1 for p in pages):
                del self.entries[h]
                for page in pages:
                    self.pool.drop(page)
                self.evictions += 1

    def held(self) -> Counter:
        return Counter(p for pages in self.entries.values() for p in pages)

    def clear(self) -> None:
        for pages in self.entries.values():
            for page in pages:
                self.pool.drop(page)
        self.entries.clear()
