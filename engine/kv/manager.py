"""The KV manager: sequences hold pages, pages are reference-counted, complete pages are cached
by prefix hash, and no sequence ever writes into a page someone else references.

It decides; a layout (engine/kv/layout.py: the virtual slots of engine/kv/virtual.py, the block
table of engine/kv/paged.py) says where pages are. It is built whole, over its layout, with the
prefix cache on or off, the namespace pages are named in, the sliding window and the KV tiers
(engine/kv/build.py), and nothing is attached afterwards. Its ten verbs are the scheduler's,
each with one meaning:

  can_allocate   is there a place for n more sequences?
  admit          give the sequence a place, map the longest cached prefix, then restore the
                 pages after it that the KV tiers hold, then copy a cached page whose first rows
                 are its next tokens (a hit to the token); returns how many tokens it holds (the
                 scheduler counts them computed). A sequence that scores its prompt
                 (prompt_logprobs) gets a place alone
  ensure_mapped  before a step writes rows [computed, end): map missing pages, and copy any
                 page there that is shared (copy-on-write: a cached prefix's last page, the
                 prompt's last page after a fork); False, nothing changed, when memory is short
  map_ahead      fresh pages for rows later steps will write, from what is free now
  commit         after a step: name each newly complete page and offer it to the prefix cache;
                 with a sliding window, let go of the pages no later query can see
  fork           a child maps the pages of its parent's computed tokens (n > 1, beams)
  swap_out       preempted, it keeps its place and shared pages; its private pages' bytes go
                 to the swap tier and the pages back to the pool (a layout that `swaps`)
  swap_in        fresh pages at the same places, the bytes copied back: computed again
  release        the sequence is done or preempted; its place and references go
  reclaim        free pages nobody running needs (idle places, then cached entries), until a
                 number are free
  cached_prefix  (reads) how much of a waiting sequence's prompt admit would find

Beside them: `capacity` (engine/kv/capacity.py), what the scheduler sizes its decisions by;
`stats` and `audit`, numbers and the check that every page's count is who holds it. The engine's
own duties over the same cache (sleep, wake up, new weights, the end) are engine/kv/memory.py's;
a tenant's duties in a pool several models share are engine/sched/tenant.py's.

    tokens   0 ........................ computed ........ end ........ len(seq)
    pages    [ cached / shared ][ private ][ mapped by ensure_mapped ]
             committed pages: whole, named by chain hash, shareable

A sequence carries its own KV state, `seq.kv` (a `KVHandle`: its place, the names of its
pages, how far they are committed and slid), from admission or a fork to release, as nano-vllm's
sequences carry their block tables: when the sequence goes, its state goes with it. The manager
keeps only the set of handles it has given out, to audit them. Finding a prefix (the pool, the
tiers, a page that ends inside the prompt) is engine/kv/lookup.py's.
"""
from __future__ import annotations

import dataclasses
import time

from engine.kv.capacity import KVCapacity
from engine.kv.events import KVEventLog
from engine.kv.layout import KVHandle, KVLayout
from engine.kv.lookup import Lookup, make_room, reclaim
from engine.kv.prefix_cache import PrefixCache
from engine.kv.tiers import KVTiers
from engine.request.sequence import Sequence
from engine.stats import KVStats
from vmm import PoolExhausted


class Offload:
    """(the prefix cache, evicting) An entry's bytes to the tiers. Its own object, not a method
    of the manager's, so that the cache does not hold the manager. Who writes what: the manager
    sets `flushing` at close (disk writes then wait instead of being dropped); this object
    alone adds to `seconds`."""

    def __init__(self, layout: KVLayout, tiers: KVTiers):
        self.layout, self.tiers = layout, tiers
        self.flushing, self.seconds = False, 0.0

    def __call__(self, name: bytes, pages: tuple[int, ...]) -> None:
        start = time.perf_counter()
        with self.layout.entry_views(pages) as parts:
            self.tiers.offload(name, parts, wait=self.flushing)
        self.seconds += time.perf_counter() - start


class KVManager:
    def __init__(self, layout: KVLayout, prefix_caching: bool = False, *, namespace: bytes = b"",
                 window: int | None = None, tiers: KVTiers | None = None, events: KVEventLog | None = None):
        """namespace: what page names chain from (a pool other processes share, a disk tier:
        engine/kv/build.py); window: sliding-window attention's, pages wholly before it are let
        go as a sequence grows; tiers: where evicted entries go and come back from."""
        if tiers is not None and not prefix_caching:
            raise ValueError("KV offloading keeps prefix-cache entries: it needs prefix caching on")
        self.layout, self.pool, self.window, self.tiers = layout, layout.pool, window, tiers
        self.events = events or KVEventLog()  # what the cache and the tiers hold, as it changes (Note [KV events])
        self.offload = Offload(layout, tiers) if tiers else None
        self.prefix_cache = PrefixCache(self.pool, self.events, self.offload) if prefix_caching else None
        self.lookup = Lookup(layout, self.prefix_cache, tiers, namespace, window)
        self.capacity = KVCapacity(layout, self.prefix_cache)
        self.handles: set[KVHandle] = set()  # every seq.kv given out and not yet released
        self.map_seconds = 0.0
        self.cow_copies = 0
        self.swap_outs = self.swap_ins = 0  # sequences swapped out and back in

    @property
    def namespace(self) -> bytes:
        return self.lookup.namespace

    def reclaim(self, want_free: int) -> None:
        """Free pages that no running sequence needs until want_free are free (lookup.reclaim)."""
        reclaim(self.layout, self.prefix_cache, want_free)

    def _make_room(self, need: int) -> bool:
        """Are `need` pool pages free, after reclaiming (lookup.make_room)?"""
        return make_room(self.layout, self.prefix_cache, need)

    # -- the sequence life cycle (the scheduler's calls) -----------------------------------
    def admit(self, seq: Sequence, cached: bool = True) -> int:
        """Give seq a place and map its longest cached prefix, from the pool and then from the
        tiers, and a cached page that begins with its next tokens; returns the tokens it holds.
        cached=False: no prefix (a hit costs a page it lacks: see Scheduler._admit_waiting)."""
        self._take_place(seq)
        if not cached:
            return 0
        hits = self.lookup.match(seq)
        self.layout.install_prefix(seq, hits)
        return self.lookup.partial(seq, len(hits) + self.lookup.restore(seq, len(hits)))

    def cached_prefix(self, seq: Sequence, names: list[bytes] | None = None) -> tuple[list[bytes], int]:
        """The names of the complete pages of a sequence not admitted yet (or `names`, computed
        before), and how many of them from the first the pool or the tiers hold: what admit
        would find (prefix-aware scheduling asks). Changes nothing."""
        names = self.lookup.names(seq) if names is None else names
        if not self.prefix_cache:
            return names, 0
        k = 0
        while k < len(names) and (names[k] in self.prefix_cache.entries or (self.tiers and self.tiers.where(names[k]))):
            k += 1
        return names, k

    def ensure_mapped(self, seq: Sequence, num_tokens: int) -> bool:
        """Make every page that rows [computed, num_tokens) touch mapped and private to seq
        (and, for kernels that load whole tiles, mapped up to the tile's end); False, with
        nothing changed, when memory is short."""
        missing, shared = self._plan_mapping(seq, num_tokens)
        need = (len(missing) + len(shared)) * self.layout.num_regions
        if not need:
            return True
        if not self._make_room(need):
            return False
        start = time.perf_counter()
        try:  # over a pool other processes share, the room seen may be taken before the alloc
            self.layout.map_fresh(seq, missing)
            for k in shared:
                self.layout.copy_on_write(seq, k)
                self.cow_copies += 1
        except PoolExhausted:
            return False  # what was mapped stays the sequence's; the scheduler preempts or waits
        finally:
            self.map_seconds += time.perf_counter() - start
        return True

    def map_ahead(self, seq: Sequence, start: int, end: int, keep_free: int) -> None:
        """Fresh pages for rows [start, end) that seq will write in later steps, taken from the
        free pool while keep_free pages stay free (see engine/worker/map_ahead.py)."""
        layout = self.layout
        missing = [k for k in layout.page_range(start, layout.tile_end(end)) if layout.pages_at(seq, k) is None]
        room = (self.pool.num_free - keep_free) // layout.num_regions
        if missing and room > 0:
            try:
                layout.map_fresh(seq, missing[:room])
            except PoolExhausted:  # another process took them first: mapped when needed instead
                pass

    def _plan_mapping(self, seq: Sequence, num_tokens: int) -> tuple[list[int], list[int]]:
        """For rows [computed, num_tokens): the page indices to map, and the shared ones to copy."""
        layout = self.layout
        written = layout.page_range(seq.num_computed_tokens, num_tokens)
        pages = layout.page_range(seq.num_computed_tokens, layout.tile_end(num_tokens))
        missing = [k for k in pages if layout.pages_at(seq, k) is None]
        return missing, [k for k in written if k not in missing and layout.is_shared(seq, k)]

    def commit(self, seq: Sequence) -> None:
        """After a step: offer seq's newly complete pages to the prefix cache; slide its window.
        (Called before seq takes the step's tokens: a page whose rows hold tokens fed back this
        step, accepted drafts or a multi-step call's, is offered after the next step.)"""
        state, layout = seq.kv, self.layout
        if self.prefix_cache:
            known = min(seq.num_computed_tokens, len(seq))  # pages named by tokens seq holds
            names = self.lookup.page_names(seq, known)
            while state.committed < len(names) and layout.page_end(state.committed) <= known:
                k = state.committed
                pages = layout.pages_at(seq, k)
                if pages is not None:  # else the window has passed it already
                    self.prefix_cache.insert(names[k], pages, names[k - 1] if k else self.lookup.root(seq),
                                             seq.token_ids[layout.page_end(k - 1) if k else 0:layout.page_end(k)],
                                             seq.adapter_name, first=not k)
                state.committed += 1
        if self.window:
            self._slide(seq, state)

    def _slide(self, seq: Sequence, state: KVHandle) -> None:
        """The next query sits at position `computed` and sees keys after computed - window:
        pages whose rows all lie before that are let go (others may still map them)."""
        first_live = seq.num_computed_tokens - self.window + 1
        while self.layout.page_end(state.slid) <= first_live:
            if self.layout.pages_at(seq, state.slid) is not None:
                self.layout.unmap_page(seq, state.slid)
            state.slid += 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child continues from parent's state: same tokens so far, the pages holding their
        K/V shared. The scheduler counts the child's computed tokens as the parent's."""
        self._take_place(child)
        shared = self.layout.page_range(0, parent.num_computed_tokens)
        self.layout.install_prefix(child, [self.layout.pages_at(parent, k) for k in shared])  # None: slid
        mine = parent.kv
        child.kv.names, child.kv.committed, child.kv.slid = mine.names[:], mine.committed, mine.slid

    def release(self, seq: Sequence, keep_pages: bool = True) -> None:
        """seq is done (keep_pages: its slot may stay mapped for the next) or preempted: its
        place and references go, and its handle with them. Over a pool several processes share,
        nothing stays mapped and the cache keeps nothing no sequence maps: the pages go back to
        the pool (the pages of named prefixes to its directory), for whichever process needs them."""
        shared = self.prefix_cache is not None and self.prefix_cache.shared
        if shared and not self.window and not seq.scores_prompt:
            self.lookup.publish_tail(seq)
        self.layout.vacate(seq, keep_pages and not shared)
        self.handles.discard(seq.kv)
        seq.kv = None
        if shared:
            self.prefix_cache.trim()

    def _take_place(self, seq: Sequence) -> None:
        seq.kv = self.layout.place(seq)
        self.handles.add(seq.kv)

    # -- swapping: a capability of the layout (capacity.swaps); the block table preempts by recompute
    def swap_out(self, seq: Sequence) -> bool:
        """Move seq's private pages to the swap tier; False, nothing done, if the tier is full.
        A page the prefix cache holds stays there, evictable, and comes back without a copy if
        it is still cached at swap-in."""
        if not self.layout.swap_out(seq, self._held_by_cache()):
            return False
        self.swap_outs += 1
        return True

    def swap_in(self, seq: Sequence, num_tokens: int, keep_free: int = 0) -> bool:
        """Bring seq's pages back and map what rows [computed, num_tokens) need, leaving
        keep_free pages free; False when memory is short: nothing done, or, where another
        process took the room first, part done (the next call goes on from there)."""
        saved = self.layout.swapped_pages(seq)
        missing, shared = self._plan_mapping(seq, num_tokens)
        if not self._make_room((len(saved.keys() | missing) + len(shared)) * self.layout.num_regions + keep_free):
            return False
        start, handle = time.perf_counter(), seq.kv
        cache = self.prefix_cache.entries if self.prefix_cache else {}
        try:
            self.layout.swap_in(seq, {k for k, pages in saved.items()
                                      if k < handle.committed and cache.get(handle.names[k]) == pages})
        except PoolExhausted:  # another process over a shared pool took the room first: what came
            return False       # back stays mapped, the rest swapped, for the next try
        finally:
            self.map_seconds += time.perf_counter() - start
        self.swap_ins += 1
        return self.ensure_mapped(seq, num_tokens)  # False on the same race: swapped in, the rest next try

    def close(self) -> None:
        """The end: the cached entries go to the tiers, which finish their writes (so a restarted
        engine finds them on disk); then every page and range goes back."""
        if self.offload:
            self.offload.flushing = True
        if self.prefix_cache:
            self.prefix_cache.clear()
        if self.tiers:
            self.tiers.close()
        self.layout.close()

    # -- checks and numbers -----------------------------------------------------------------
    def _held_by_cache(self) -> dict[int, int]:
        return self.prefix_cache.held() if self.prefix_cache else {}

    def audit(self) -> None:
        """Raise if any page's reference count disagrees with who holds it."""
        self.layout.audit(self.handles, self._held_by_cache())

    def stats(self) -> KVStats:
        pool, c, lookup = self.pool.stats(), self.prefix_cache, self.lookup
        held = self._held_by_cache()
        idle = self.layout.pages_idle(held)
        cached = sum(1 for p in held if self.pool.own_refs(p) == 1)
        swap_out, swap_in = self.layout.swap_bytes
        return KVStats(
            layout=self.layout.name, page_size=self.layout.page_size, pages_total=pool.total, pages_free=pool.free,
            pages_in_use=pool.in_use - idle - cached, pages_idle=idle, pages_cached=cached,
            pages_shared=pool.shared, peak_pages_mapped=pool.peak_in_use, map_seconds=self.map_seconds,
            cow_copies=self.cow_copies, swap_outs=self.swap_outs, swap_ins=self.swap_ins,
            swap_bytes_out=swap_out, swap_bytes_in=swap_in, prefix_cache_queries=c.queries if c else 0,
            prefix_cache_hits=c.hits if c else 0, evictions=c.evictions if c else 0, asleep=pool.asleep,
            tiers=tuple(dataclasses.replace(t, tokens_restored=lookup.restored_tokens[t.tier])
                        for t in (self.tiers.stats() if self.tiers else ())),
            tier_restore_seconds=lookup.restore_seconds, tier_offload_seconds=self.offload.seconds if self.offload else 0.0,
            prefix_cache_imported=c.imported if c else 0, prefix_cache_partial_hits=lookup.partial_tokens,
            prefix_cache_partial_bytes=lookup.partial_bytes)

