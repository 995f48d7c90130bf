"""Finding a sequence's prefix, for the KV manager's `admit` (engine/kv/manager.py).

A sequence's complete pages are named by a chain hash over its tokens, from a root of the
namespace, its cache salt and its adapter (engine/kv/prefix_cache.py). Admission looks, in order:

  match     the longest run of its pages' names the prefix cache holds (the last prompt token
            is always computed: its logits are wanted), installed by the manager
  restore   the pages after those that the KV tiers hold whole, each into a fresh page of its own
  partial   one more page whose first rows are its next tokens (a hit to the token): a page the
            prefix cache holds, or over a pool other processes share the page of this very
            prompt's end another process computed (a prefill-to-decode handoff: taken whole when
            nobody else can read it), or an entry the tiers hold; copied into a page of its own
            (the rows past the match are written over as it computes them)

and `publish_tail` is the other side of a handoff: a released sequence's computed rows after its
last whole page, published over a shared pool for the process given the same prompt.

Who writes what: this object writes its counters and `namespace` (the manager sets it on new
weights); the sequence's handle gets its names here; pages change only through the layout.
"""
from __future__ import annotations

import time
from collections import Counter

from engine.kv.layout import KVLayout
from engine.kv.prefix_cache import PrefixCache, chain_hash, root_name
from engine.kv.tiers import KVTiers
from engine.request.sequence import Sequence
from vmm import PoolExhausted


def reclaim(layout: KVLayout, prefix_cache: PrefixCache | None, want_free: int) -> None:
    """Free pages that no running sequence needs until want_free are free: what finished
    sequences' places keep mapped, then cached entries nobody maps."""
    layout.reclaim_idle(want_free)
    if prefix_cache and layout.pool.num_free < want_free:
        prefix_cache.evict(want_free)


def make_room(layout: KVLayout, prefix_cache: PrefixCache | None, need: int) -> bool:
    """Are `need` pool pages free, after reclaiming what nobody running needs, here and then (a
    shared pool) in the other tenants? The manager's and the lookup's: a function of the layout
    and the cache, so that neither object holds the other. No cycle may hold the KV memory: a
    dropped engine's pages go back by reference count, at once, not at the cyclic collector's
    next full pass, which a steady workload may not see for minutes."""
    pool = layout.pool
    if pool.num_free < need:
        reclaim(layout, prefix_cache, need)
    if pool.num_free < need:
        pool.borrow(need)
    return pool.num_free >= need


class Lookup:
    def __init__(self, layout: KVLayout, prefix_cache: PrefixCache | None, tiers: KVTiers | None,
                 namespace: bytes, window: int | None):
        """window: a sliding window's (no hit to the token: a page's rows may be gone)."""
        self.layout, self.pool, self.prefix_cache, self.tiers = layout, layout.pool, prefix_cache, tiers
        self.window = window
        self.namespace = namespace  # page names chain from it
        self.partial_tokens = 0  # prompt tokens found inside a cached page's first rows
        self.partial_bytes = 0  # the bytes those copies moved (a page taken whole: none)
        self.restored_tokens: Counter[str] = Counter()  # per tier
        self.restore_seconds = 0.0

    # -- names ------------------------------------------------------------------------------
    def root(self, seq: Sequence) -> bytes:
        """The name seq's first page chains from (its namespace, salt and adapter)."""
        return root_name(self.namespace, seq.cache_salt, seq.adapter_digest)

    def names(self, seq: Sequence) -> list[bytes]:
        """Names of the complete pages of a sequence not admitted yet."""
        return self._extend(seq, [], len(seq))

    def page_names(self, seq: Sequence, known: int) -> list[bytes]:
        """Names of seq's pages whose tokens are all among its first `known` tokens (kept on its handle)."""
        return self._extend(seq, seq.kv.names, known)

    def _extend(self, seq: Sequence, names: list[bytes], known: int) -> list[bytes]:
        k, end = len(names), self.layout.page_end
        while end(k) <= known:
            parent = names[-1] if names else self.root(seq)
            names.append(chain_hash(parent, seq.token_ids[end(k - 1) if k else 0:end(k)]))
            k += 1
        return names

    # -- the pool, then the tiers -----------------------------------------------------------
    def match(self, seq: Sequence) -> list[tuple[int, ...]]:
        """The entries (pages, one per region) of seq's longest cached prefix."""
        if not self.prefix_cache or seq.scores_prompt:  # its prompt's logits are wanted: computed whole
            return []
        hits = self.prefix_cache.match(self.page_names(seq, len(seq)))
        while hits and self.layout.tokens_in_pages(len(hits)) > len(seq) - 1:
            hits.pop()  # the last prompt token is always computed: its logits are needed
        self.prefix_cache.queries += len(seq)
        self.prefix_cache.hits += self.layout.tokens_in_pages(len(hits))
        return hits

    def restore(self, seq: Sequence, start: int) -> int:
        """Restore seq's pages start, start+1, ... that the tiers hold, each into a fresh page
        at its own place; returns how many. Stops at the first page no tier has whole, or when
        the pool has no page for it."""
        if not self.tiers or seq.scores_prompt:  # its prompt's logits are wanted: computed whole
            return 0
        layout, names, k, began = self.layout, seq.kv.names, start, time.perf_counter()
        while k < len(names) and layout.tokens_in_pages(k + 1) <= len(seq) - 1:
            if self.tiers.where(names[k]) is None:
                break
            if layout.pages_at(seq, k) is None:  # a reused slot may have a private page here
                if not make_room(layout, self.prefix_cache, layout.num_regions):
                    break
                layout.map_fresh(seq, [k])
            tier = self.tiers.restore(names[k], layout.page_views(seq, k))
            if tier is None:  # damaged on disk: recomputed
                break
            self.restored_tokens[tier] += layout.tokens_in_pages(k + 1) - layout.tokens_in_pages(k)
            k += 1
        self.restore_seconds += time.perf_counter() - began
        return k - start

    # -- hits to the token --------------------------------------------------------------------
    def partial(self, seq: Sequence, full: int) -> int:
        """seq holds its first `full` pages; when a cached page after them begins with some of
        seq's next tokens, its bytes are copied into a private page of seq's (copy-on-write of a
        partial page). Returns the tokens seq now holds."""
        layout = self.layout
        held = layout.tokens_in_pages(full)
        if not self.prefix_cache or seq.scores_prompt or self.window:
            return held
        start = layout.page_end(full - 1) if full else 0
        found = self._find_partial(seq, full, start)
        if found is None:
            return self._partial_from_tiers(seq, full, start, held)
        pages, matched, mine = found
        try:
            end = min(start + matched, layout.tokens_in_pages(full + 1), len(seq) - 1)
            if end <= held:
                return held
            if mine and layout.pages_at(seq, full) is None:  # nobody else can read it: mapped, not copied
                layout.install(seq, full, pages)
            else:
                if layout.pages_at(seq, full) is None:
                    if not make_room(layout, self.prefix_cache, layout.num_regions):
                        return held
                    layout.map_fresh(seq, [full])
                self.partial_bytes += layout.copy_partial(seq, full, pages, end)
        except PoolExhausted:  # another process took the room first
            return held
        finally:
            self.pool.drop_many(pages)  # the references _find_partial took
        return self._count(end - held, end)

    def _count(self, tokens: int, end: int) -> int:
        self.prefix_cache.hits += tokens
        self.partial_tokens += tokens
        return end

    def _find_partial(self, seq: Sequence, full: int, start: int) -> tuple[tuple[int, ...], int, bool] | None:
        """A cached page after seq's first `full` whose first rows are seq's next tokens (from
        `start`), how many match, and whether it is seq's alone to write; each page with one
        more reference (making room must not evict it). One this cache committed, else, over a
        shared pool, the page of this very prompt's end another process computed (the last page
        of a prefill-to-decode handoff: a partial one is taken whole, PrefixCache.last_page)."""
        end = self.layout.page_end
        parent = seq.kv.names[full - 1] if full else self.root(seq)
        found = self.prefix_cache.partial(parent, seq.token_ids[start:min(end(full), len(seq) - 1)])
        if found is not None:
            for page in found[0]:
                self.pool.hold(page)
            return found[0], found[1], False
        if self.prefix_cache.shared and end(full) >= len(seq):
            last = self.prefix_cache.last_page(parent, seq.token_ids[start:], whole=end(full) == len(seq))
            return None if last is None else (last[0], len(seq) - start, last[1])
        return None

    def _partial_from_tiers(self, seq: Sequence, full: int, start: int, held: int) -> int:
        """A hit to the token on an entry the KV tiers hold: restored into seq's page `full`."""
        if not self.tiers:
            return held
        layout = self.layout
        parent = seq.kv.names[full - 1] if full else self.root(seq)
        found = self.prefix_cache.partial_evicted(
            parent, seq.token_ids[start:min(layout.page_end(full), len(seq) - 1)], self.tiers.where)
        if found is None:
            return held
        name, matched = found
        end = min(start + matched, layout.tokens_in_pages(full + 1), len(seq) - 1)
        if end <= held:
            return held
        began = time.perf_counter()
        try:
            if layout.pages_at(seq, full) is None:
                if not make_room(layout, self.prefix_cache, layout.num_regions):
                    return held
                layout.map_fresh(seq, [full])
        except PoolExhausted:  # another process took the room first
            return held
        tier = self.tiers.restore(name, layout.page_views(seq, full))
        self.restore_seconds += time.perf_counter() - began
        if tier is None:  # gone or damaged: computed
            return held
        self.restored_tokens[tier] += end - held
        return self._count(end - held, end)

    def publish_tail(self, seq: Sequence) -> None:
        """Publish seq's computed rows after its last whole page (a page of its own with a
        partial page's tokens) for another process given the same prompt (`partial`)."""
        layout, k = self.layout, seq.kv.committed
        start = layout.page_end(k - 1) if k else 0
        pages = layout.pages_at(seq, k)
        if seq.num_computed_tokens <= start or pages is None or layout.page_end(k) <= seq.num_computed_tokens:
            return
        parent = self.page_names(seq, start)[k - 1] if k else self.root(seq)
        self.prefix_cache.publish_tail(parent, seq.token_ids[start:seq.num_computed_tokens], pages)
