"""Virtual KV cache: each running sequence owns a slot, a contiguous virtual range per region,
and pool pages are mapped into it as the sequence grows.

Layouts (`kv_layout`):
  interleaved  one region; a token row holds K and V of every layer, [slots, rows, L, 2, H, D].
               One page serves all layers, so a sequence maps one page per `page/row` tokens.
  per_layer    2 x layers regions (K and V of each layer, [slots, rows, H, D]): vAttention's.
Every region has the same row size, so a slot's regions grow in lockstep: `mapped[slot]` pages
in each. `rows` per slot is padded so a slot ends on a page boundary and slot `s` starts at row
`s * rows` of a flattened view: that is what FlashAttention's `cum_seq_k` offsets need.

Deferred reclamation: a finished sequence's slot keeps its pages mapped (`idle`, LRU order) and
the next sequence that takes the slot writes over them without mapping anything; idle pages are
unmapped only when the pool runs short.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict, deque

import torch

import vmm
from engine.models.config import ModelConfig
from engine.sequence import Sequence

LAYOUTS = ("interleaved", "per_layer")


class VirtualKVCache:
    def __init__(self, cfg: ModelConfig, layout: str, num_slots: int, max_model_len: int,
                 dtype: torch.dtype, backend: vmm.Backend, num_pages: int):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown virtual kv_layout {layout!r}: choose one of {LAYOUTS}")
        self.layout, self.num_slots, self.dtype = layout, num_slots, dtype
        L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.num_layers = L
        self.row_elems = L * 2 * H * D if layout == "interleaved" else H * D
        self.row_bytes = self.row_elems * itemsize
        self.page_size = backend.page_size
        align = math.lcm(self.row_bytes, self.page_size) // self.row_bytes
        self.rows = math.ceil(max_model_len / align) * align
        self.slot_pages = self.rows * self.row_bytes // self.page_size
        self.pool = vmm.PagePool(backend, num_pages)
        num_regions = 1 if layout == "interleaved" else 2 * L
        self.regions = [vmm.Reservation(self.pool, num_slots * self.slot_pages * self.page_size)
                        for _ in range(num_regions)]
        self.k_caches, self.v_caches = self._views(L, H, D)
        self.mapped = [0] * num_slots
        self.free_slots: deque[int] = deque(range(num_slots))
        self.idle_slots: OrderedDict[int, None] = OrderedDict()
        self.map_seconds = 0.0

    def _views(self, L: int, H: int, D: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, K and V as [slots, rows, H, D] views (row stride = row_elems)."""
        if self.layout == "per_layer":
            views = [r.view(self.dtype, (self.num_slots, self.rows, H, D)) for r in self.regions]
            return views[0::2], views[1::2]
        rows = self.regions[0].view(self.dtype, (self.num_slots, self.rows, L, 2, H, D))
        return [rows[:, :, l, 0] for l in range(L)], [rows[:, :, l, 1] for l in range(L)]

    # -- sizing ---------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        """Pages one sequence of num_tokens maps, over all regions."""
        return math.ceil(num_tokens * self.row_bytes / self.page_size) * len(self.regions)

    @property
    def num_free_pages(self) -> int:
        """Pages obtainable now: free in the pool, or mapped in idle slots and reclaimable."""
        return self.pool.num_free + sum(self.mapped[s] for s in self.idle_slots) * len(self.regions)

    # -- slots ----------------------------------------------------------------------------
    def allocate_slot(self, seq: Sequence) -> None:
        if self.idle_slots:  # reuse mapped pages: deferred reclamation pays off here
            seq.slot, _ = self.idle_slots.popitem(last=True)
        else:
            seq.slot = self.free_slots.popleft()

    def ensure_mapped(self, seq: Sequence, num_tokens: int) -> bool:
        """Map pages so the slot covers num_tokens; False (nothing changed) if memory is short."""
        have, need = self.mapped[seq.slot], self.pages_for(num_tokens) // len(self.regions)
        if need <= have:
            return True
        missing = (need - have) * len(self.regions)
        if self.num_free_pages < missing:
            return False
        self._reclaim(missing)
        start = time.perf_counter()
        first = seq.slot * self.slot_pages + have
        for region in self.regions:
            region.map_new(first, need - have)
        self.map_seconds += time.perf_counter() - start
        self.mapped[seq.slot] = need
        return True

    def free_slot(self, seq: Sequence, keep_pages: bool = True) -> None:
        """The sequence is done with its slot; its pages stay mapped for the next one unless
        keep_pages is False (preemption: the memory is needed now)."""
        slot, seq.slot = seq.slot, None
        if keep_pages and self.mapped[slot]:
            self.idle_slots[slot] = None
        else:
            self._unmap_slot(slot)
            self.free_slots.append(slot)

    def _reclaim(self, num_pages: int) -> None:
        while self.pool.num_free < num_pages and self.idle_slots:
            slot, _ = self.idle_slots.popitem(last=False)
            self._unmap_slot(slot)
            self.free_slots.append(slot)

    def _unmap_slot(self, slot: int) -> None:
        if self.mapped[slot]:
            for region in self.regions:
                region.unmap(slot * self.slot_pages, self.mapped[slot])
            self.mapped[slot] = 0

    # -- checks and numbers ---------------------------------------------------------------
    def audit(self) -> None:
        """Pool accounting agrees with the mappings, and each slot maps exactly mapped[slot]."""
        self.pool.audit(self.regions)
        for region in self.regions:
            per_slot = [0] * self.num_slots
            for index in region.mapped_pages():
                per_slot[index // self.slot_pages] += 1
            assert per_slot == self.mapped, (per_slot, self.mapped)

    def stats(self) -> dict:
        pool = self.pool.stats()
        idle = sum(self.mapped[s] for s in self.idle_slots) * len(self.regions)
        return {"pages_total": pool.total, "pages_free": pool.free, "pages_in_use": pool.in_use - idle,
                "pages_idle": idle, "peak_pages_mapped": pool.peak_in_use, "page_size": self.page_size,
                "map_seconds": self.map_seconds}

    def close(self) -> None:
        for region in self.regions:
            if not region.released:
                region.release()
        self.pool.close()
