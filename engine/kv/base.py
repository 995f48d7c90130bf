"""The contract every KV cache keeps, and what they share: sequences hold pages, pages are
reference-counted, complete pages are cached by prefix hash, and no sequence ever writes into
a page someone else references.

A cache lays a sequence's KV out as pages 0, 1, 2, ... (virtual layouts: the pages mapped in
its slot; paged: its block table). The scheduler alone drives the life cycle:

  admit          give the sequence a place, map the longest cached prefix, then restore the
                 pages after it that the KV tiers hold (engine/kv/tiers.py), then copy a
                 cached page whose first rows are its next tokens (a hit to the token);
                 returns how many tokens it holds (the scheduler counts them computed). A
                 sequence that scores its prompt (prompt_logprobs) gets a place alone
  ensure_mapped  before a step writes rows [computed, end): map missing pages, and copy any
                 page there that is shared (copy-on-write: a cached prefix's last page, the
                 prompt's last page after a fork)
  commit         after a step: hash each newly complete page and offer it to the prefix cache;
                 with a sliding window, let go of the pages no later query can see
  fork           a child maps the pages of its parent's computed tokens (n > 1, beams)
  swap_out       preempted, it keeps its place and shared pages; its private pages' bytes go
                 to the swap tier and the pages back to the pool (virtual layouts only)
  swap_in        fresh pages at the same places, the bytes copied back: computed again
  release        the sequence is done or preempted; its references go

    tokens   0 ........................ computed ........ end ........ len(seq)
    pages    [ cached / shared ][ private ][ mapped by ensure_mapped ]
             committed pages: whole, named by chain hash, shareable

A sequence carries its own KV state, `seq.kv` (a `KVHandle`: its place, the names of its
pages, how far they are committed and slid), from admission or a fork to release, as nano-vllm's
sequences carry their block tables: when the sequence goes, its state goes with it. The cache
keeps only the set of handles it has given out, to audit them.

Subclasses say where pages live (`place`, `vacate`, `pages_at`, `install`, `map_fresh`,
`copy_on_write`, `unmap_page`), the geometry of rows over pages, where kernels find a
sequence's rows (`k_caches`, `v_caches`, `block_table`), and where an entry's bytes are
(`entry_views`, `page_views`: what the KV tiers copy out and in). Swapping is a capability a
layout declares (`swaps`); the scheduler asks before it swaps.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field

import torch

from engine.kv.events import KVEventLog
from engine.kv.prefix_cache import PrefixCache, chain_hash, root_name
from engine.kv.tiers import KVTiers
from engine.sequence import Sequence
from engine.stats import KVStats
from vmm import PageAllocator, PoolExhausted


def copy_bytes(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """Copy the bytes of src's 1-D uint8 tensors, in order, into dst's (the same total length,
    cut differently: an entry's views and a page's need not split alike)."""
    i = j = at_dst = at_src = 0
    while i < len(dst) and j < len(src):
        n = min(dst[i].numel() - at_dst, src[j].numel() - at_src)
        dst[i][at_dst:at_dst + n].copy_(src[j][at_src:at_src + n])
        at_dst, at_src = at_dst + n, at_src + n
        if at_dst == dst[i].numel():
            i, at_dst = i + 1, 0
        if at_src == src[j].numel():
            j, at_src = j + 1, 0


@dataclass(eq=False)
class KVHandle:
    """A sequence's state in a KV cache, on the sequence (seq.kv) while it holds a place."""
    seq_id: int
    names: list[bytes] = field(default_factory=list)  # names (chain hashes) of the complete pages known
    committed: int = 0  # pages already offered to the prefix cache
    slid: int = 0  # pages before the sliding window, already let go

    @property
    def place(self):
        """Where its pages are (a slot, a block table): what every tensor-parallel rank agrees on."""
        raise NotImplementedError


class KVCacheBase(ABC):
    layout: str
    num_regions: int = 1  # pages per page index: 2 x layers for per_layer, else 1
    k_caches: list  # per layer, [blocks, rows, heads, D]
    v_caches: list
    window: int | None = None  # sliding window: pages wholly before it are let go as a sequence grows
    swaps: bool = False  # can swap_out / swap_in (a virtual layout with a swap tier)

    def __init__(self, pool: PageAllocator, enable_prefix_caching: bool, namespace: bytes = b""):
        self.pool = pool
        self.events = KVEventLog()  # what the cache and the tiers hold, as it changes (Note [KV events])
        self.prefix_cache = PrefixCache(pool, self.events) if enable_prefix_caching else None
        self.namespace = namespace  # page names chain from it (engine/kv/prefix_cache.py)
        self.map_seconds = 0.0
        self.cow_copies = 0
        self.partial_tokens = 0  # prompt tokens found inside a cached page's first rows (`_partial`)
        self.partial_bytes = 0  # the bytes those copies moved (a page taken whole: none)
        self.swap_outs = self.swap_ins = 0  # sequences swapped out and back in
        self.handles: set[KVHandle] = set()  # every seq.kv given out and not yet released
        self.tiers: KVTiers | None = None
        self.restored_tokens: Counter[str] = Counter()  # per tier
        self.restore_seconds = self.offload_seconds = 0.0
        self._flushing = False  # closing: disk writes wait instead of being dropped

    # -- the subclass's part: geometry --------------------------------------------------------
    @property
    @abstractmethod
    def page_size(self) -> int:
        """Bytes of one page (one block, for the block table)."""

    @property
    @abstractmethod
    def token_bytes(self) -> int:
        """KV bytes one token occupies, all layers."""

    @abstractmethod
    def page_end(self, k: int) -> int:
        """One past the last token whose row touches page k."""

    @abstractmethod
    def tokens_in_pages(self, m: int) -> int:
        """Tokens whose rows lie wholly inside pages 0..m-1."""

    @abstractmethod
    def page_range(self, start: int, end: int) -> range:
        """Page indices touched by the rows of tokens [start, end)."""

    # -- the subclass's part: placement and pages ---------------------------------------------
    @abstractmethod
    def can_allocate(self, n: int = 1) -> bool:
        """Is there a place for n more sequences?"""

    @abstractmethod
    def place(self, seq: Sequence) -> KVHandle:
        """A place to hold seq's KV (a slot, an empty block table), as its new handle."""

    @abstractmethod
    def vacate(self, seq: Sequence, keep_pages: bool) -> None:
        """Take seq's place back and drop its references (keep_pages: a slot may stay mapped)."""

    @abstractmethod
    def pages_at(self, seq: Sequence, k: int) -> tuple[int, ...] | None:
        """The pool pages (one per region) behind seq's page k, or None."""

    @abstractmethod
    def install(self, seq: Sequence, k: int, pages: tuple[int, ...] | None) -> None:
        """Put existing pages (someone else's) behind seq's page k: one more reference each
        (None: a page before the window, nothing to map)."""

    @abstractmethod
    def unmap_page(self, seq: Sequence, k: int) -> None:
        """seq lets go of its page k (it left the sliding window)."""

    @abstractmethod
    def entry_views(self, pages: tuple[int, ...]) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
        """The bytes of pool pages (one per region), mapped or not, as 1-D uint8 tensors
        valid inside the `with`: what an offloaded entry holds."""

    @abstractmethod
    def page_views(self, seq: Sequence, k: int) -> list[torch.Tensor]:
        """The bytes behind seq's (mapped) page k, as entry_views orders them."""

    @abstractmethod
    def geometry(self) -> dict:
        """What the bytes of a page depend on besides its tokens (dtype, layout, sizes)."""

    @property
    def entry_bytes(self) -> int:
        """Bytes of one prefix-cache entry: a page of each region."""
        return self.page_size * self.num_regions

    def install_many(self, seq: Sequence, entries: list[tuple[int, ...] | None]) -> None:
        """install(seq, k, entries[k]) for k = 0, 1, ... (a layout may map them as runs)."""
        for k, pages in enumerate(entries):
            self.install(seq, k, pages)

    def after_install(self, seq: Sequence, num_installed: int) -> None:
        """Called once the shared pages are installed (a reused slot tidies up here)."""

    @abstractmethod
    def map_fresh(self, seq: Sequence, indices: list[int]) -> None:
        """Fresh private pages behind seq's page indices."""

    @abstractmethod
    def copy_on_write(self, seq: Sequence, k: int) -> None:
        """Give seq a private copy of its (shared) page k."""

    @abstractmethod
    def block_table(self, seqs: list[Sequence], ctx_lens: list[int]) -> tuple[list[list[int]], int]:
        """Where the kernels find each sequence's first ctx_len rows: per sequence the blocks of
        `k_caches[l]` / `v_caches[l]` ([blocks, rows, heads, D]) holding them, and rows per block."""

    @abstractmethod
    def audit(self) -> None:
        """Raise if any page's reference count disagrees with who holds it."""

    @abstractmethod
    def close(self) -> None:
        """Give every page and range back."""

    def tile_end(self, num_tokens: int) -> int:
        """One past the last row a kernel may load for num_tokens tokens (whole tiles)."""
        return num_tokens

    def reclaimable_pages(self) -> int:
        """Pages that finished sequences keep mapped and `reclaim` can free."""
        return 0

    def pages_idle(self) -> int:
        return 0

    def reclaim(self, want_free: int) -> None:
        """Free pages that no running sequence needs until want_free are free."""
        if self.prefix_cache:
            self.prefix_cache.evict(want_free)

    def make_room(self, need: int) -> bool:
        """Are `need` pool pages free, after reclaiming what nobody running needs, here and
        then (a shared pool) in the other tenants?"""
        if self.pool.num_free < need:
            self.reclaim(need)
        if self.pool.num_free < need:
            self.pool.borrow(need)
        return self.pool.num_free >= need

    def spare_pages(self) -> int:
        """Pages held that no running sequence needs: idle, then cached alone (what give_back frees)."""
        cached = self.prefix_cache.evictable_pages() if self.prefix_cache else 0
        return self.reclaimable_pages() + cached

    def give_back(self, pages: int) -> None:
        """Free up to `pages` of the spare ones, for another tenant of a shared pool."""
        self.reclaim(self.pool.num_free + pages)

    # -- swapping: a capability (`swaps`); the block table preempts by recompute ----------
    def swap_out(self, seq: Sequence) -> bool:
        """Move seq's private pages to the swap tier; False, nothing done, if the tier is full."""
        raise NotImplementedError(f"the {self.layout} layout does not swap")

    def swap_in(self, seq: Sequence, num_tokens: int, keep_free: int = 0) -> bool:
        """Bring seq's pages back and map what rows [computed, num_tokens) need, leaving
        keep_free pages free; False, nothing done, when memory is short."""
        raise NotImplementedError(f"the {self.layout} layout does not swap")

    @property
    def swap_bytes(self) -> tuple[int, int]:
        """Bytes moved to and from the swap tier."""
        return 0, 0

    # -- sizing ---------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        """Pages, over all regions, that a sequence of num_tokens maps."""
        return len(self.page_range(0, num_tokens)) * self.num_regions

    @property
    def num_free_pages(self) -> int:
        """Pages obtainable now without preempting anyone (a lower bound)."""
        return self.pool.num_free + self.spare_pages() + self.pool.borrowable()

    # -- the sequence life cycle (the scheduler's calls) -----------------------------------
    def admit(self, seq: Sequence) -> int:
        """Give seq a place and map its longest cached prefix, from the pool and then from the
        tiers; returns the tokens it holds."""
        self._take_place(seq)
        hits = self._match_prefix(seq)
        self.install_many(seq, hits)
        self.after_install(seq, len(hits))
        return self._partial(seq, len(hits) + self._restore(seq, len(hits)))

    def _partial(self, seq: Sequence, full: int) -> int:
        """Prefix hits to the token: seq holds its first `full` pages; when a cached page after
        them begins with some of seq's next tokens, its bytes are copied into a private page of
        seq's (copy-on-write of a partial page: the rows past the match are written over as seq
        computes them). Returns the tokens seq now holds."""
        held = self.tokens_in_pages(full)
        if not self.prefix_cache or seq.scores_prompt or self.window:
            return held
        start = self.page_end(full - 1) if full else 0
        found = self._find_partial(seq, full, start)
        if found is None:
            return self._partial_from_tiers(seq, full, start, held)
        pages, matched, mine = found
        try:
            end = min(start + matched, self.tokens_in_pages(full + 1), len(seq) - 1)
            if end <= held:
                return held
            if mine and self.pages_at(seq, full) is None:  # nobody else can read it: mapped, not copied
                self.install(seq, full, pages)
            else:
                if self.pages_at(seq, full) is None:
                    if not self.make_room(self.num_regions):
                        return held
                    self.map_fresh(seq, [full])
                self.partial_bytes += self.copy_partial(seq, full, pages, end)
        except PoolExhausted:  # another process took the room first
            return held
        finally:
            self.pool.drop_many(pages)  # the references _find_partial took
        self.prefix_cache.hits += end - held
        self.partial_tokens += end - held
        return end

    def _find_partial(self, seq: Sequence, full: int, start: int) -> tuple[tuple[int, ...], int, bool] | None:
        """A cached page after seq's first `full` whose first rows are seq's next tokens (from
        `start`), how many match, and whether it is seq's alone to write; each page with one
        more reference (making room must not evict it). One this cache committed, else, over a
        shared pool, the page of this very prompt's end another process computed (the last page
        of a prefill-to-decode handoff: a partial one is taken whole, PrefixCache.last_page)."""
        parent = seq.kv.names[full - 1] if full else self._root(seq)
        found = self.prefix_cache.partial(parent, seq.token_ids[start:min(self.page_end(full), len(seq) - 1)])
        if found is not None:
            for page in found[0]:
                self.pool.hold(page)
            return found[0], found[1], False
        if self.prefix_cache.shared and self.page_end(full) >= len(seq):
            last = self.prefix_cache.last_page(parent, seq.token_ids[start:], whole=self.page_end(full) == len(seq))
            return None if last is None else (last[0], len(seq) - start, last[1])
        return None

    def _partial_from_tiers(self, seq: Sequence, full: int, start: int, held: int) -> int:
        """A hit to the token on an entry the KV tiers hold: restored into seq's page `full`
        (the rows past the match are written over as seq computes them). Returns the tokens seq
        now holds."""
        if not self.tiers:
            return held
        parent = seq.kv.names[full - 1] if full else self._root(seq)
        found = self.prefix_cache.partial_evicted(
            parent, seq.token_ids[start:min(self.page_end(full), len(seq) - 1)], self.tiers.where)
        if found is None:
            return held
        name, matched = found
        end = min(start + matched, self.tokens_in_pages(full + 1), len(seq) - 1)
        if end <= held:
            return held
        began = time.perf_counter()
        try:
            if self.pages_at(seq, full) is None:
                if not self.make_room(self.num_regions):
                    return held
                self.map_fresh(seq, [full])
        except PoolExhausted:  # another process took the room first
            return held
        tier = self.tiers.restore(name, self.page_views(seq, full))
        self.restore_seconds += time.perf_counter() - began
        if tier is None:  # gone or damaged: computed
            return held
        self.restored_tokens[tier] += end - held
        self.prefix_cache.hits += end - held
        self.partial_tokens += end - held
        return end

    def copy_partial(self, seq: Sequence, k: int, pages: tuple[int, ...], end: int) -> int:
        """Copy the rows of tokens before `end` from cached `pages` (one per region) into seq's
        page k; returns the bytes copied. Here the whole page: a layout whose rows lie in token
        order copies only the rows it needs."""
        with self.entry_views(pages) as parts:
            copy_bytes(self.page_views(seq, k), parts)
        return self.entry_bytes

    def name_pages_in(self, namespace: bytes) -> None:
        """Pages are named in `namespace` from now on (a pool shared across processes, a tier
        that outlives the process). Only before the first sequence."""
        if self.handles:
            raise RuntimeError("pages are named before any sequence is admitted")
        self.namespace = namespace

    def forget_prefixes(self, namespace: bytes) -> None:
        """New weights: every cached entry goes (not to the tiers: its KV is the old weights')
        and pages are named in `namespace` from now on, so nothing computed before is found
        again, here, in a tier or in a pool other processes share. No sequence may hold KV."""
        if self.handles:
            raise RuntimeError(f"{len(self.handles)} sequences still hold KV")
        if self.prefix_cache:
            self.prefix_cache.clear(offload=False)
        self.namespace = namespace

    # -- the tiers (engine/kv/tiers.py) ------------------------------------------------------
    def attach_tiers(self, tiers: KVTiers, namespace: bytes) -> None:
        """Evicted entries go to `tiers` and come back from them; pages are named in
        `namespace` from now on. Only before the first sequence."""
        if self.prefix_cache is None:
            raise ValueError("KV offloading keeps prefix-cache entries: it needs prefix caching on")
        if self.handles:
            raise RuntimeError("tiers are attached before any sequence is admitted")
        self.tiers, self.namespace = tiers, namespace
        self.prefix_cache.on_evict = self._offload

    def _offload(self, name: bytes, pages: tuple[int, ...]) -> None:
        start = time.perf_counter()
        with self.entry_views(pages) as parts:
            self.tiers.offload(name, parts, wait=self._flushing)
        self.offload_seconds += time.perf_counter() - start

    def _restore(self, seq: Sequence, start: int) -> int:
        """Restore seq's pages start, start+1, ... that the tiers hold, each into a fresh page
        at its own place; returns how many. Stops at the first page no tier has whole, or when
        the pool has no page for it."""
        if not self.tiers or seq.scores_prompt:  # its prompt's logits are wanted: computed whole
            return 0
        names, k, began = seq.kv.names, start, time.perf_counter()
        while k < len(names) and self.tokens_in_pages(k + 1) <= len(seq) - 1:
            if self.tiers.where(names[k]) is None:
                break
            if self.pages_at(seq, k) is None:  # a reused slot may have a private page here
                if not self.make_room(self.num_regions):
                    break
                self.map_fresh(seq, [k])
            tier = self.tiers.restore(names[k], self.page_views(seq, k))
            if tier is None:  # damaged on disk: recomputed
                break
            self.restored_tokens[tier] += self.tokens_in_pages(k + 1) - self.tokens_in_pages(k)
            k += 1
        self.restore_seconds += time.perf_counter() - began
        return k - start

    def page_names(self, seq: Sequence) -> list[bytes]:
        """Names of the complete pages of a sequence not admitted yet."""
        return self._extend_names(seq, [], len(seq))

    def cached_prefix_pages(self, names: list[bytes]) -> int:
        """How many of these page names, from the first, the pool or the tiers hold: what
        admit would find (prefix-aware scheduling asks). Changes nothing."""
        if not self.prefix_cache:
            return 0
        k = 0
        while k < len(names) and (names[k] in self.prefix_cache.entries
                                  or (self.tiers and self.tiers.where(names[k]))):
            k += 1
        return k

    def _match_prefix(self, seq: Sequence) -> list[tuple[int, ...]]:
        if not self.prefix_cache or seq.scores_prompt:  # its prompt's logits are wanted: computed whole
            return []
        hits = self.prefix_cache.match(self._page_hashes(seq, len(seq)))
        while hits and self.tokens_in_pages(len(hits)) > len(seq) - 1:
            hits.pop()  # the last prompt token is always computed: its logits are needed
        self.prefix_cache.queries += len(seq)
        self.prefix_cache.hits += self.tokens_in_pages(len(hits))
        return hits

    def _root(self, seq: Sequence) -> bytes:
        """The name seq's first page chains from (its namespace, salt and adapter)."""
        return root_name(self.namespace, seq.cache_salt, seq.adapter_digest)

    def _page_hashes(self, seq: Sequence, known: int) -> list[bytes]:
        """Names of seq's pages whose tokens are all among its first `known` tokens."""
        return self._extend_names(seq, seq.kv.names, known)

    def _extend_names(self, seq: Sequence, names: list[bytes], known: int) -> list[bytes]:
        k = len(names)
        while self.page_end(k) <= known:
            parent = names[-1] if names else self._root(seq)
            names.append(chain_hash(parent, seq.token_ids[self.page_end(k - 1) if k else 0:self.page_end(k)]))
            k += 1
        return names

    def ensure_mapped(self, seq: Sequence, num_tokens: int) -> bool:
        """Make every page that rows [computed, num_tokens) touch mapped and private to seq
        (and, for kernels that load whole tiles, mapped up to the tile's end); False, with
        nothing changed, when memory is short."""
        missing, shared = self.plan_mapping(seq, num_tokens)
        need = (len(missing) + len(shared)) * self.num_regions
        if not need:
            return True
        if not self.make_room(need):
            return False
        start = time.perf_counter()
        try:  # over a pool other processes share, the room seen may be taken before the alloc
            self.map_fresh(seq, missing)
            for k in shared:
                self.copy_on_write(seq, k)
                self.cow_copies += 1
        except PoolExhausted:
            return False  # what was mapped stays the sequence's; the scheduler preempts or waits
        finally:
            self.map_seconds += time.perf_counter() - start
        return True

    def map_ahead(self, seq: Sequence, start: int, end: int, keep_free: int) -> None:
        """Fresh pages for rows [start, end) that seq will write in later steps, taken from the
        free pool while keep_free pages stay free (see engine/map_ahead.py)."""
        missing = [k for k in self.page_range(start, self.tile_end(end)) if self.pages_at(seq, k) is None]
        room = (self.pool.num_free - keep_free) // self.num_regions
        if missing and room > 0:
            try:
                self.map_fresh(seq, missing[:room])
            except PoolExhausted:  # another process took them first: mapped when needed instead
                pass

    def plan_mapping(self, seq: Sequence, num_tokens: int) -> tuple[list[int], list[int]]:
        """For rows [computed, num_tokens): the page indices to map, and the shared ones to copy."""
        written = self.page_range(seq.num_computed_tokens, num_tokens)
        pages = self.page_range(seq.num_computed_tokens, self.tile_end(num_tokens))
        missing = [k for k in pages if self.pages_at(seq, k) is None]
        return missing, [k for k in written if k not in missing and self.is_shared(seq, k)]

    def is_shared(self, seq: Sequence, k: int) -> bool:
        return any(self.pool.ref_counts[p] > 1 for p in self.pages_at(seq, k))

    def commit(self, seq: Sequence) -> None:
        """After a step: offer seq's newly complete pages to the prefix cache; slide its window."""
        state = seq.kv
        if self.prefix_cache:
            hashes = self._page_hashes(seq, seq.num_computed_tokens)
            while state.committed < len(hashes) and self.page_end(state.committed) <= seq.num_computed_tokens:
                k = state.committed
                pages = self.pages_at(seq, k)
                if pages is not None:  # else the window has passed it already
                    self.prefix_cache.insert(hashes[k], pages, hashes[k - 1] if k else self._root(seq),
                                             seq.token_ids[self.page_end(k - 1) if k else 0:self.page_end(k)],
                                             seq.adapter_name, first=not k)
                state.committed += 1
        if self.window:
            self._slide(seq, state)

    def _slide(self, seq: Sequence, state: KVHandle) -> None:
        """The next query sits at position `computed` and sees keys after computed - window:
        pages whose rows all lie before that are let go (others may still map them)."""
        first_live = seq.num_computed_tokens - self.window + 1
        while self.page_end(state.slid) <= first_live:
            if self.pages_at(seq, state.slid) is not None:
                self.unmap_page(seq, state.slid)
            state.slid += 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child continues from parent's state: same tokens so far, the pages holding their
        K/V shared. The scheduler counts the child's computed tokens as the parent's."""
        self._take_place(child)
        shared = self.page_range(0, parent.num_computed_tokens)
        self.install_many(child, [self.pages_at(parent, k) for k in shared])  # None: before the window, let go
        self.after_install(child, len(shared))
        mine = parent.kv
        child.kv.names, child.kv.committed, child.kv.slid = mine.names[:], mine.committed, mine.slid

    def release(self, seq: Sequence, keep_pages: bool = True) -> None:
        """seq is done (keep_pages: its slot may stay mapped for the next) or preempted: its
        place and references go, and its handle with them. Over a pool several processes share,
        nothing stays mapped and the cache keeps nothing no sequence maps: the pages go back to
        the pool (the pages of named prefixes to its directory), for whichever process needs them."""
        shared = self.prefix_cache is not None and self.prefix_cache.shared
        if shared and not self.window and not seq.scores_prompt:
            self._publish_tail(seq)
        self.vacate(seq, keep_pages and not shared)
        self.handles.discard(seq.kv)
        seq.kv = None
        if shared:
            self.prefix_cache.trim()

    def _publish_tail(self, seq: Sequence) -> None:
        """Publish seq's computed rows after its last whole page (a page of its own with a
        partial page's tokens) for another process given the same prompt (`_partial`)."""
        k = seq.kv.committed
        start = self.page_end(k - 1) if k else 0
        pages = self.pages_at(seq, k)
        if seq.num_computed_tokens <= start or pages is None or self.page_end(k) <= seq.num_computed_tokens:
            return
        parent = self._page_hashes(seq, start)[k - 1] if k else self._root(seq)
        self.prefix_cache.publish_tail(parent, seq.token_ids[start:seq.num_computed_tokens], pages)

    def _take_place(self, seq: Sequence) -> None:
        seq.kv = self.place(seq)
        self.handles.add(seq.kv)

    # -- sleep ----------------------------------------------------------------------------
    def sleep(self) -> None:
        """Give every physical page back (the prefix cache is emptied); the places kernels read
        (`k_caches`, `v_caches`) stay the same objects. No sequence may hold KV: the engine
        finishes or refuses requests first."""
        if self.active_sequences():
            raise RuntimeError(f"{self.active_sequences()} sequences still hold KV")
        if self.prefix_cache:
            self.prefix_cache.clear()  # to the tiers, if any: they come back after wake_up
        self.unmap_all()

    def _let_cache_go(self) -> None:
        """Closing: the cached entries go to the tiers, which finish their writes (so a
        restarted engine finds them on disk), then the cache is empty."""
        self._flushing = True
        if self.prefix_cache:
            self.prefix_cache.clear()
        if self.tiers:
            self.tiers.close()

    def active_sequences(self) -> int:
        """Sequences holding a place (running or swapped out)."""
        return len(self.handles)

    @abstractmethod
    def unmap_all(self) -> None:
        """Free every physical page of an idle cache (sleep)."""

    @abstractmethod
    def wake_up(self) -> None:
        """Physical memory back, every page free."""

    @property
    @abstractmethod
    def asleep(self) -> bool:
        """Is the physical memory released?"""

    # -- numbers --------------------------------------------------------------------------
    def held_by_cache(self):
        return self.prefix_cache.held() if self.prefix_cache else {}

    def stats(self) -> KVStats:
        pool, c = self.pool.stats(), self.prefix_cache
        idle = self.pages_idle()
        cached = sum(1 for p in (c.held() if c else {}) if self.pool.own_refs(p) == 1)
        return KVStats(
            layout=self.layout, page_size=self.page_size, pages_total=pool.total, pages_free=pool.free,
            pages_in_use=pool.in_use - idle - cached, pages_idle=idle, pages_cached=cached,
            pages_shared=pool.shared, peak_pages_mapped=pool.peak_in_use, map_seconds=self.map_seconds,
            cow_copies=self.cow_copies, swap_outs=self.swap_outs, swap_ins=self.swap_ins,
            swap_bytes_out=self.swap_bytes[0], swap_bytes_in=self.swap_bytes[1], prefix_cache_queries=c.queries if c else 0,
            prefix_cache_hits=c.hits if c else 0, evictions=c.evictions if c else 0, asleep=pool.asleep,
            tiers=tuple(dataclasses.replace(t, tokens_restored=self.restored_tokens[t.tier])
                        for t in (self.tiers.stats() if self.tiers else ())),
            tier_restore_seconds=self.restore_seconds, tier_offload_seconds=self.offload_seconds,
            prefix_cache_imported=c.imported if c else 0, prefix_cache_partial_hits=self.partial_tokens,
            prefix_cache_partial_bytes=self.partial_bytes)
