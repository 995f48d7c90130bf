"""The virtual layouts (engine/kv/layout.py): each running sequence owns a slot, a contiguous
virtual range per region, and pool pages are mapped into it as the sequence grows.

Layouts (`kv_layout`):
  interleaved  one region; a token row holds K and V of every layer, [slots, rows, L, 2, H, D].
               One page serves all layers, so a sequence maps one page per `page/row` tokens.
  per_layer    2 x layers regions (K and V of each layer, [slots, rows, H, D]): vAttention's.
Every region has the same row size, so a slot's regions are mapped in lockstep: page k of a
sequence is the tuple of each region's page at index k of its slot. `rows` per slot is padded
so a slot ends on a page boundary and slot `s` starts at row `s * rows` of a flattened view:
FlashAttention's `cum_seq_k` offsets need that. A row may straddle two pages.

Deferred reclamation: a finished sequence's slot keeps its pages mapped (`idle_slots`, LRU) and
the next sequence that takes the slot writes over them without mapping anything; idle pages are
unmapped only when the pool runs short. Pages another sequence or the prefix cache also holds
are unmapped from a reused slot instead, so nobody's shared bytes get overwritten.

Swapping (`swap`, a `vmm.SwapSpace`): a sequence swapped out keeps its slot, so its KV keeps
its virtual addresses. The bytes of its private pages under its computed rows go to the swap
tier and every private page goes back to the pool (one the prefix cache holds stays there,
evictable); pages other sequences map (a fork's prompt) stay mapped, held by the slot. Swapping in maps fresh pages at the same indices and
copies the bytes back: no block table to rewrite, no token recomputed.
"""
from __future__ import annotations

import contextlib
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

import vmm
from engine.kv.layout import KVHandle, KVLayout
from engine.models.config import ModelConfig
from engine.request.sequence import Sequence
from vmm.backend import consecutive_runs

LAYOUTS = ("interleaved", "per_layer")


@dataclass(eq=False)
class Slot(KVHandle):
    """A sequence's slot, and while it is swapped out, what went to the swap tier:
    {page index: (its pages, swap slots)}."""
    slot: int = -1
    swapped: dict[int, tuple] | None = None

    @property
    def place(self) -> int:
        return self.slot


class VirtualLayout(KVLayout):
    def __init__(self, cfg: ModelConfig, layout: str, num_slots: int, max_model_len: int,
                 dtype: torch.dtype, backend: vmm.Backend, num_pages: int, tile_rows: int = 1,
                 swap: vmm.SwapSpace | None = None, pool: vmm.PoolShare | vmm.AttachedPool | None = None):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown virtual kv_layout {layout!r}: choose one of {LAYOUTS}")
        self.name, self.num_slots, self.dtype = layout, num_slots, dtype
        L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.row_elems = L * 2 * H * D if layout == "interleaved" else H * D
        self.row_bytes = self.row_elems * itemsize
        self._page_size = backend.page_size
        align = math.lcm(math.lcm(self.row_bytes, self.page_size) // self.row_bytes, tile_rows)
        self.rows = math.ceil(max_model_len / align) * align
        self.tile_rows = tile_rows  # > 1: the kernel loads whole tiles, mapped and zeroed
        self.slot_pages = self.rows * self.row_bytes // self.page_size
        self.num_regions = 1 if layout == "interleaved" else 2 * L
        # else a share of a pool several models draw from (vmm/share.py); an AttachedPool (a pool
        # several processes draw from, vmm/attach.py) is this cache's to leave
        self.owns_pool = pool is None or isinstance(pool, vmm.AttachedPool)
        self.pool = vmm.PagePool(backend, num_pages) if pool is None else pool
        self.regions = [vmm.Reservation(self.pool, num_slots * self.slot_pages * self.page_size)
                        for _ in range(self.num_regions)]
        self.k_caches, self.v_caches = self._views(L, H, D)
        self.staging: vmm.Reservation | None = None  # entry_views maps there (made on first use)
        self.mapped = [0] * num_slots  # pages mapped in each region of each slot
        self.free_slots: deque[int] = deque(range(num_slots))
        self.idle_slots: OrderedDict[int, None] = OrderedDict()
        self.swap = swap
        self.swaps = swap is not None

    def _views(self, L: int, H: int, D: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, K and V as [slots, rows, H, D] views (row stride = row_elems)."""
        if self.name == "per_layer":
            views = [r.view(self.dtype, (self.num_slots, self.rows, H, D)) for r in self.regions]
            return views[0::2], views[1::2]
        rows = self.regions[0].view(self.dtype, (self.num_slots, self.rows, L, 2, H, D))
        return [rows[:, :, l, 0] for l in range(L)], [rows[:, :, l, 1] for l in range(L)]

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def token_bytes(self) -> int:
        return self.row_bytes * self.num_regions

    # -- geometry -------------------------------------------------------------------------
    def page_end(self, k: int) -> int:
        return -(-(k + 1) * self.page_size // self.row_bytes)

    def tokens_in_pages(self, m: int) -> int:
        return m * self.page_size // self.row_bytes

    def page_range(self, start: int, end: int) -> range:
        return range(start * self.row_bytes // self.page_size, -(-end * self.row_bytes // self.page_size))

    def _index(self, seq: Sequence, k: int) -> int:
        return seq.kv.slot * self.slot_pages + k

    def pages_at(self, seq: Sequence, k: int) -> tuple[int, ...] | None:
        first = self.regions[0].page_at(self._index(seq, k))
        return None if first is None else tuple(r.page_at(self._index(seq, k)) for r in self.regions)

    # -- slots and pages ------------------------------------------------------------------
    def can_allocate(self, n: int = 1) -> bool:
        return len(self.idle_slots) + len(self.free_slots) >= n

    def place(self, seq: Sequence) -> Slot:
        if self.idle_slots:  # reuse mapped pages: deferred reclamation pays off here
            return Slot(seq.seq_id, slot=self.idle_slots.popitem(last=True)[0])
        return Slot(seq.seq_id, slot=self.free_slots.popleft())

    def install(self, seq: Sequence, k: int, pages: tuple[int, ...] | None) -> None:
        if self.pages_at(seq, k) == pages:
            return
        if pages is None:
            self._unmap(seq.kv.slot, [k])
            return
        if self.pages_at(seq, k) is not None:
            self._unmap(seq.kv.slot, [k])
        for region, page in zip(self.regions, pages):
            region.map(self._index(seq, k), page)
        self.mapped[seq.kv.slot] += 1

    def install_prefix(self, seq: Sequence, entries: list[tuple[int, ...] | None]) -> None:
        """Into a slot with nothing there yet: each region's pages as one run (one access call,
        one mmap per run of consecutive pages), not one call per page. A reused slot keeps its
        private pages past the installed prefix; shared ones go."""
        fresh = entries and all(p is not None for p in entries) and \
            all(self.pages_at(seq, k) is None for k in range(len(entries)))
        if fresh:
            self._map_prefix(seq, entries)
        else:
            super().install_prefix(seq, entries)
        stale = [k for k in range(len(entries), self.slot_pages)
                 if self.pages_at(seq, k) is not None and self.is_shared(seq, k)]
        self._unmap(seq.kv.slot, stale)

    def _map_prefix(self, seq: Sequence, entries: list[tuple[int, ...]]) -> None:
        done = []
        try:
            for r, region in enumerate(self.regions):
                region.map_run(self._index(seq, 0), [pages[r] for pages in entries])
                done.append(region)
        except BaseException:  # all regions or none
            for region in done:
                region.unmap(self._index(seq, 0), len(entries))
            raise
        self.mapped[seq.kv.slot] += len(entries)

    def unmap_page(self, seq: Sequence, k: int) -> None:
        self._unmap(seq.kv.slot, [k])

    def map_fresh(self, seq: Sequence, indices: list[int]) -> None:
        """Fresh pages behind seq's page indices, each run's pages for every region taken at once:
        all or none (PoolExhausted leaves nothing mapped for that run)."""
        for first, count in consecutive_runs(indices):
            at = self._index(seq, first)
            pages = self.pool.alloc_many(count * self.num_regions)
            done = []
            try:
                for r, region in enumerate(self.regions):
                    region.map_run(at, pages[r * count:(r + 1) * count])
                    done.append(region)
                    if self.tile_rows > 1:  # a tile may load rows never written: they must be finite
                        region.view(torch.uint8, (count * self.page_size,), offset=region.offset_of(at)).zero_()
            except BaseException:
                for region in done:
                    region.unmap(at, count)
                raise
            finally:
                self.pool.drop_many(pages)  # the mappings hold them now
            self.mapped[seq.kv.slot] += count

    @contextlib.contextmanager
    def entry_views(self, pages: tuple[int, ...]) -> Iterator[list[torch.Tensor]]:
        """A cached entry's pages are mapped nowhere: map them side by side in the staging
        range for the copy, then unmap (each mapping is one reference while it lasts)."""
        if self.staging is None:
            self.staging = vmm.Reservation(self.pool, self.num_regions * self.page_size)
        self.staging.map_run(0, list(pages))
        try:
            yield [self.staging.view(torch.uint8, (len(pages) * self.page_size,))]
        finally:
            self.staging.unmap(0, len(pages))

    def copy_partial(self, seq: Sequence, k: int, pages: tuple[int, ...], end: int) -> int:
        """Only the bytes of page k before token end's row, in each region (rows lie in token
        order in every region: row t at t * row_bytes of the slot)."""
        n = min(self.page_size, end * self.row_bytes - k * self.page_size)
        with self.entry_views(pages) as (staged,):
            for r, view in enumerate(self.page_views(seq, k)):
                view[:n].copy_(staged[r * self.page_size:r * self.page_size + n])
        return n * self.num_regions

    def page_views(self, seq: Sequence, k: int) -> list[torch.Tensor]:
        return [r.view(torch.uint8, (self.page_size,), offset=r.offset_of(self._index(seq, k)))
                for r in self.regions]

    def geometry(self) -> dict:
        return {"layout": self.name, "dtype": str(self.dtype), "page_size": self.page_size,
                "row_bytes": self.row_bytes, "regions": self.num_regions,
                "k_cache": list(self.k_caches[0].shape[1:])}

    def tile_end(self, num_tokens: int) -> int:
        return min(-(-num_tokens // self.tile_rows) * self.tile_rows, self.rows)

    def copy_on_write(self, seq: Sequence, k: int) -> None:
        for region in self.regions:
            region.copy_on_write(self._index(seq, k))

    def vacate(self, seq: Sequence, keep_pages: bool) -> None:
        """The slot's pages stay mapped for the next sequence unless keep_pages is False
        (preemption: the memory is needed now) or seq ended while swapped out."""
        slot = seq.kv.slot
        for _, slots in (seq.kv.swapped or {}).values():
            keep_pages = False
            for swap_slot in slots:
                self.swap.discard(swap_slot)
        if keep_pages and self.mapped[slot]:
            self.idle_slots[slot] = None
        else:
            self._unmap_slot(slot)
            self.free_slots.append(slot)

    # -- swapping -------------------------------------------------------------------------
    def swap_out(self, seq: Sequence, held: dict[int, int]) -> bool:
        """Pages only seq maps (the prefix cache may hold them too) leave its slot; the bytes of
        those under its computed rows are saved first."""
        slot = seq.kv.slot
        mine = [k for k in self._slot_pages(slot)
                if all(self.pool.ref_counts[p] == 1 + held.get(p, 0) for p in self.pages_at(seq, k))]
        kept = [k for k in mine if k < len(self.page_range(0, seq.num_computed_tokens))]
        if self.swap.num_free < len(kept) * self.num_regions:
            return False
        saved, taken = {}, []  # taken: every swap slot filled so far, freed again if a save fails
        try:
            for k in kept:
                for r in self.regions:
                    taken.append(self.swap.save(r.addr + r.offset_of(self._index(seq, k))))
                saved[k] = (self.pages_at(seq, k), tuple(taken[-len(self.regions):]))
        except BaseException:
            for swap_slot in taken:
                self.swap.discard(swap_slot)
            raise
        seq.kv.swapped = saved
        self._unmap(slot, mine)
        return True

    def swapped_pages(self, seq: Sequence) -> dict[int, tuple[int, ...]]:
        return {k: pages for k, (pages, _) in (seq.kv.swapped or {}).items()}

    def swap_in(self, seq: Sequence, still_cached: set[int]) -> None:
        """Each page leaves seq.kv.swapped as it comes back, so a failure part way (over a pool
        other processes share, PoolExhausted) leaves what came back mapped and the rest swapped,
        no swap slot freed twice."""
        swapped = seq.kv.swapped or {}
        for k in sorted(swapped):
            pages, swap_slots = swapped[k]
            if k in still_cached:  # the prefix cache's very pages: no copy
                self.install(seq, k, pages)
                for swap_slot in swap_slots:
                    self.swap.discard(swap_slot)
            else:
                self.map_fresh(seq, [k])
                for r, swap_slot in zip(self.regions, swap_slots):
                    self.swap.restore(swap_slot, r.addr + r.offset_of(self._index(seq, k)))
            del swapped[k]
        seq.kv.swapped = None

    @property
    def swap_bytes(self) -> tuple[int, int]:
        return (self.swap.bytes_out, self.swap.bytes_in) if self.swap else (0, 0)

    def reclaimable_pages(self) -> int:
        """Pages mapped in idle slots (an upper bound: some may also be mapped elsewhere)."""
        return sum(self.mapped[s] for s in self.idle_slots) * self.num_regions

    def reclaim_idle(self, want_free: int) -> None:
        """Idle slots, least recently used first."""
        while self.pool.num_free < want_free and self.idle_slots:
            slot, _ = self.idle_slots.popitem(last=False)
            self._unmap_slot(slot)
            self.free_slots.append(slot)

    def _unmap(self, slot: int, indices: list[int]) -> None:
        for first, count in consecutive_runs(indices):
            for region in self.regions:
                region.unmap(slot * self.slot_pages + first, count)
            self.mapped[slot] -= count

    def _slot_pages(self, slot: int) -> list[int]:
        base = slot * self.slot_pages
        return [i for i in range(self.slot_pages) if self.regions[0].page_at(base + i) is not None]

    def _unmap_slot(self, slot: int) -> None:
        self._unmap(slot, self._slot_pages(slot))

    # -- sleep ----------------------------------------------------------------------------
    def unmap_all(self) -> None:
        """Unmap the idle slots and release every page: the reservations, and so every view
        and pointer into them, stay as they are (on CUDA, graphs captured over them stay valid)."""
        self.reclaim_idle(self.pool.num_pages)
        self.pool.release_memory()

    def wake_up(self) -> None:
        self.pool.restore_memory()

    @property
    def asleep(self) -> bool:
        return self.pool.asleep

    # -- checks and numbers ---------------------------------------------------------------
    def audit(self, handles: set[KVHandle], held: dict[int, int]) -> None:
        """Each page's count is its mappings plus the prefix cache's hold; regions in lockstep."""
        self.pool.audit(self.regions, held)
        for region in self.regions:
            per_slot = [0] * self.num_slots
            for index in region.mapped_pages():
                per_slot[index // self.slot_pages] += 1
            assert per_slot == self.mapped, (per_slot, self.mapped)
        if self.swap:
            in_swap = [s for h in handles for _, slots in (h.swapped or {}).values() for s in slots]
            assert sorted(in_swap + list(self.swap.free_slots)) == list(range(self.swap.num_slots)), \
                "a swap slot is lost or held twice"

    def pages_idle(self, held: dict[int, int]) -> int:
        """Pages that only idle slots (and maybe the prefix cache) reference."""
        refs = Counter(region.page_at(slot * self.slot_pages + i) for slot in self.idle_slots
                       for i in self._slot_pages(slot) for region in self.regions)
        return sum(1 for page, n in refs.items() if self.pool.own_refs(page) == n + held.get(page, 0))

    def block_table(self, seqs: list[Sequence], ctx_lens: list[int]) -> tuple[list[list[int]], int]:
        """A slot is one block as long as the slot: K/V rows are read in place."""
        return [[s.kv.slot] for s in seqs], self.rows

    def close(self) -> None:
        for region in (*self.regions, *([self.staging] if self.staging else [])):
            if not region.released:
                region.release()
        if self.owns_pool:
            self.pool.close()
            self.pool.backend.close()
        if self.swap:
            self.swap.close()
