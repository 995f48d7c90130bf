"""The layout protocol: where a KV cache's pages live, and nothing about why.

A layout lays a sequence's KV out as pages 0, 1, 2, ... (the virtual layouts, engine/kv/virtual.py:
the pages mapped into its slot; the block table, engine/kv/paged.py: its table of blocks) and
answers three kinds of question for the KV manager (engine/kv/manager.py), which alone decides
what to map, share, cache or let go:

  geometry   rows over pages (`page_end`, `tokens_in_pages`, `page_range`, `tile_end`), bytes
             (`page_size`, `token_bytes`, `entry_bytes`) and what a page's bytes depend on
             besides its tokens (`geometry`, which names pages across processes and tiers)
  placement  a sequence's place (`place`, `vacate`), its pages (`pages_at`), and the changes
             the manager asks for: `install` existing pages (someone else's: one more reference
             each), `install_prefix` a cached prefix into a fresh place, `map_fresh` private
             pages, `copy_on_write` a shared one, `unmap_page` one the window passed
  bytes      where kernels read a sequence's rows (`k_caches`, `v_caches`, `block_table`) and
             where the tiers copy an entry's bytes out and in (`entry_views`, `page_views`)

and it owns the physical memory it was built over (`pool`): what a finished sequence's place
keeps mapped (`reclaim_idle`, `reclaimable_pages`, `pages_idle`), sleep (`unmap_all`,
`wake_up`, `asleep`), swap, a capability it declares (`swaps`), and `audit`, which checks each
page's count against who holds it. A layout never reads the prefix cache; the manager passes
in what it needs of it (the pages the cache holds, which swapped pages are still cached).

Who writes what: the manager calls every verb that changes a layout; the layout writes its own
places and mappings and the handle's place fields (`Slot.slot`, `BlockTable.table`); the
handle's names and counts (`KVHandle.names`, `committed`, `slid`) are the manager's.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from engine.request.sequence import Sequence
from vmm import PageAllocator


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


class KVLayout(ABC):
    name: str  # "interleaved", "per_layer", "paged"
    pool: PageAllocator  # page ids and their reference counts
    num_regions: int = 1  # pages per page index: 2 x layers for per_layer, else 1
    k_caches: list  # per layer, [blocks, rows, heads, D]
    v_caches: list
    swaps: bool = False  # can swap_out / swap_in (a virtual layout with a swap tier)

    # -- geometry ---------------------------------------------------------------------------
    @property
    @abstractmethod
    def page_size(self) -> int:
        """Bytes of one page (one block, for the block table)."""

    @property
    @abstractmethod
    def token_bytes(self) -> int:
        """KV bytes one token occupies, all layers."""

    @property
    def entry_bytes(self) -> int:
        """Bytes of one prefix-cache entry: a page of each region."""
        return self.page_size * self.num_regions

    @abstractmethod
    def page_end(self, k: int) -> int:
        """One past the last token whose row touches page k."""

    @abstractmethod
    def tokens_in_pages(self, m: int) -> int:
        """Tokens whose rows lie wholly inside pages 0..m-1."""

    @abstractmethod
    def page_range(self, start: int, end: int) -> range:
        """Page indices touched by the rows of tokens [start, end)."""

    def tile_end(self, num_tokens: int) -> int:
        """One past the last row a kernel may load for num_tokens tokens (whole tiles)."""
        return num_tokens

    def pages_for(self, num_tokens: int) -> int:
        """Pages, over all regions, that a sequence of num_tokens maps."""
        return len(self.page_range(0, num_tokens)) * self.num_regions

    @abstractmethod
    def geometry(self) -> dict:
        """What the bytes of a page depend on besides its tokens (dtype, layout, sizes)."""

    # -- placement --------------------------------------------------------------------------
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

    def is_shared(self, seq: Sequence, k: int) -> bool:
        """Does anyone besides seq reference its page k (another sequence, the prefix cache)?"""
        return any(self.pool.ref_counts[p] > 1 for p in self.pages_at(seq, k))

    @abstractmethod
    def install(self, seq: Sequence, k: int, pages: tuple[int, ...] | None) -> None:
        """Put existing pages (someone else's) behind seq's page k: one more reference each
        (None: a page before the window, nothing to map)."""

    def install_prefix(self, seq: Sequence, entries: list[tuple[int, ...] | None]) -> None:
        """Into seq's new place, install(seq, k, entries[k]) for k = 0, 1, ...; anything a reused
        place still maps past them that someone else references goes (a layout may map runs)."""
        for k, pages in enumerate(entries):
            self.install(seq, k, pages)

    @abstractmethod
    def map_fresh(self, seq: Sequence, indices: list[int]) -> None:
        """Fresh private pages behind seq's page indices (PoolExhausted: none of a run)."""

    @abstractmethod
    def copy_on_write(self, seq: Sequence, k: int) -> None:
        """Give seq a private copy of its (shared) page k."""

    @abstractmethod
    def unmap_page(self, seq: Sequence, k: int) -> None:
        """seq lets go of its page k (it left the sliding window)."""

    # -- bytes ------------------------------------------------------------------------------
    @abstractmethod
    def block_table(self, seqs: list[Sequence], ctx_lens: list[int]) -> tuple[list[list[int]], int]:
        """Where the kernels find each sequence's first ctx_len rows: per sequence the blocks of
        `k_caches[l]` / `v_caches[l]` ([blocks, rows, heads, D]) holding them, and rows per block."""

    @abstractmethod
    def entry_views(self, pages: tuple[int, ...]) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
        """The bytes of pool pages (one per region), mapped or not, as 1-D uint8 tensors
        valid inside the `with`: what an offloaded entry holds."""

    @abstractmethod
    def page_views(self, seq: Sequence, k: int) -> list[torch.Tensor]:
        """The bytes behind seq's (mapped) page k, as entry_views orders them."""

    def copy_partial(self, seq: Sequence, k: int, pages: tuple[int, ...], end: int) -> int:
        """Copy the rows of tokens before `end` from cached `pages` (one per region) into seq's
        page k; returns the bytes copied. Here the whole page: a layout whose rows lie in token
        order copies only the rows it needs."""
        with self.entry_views(pages) as parts:
            copy_bytes(self.page_views(seq, k), parts)
        return self.entry_bytes

    # -- memory -----------------------------------------------------------------------------
    def reclaimable_pages(self) -> int:
        """Pages that finished sequences' places keep mapped, which `reclaim_idle` can free."""
        return 0

    def reclaim_idle(self, want_free: int) -> None:
        """Unmap what finished sequences' places keep until want_free pages are free (or none is left)."""

    def pages_idle(self, held: dict[int, int]) -> int:
        """Pages only finished sequences' places (and maybe the prefix cache, `held`) reference."""
        return 0

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

    # -- swapping: a capability (`swaps`) -------------------------------------------------
    def swap_out(self, seq: Sequence, held: dict[int, int]) -> bool:
        """Move seq's private pages (`held`: what the prefix cache holds) to the swap tier;
        False, nothing done, if the tier is full."""
        raise NotImplementedError(f"the {self.name} layout does not swap")

    def swap_in(self, seq: Sequence, still_cached: set[int]) -> None:
        """Fresh pages where seq's swapped pages were, their bytes copied back; the pages in
        `still_cached` are the prefix cache's very pages, installed again without a copy."""
        raise NotImplementedError(f"the {self.name} layout does not swap")

    def swapped_pages(self, seq: Sequence) -> dict[int, tuple[int, ...]]:
        """{page index: the pages it had} for what seq sent to the swap tier."""
        return {}

    @property
    def swap_bytes(self) -> tuple[int, int]:
        """Bytes moved to and from the swap tier."""
        return 0, 0

    # -- checks -----------------------------------------------------------------------------
    @abstractmethod
    def audit(self, handles: set[KVHandle], held: dict[int, int]) -> None:
        """Raise if any page's reference count disagrees with who holds it: the places of
        `handles` and the prefix cache's `held`."""

    @abstractmethod
    def close(self) -> None:
        """Give every page and range back."""
