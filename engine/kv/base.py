"""What every KV cache shares: sequences hold pages, pages are reference-counted, complete pages
are cached by prefix hash, and no sequence ever writes into a page someone else references.

A cache lays a sequence's KV out as pages 0, 1, 2, ... (virtual layouts: the pages mapped in
its slot; paged: its block table). Subclasses say which tokens' rows touch page k and how to
map, copy or share the pages at an index; this class does the rest:

  admit          give the sequence a place, map the longest cached prefix, skip computing it
  ensure_mapped  before a step writes rows [computed, end): map missing pages, and copy any
                 page there that is shared (copy-on-write: a cached prefix's last page, the
                 prompt's last page after a fork)
  commit         after a step: hash each newly complete page and offer it to the prefix cache
  fork           a child sequence maps the pages of its parent's computed tokens (n > 1)
  release        the sequence is done or preempted; its references go
"""
from __future__ import annotations

import time

from engine.kv.prefix_cache import NO_PARENT, PrefixCache, chain_hash
from engine.sequence import Sequence
from vmm import PageAllocator


class KVCacheBase:
    pool: PageAllocator
    num_regions: int = 1

    def __init__(self, enable_prefix_caching: bool, cache_salt: int = NO_PARENT):
        self.prefix_cache = PrefixCache(self.pool) if enable_prefix_caching else None
        self.salt = cache_salt
        self.map_seconds = 0.0
        self.cow_copies = 0

    # -- geometry and page operations: the subclass's part ---------------------------------
    def page_end(self, k: int) -> int:
        """One past the last token whose row touches page k."""
        raise NotImplementedError

    def tokens_in_pages(self, m: int) -> int:
        """Tokens whose rows lie wholly inside pages 0..m-1."""
        raise NotImplementedError

    def page_range(self, start: int, end: int) -> range:
        """Page indices touched by the rows of tokens [start, end)."""
        raise NotImplementedError

    def pages_at(self, seq: Sequence, k: int) -> tuple[int, ...] | None:
        raise NotImplementedError

    # -- sizing ---------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        """Pages, over all regions, that a sequence of num_tokens maps."""
        return len(self.page_range(0, num_tokens)) * self.num_regions

    @property
    def num_free_pages(self) -> int:
        """Pages obtainable now without preempting anyone (a lower bound)."""
        cached = self.prefix_cache.evictable_pages() if self.prefix_cache else 0
        return self.pool.num_free + self.reclaimable_pages() + cached

    def reclaimable_pages(self) -> int:
        return 0

    def reclaim(self, want_free: int) -> None:
        """Free pages that no running sequence needs until want_free are free."""
        if self.prefix_cache:
            self.prefix_cache.evict(want_free)

    # -- the sequence life cycle -----------------------------------------------------------
    def admit(self, seq: Sequence) -> None:
        """Give seq a place; map its longest cached prefix and count those tokens computed."""
        self.allocate(seq)
        hits = self._match_prefix(seq)
        for k, pages in enumerate(hits):
            self.install(seq, k, pages)
        self.after_install(seq, len(hits))
        seq.num_computed_tokens = self.tokens_in_pages(len(hits))

    def _match_prefix(self, seq: Sequence) -> list[tuple[int, ...]]:
        if not self.prefix_cache:
            return []
        hashes = self.page_hashes(seq, len(seq))
        hits = self.prefix_cache.match(hashes)
        while hits and self.tokens_in_pages(len(hits)) > len(seq) - 1:
            hits.pop()  # the last prompt token is always computed: its logits are needed
        self.prefix_cache.queries += len(seq)
        self.prefix_cache.hits += self.tokens_in_pages(len(hits))
        return hits

    def page_hashes(self, seq: Sequence, known: int) -> list[int]:
        """Chain hashes of seq's pages whose tokens are all among its first `known` tokens."""
        hashes, k = seq.page_hashes, len(seq.page_hashes)
        while self.page_end(k) <= known:
            parent = hashes[-1] if hashes else self.salt
            hashes.append(chain_hash(parent, seq.token_ids[self.page_end(k - 1) if k else 0:self.page_end(k)]))
            k += 1
        return hashes

    def ensure_mapped(self, seq: Sequence, num_tokens: int) -> bool:
        """Make every page that rows [computed, num_tokens) touch mapped and private to seq;
        False, with nothing changed, when memory is short."""
        pages = self.page_range(seq.num_computed_tokens, num_tokens)
        missing = [k for k in pages if self.pages_at(seq, k) is None]
        shared = [k for k in pages if k not in missing and self.is_shared(seq, k)]
        need = (len(missing) + len(shared)) * self.num_regions
        if not need:
            return True
        if self.pool.num_free < need:
            self.reclaim(need)
            if self.pool.num_free < need:
                return False
        start = time.perf_counter()
        self.map_fresh(seq, missing)
        for k in shared:
            self.copy_on_write(seq, k)
        self.cow_copies += len(shared)
        self.map_seconds += time.perf_counter() - start
        return True

    def is_shared(self, seq: Sequence, k: int) -> bool:
        return any(self.pool.ref_counts[p] > 1 for p in self.pages_at(seq, k))

    def commit(self, seq: Sequence) -> None:
        """After a step: offer seq's newly complete pages to the prefix cache."""
        if not self.prefix_cache:
            return
        hashes = self.page_hashes(seq, seq.num_computed_tokens)
        complete = seq.num_committed_pages
        while complete < len(hashes) and self.page_end(complete) <= seq.num_computed_tokens:
            self.prefix_cache.insert(hashes[complete], self.pages_at(seq, complete))
            complete += 1
        seq.num_committed_pages = complete

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child continues from parent's state: same tokens so far, the pages holding their
        K/V shared."""
        self.allocate(child)
        shared = self.page_range(0, parent.num_computed_tokens)
        for k in shared:
            self.install(child, k, self.pages_at(parent, k))
        self.after_install(child, len(shared))
        child.num_computed_tokens = parent.num_computed_tokens
        child.page_hashes, child.num_committed_pages = parent.page_hashes[:], parent.num_committed_pages

    # -- numbers --------------------------------------------------------------------------
    def prefix_stats(self) -> dict:
        c = self.prefix_cache
        return {"prefix_cache_queries": c.queries if c else 0, "prefix_cache_hits": c.hits if c else 0,
                "evictions": c.evictions if c else 0, "cow_copies": self.cow_copies,
                "pages_shared": self.pool.stats().shared,
                "pages_cached": sum(1 for p in (c.held() if c else {}) if self.pool.ref_counts[p] == 1)}

    def held_by_cache(self):
        return self.prefix_cache.held() if self.prefix_cache else {}
