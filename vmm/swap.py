"""Slower tiers for page contents: fixed-size slots of bytes outside the page pool.

`SlotStore` is the storage: `put` copies some byte tensors into a free slot, `get` copies a
slot back out, `discard` frees it. On the host it is a file of its own (sparse: disk is used
only by slots written), on CUDA pinned host memory, so both directions are one copy each.

`SwapSpace` is where a preempted sequence's private pages wait. Swapping a page out copies its
bytes into a slot, and the caller unmaps the page; swapping in maps a fresh page at the same
virtual address and copies the bytes back, so every pointer and view into the range stays what
it was. (The prefix cache's tiers, engine/kv/tiers.py, keep their entries in a SlotStore too.)
"""
from __future__ import annotations

import mmap
import os
import tempfile
from collections import deque
from collections.abc import Sequence

import torch

from vmm.backend import Backend
from vmm.errors import DoubleFree, PoolExhausted


class SlotStore:
    def __init__(self, device: torch.device, slot_size: int, nbytes: int, path: str | None = None):
        self.slot_size = slot_size
        self.num_slots = nbytes // slot_size
        if self.num_slots < 1:
            raise ValueError(f"{nbytes} bytes hold no {slot_size}-byte slot")
        size = self.num_slots * slot_size
        if device.type == "cuda":
            self._file = self._map = None
            self.store = torch.empty((self.num_slots, slot_size), dtype=torch.uint8, pin_memory=True)
        else:
            self._file = open(path, "w+b") if path else tempfile.TemporaryFile(prefix="vkv-swap-")
            try:
                self._file.truncate(size)
                self._map = mmap.mmap(self._file.fileno(), size)
            except BaseException:  # undo: no file left behind
                self._file.close()
                if path:
                    os.remove(path)
                raise
            self.store = torch.frombuffer(self._map, dtype=torch.uint8).view(self.num_slots, slot_size)
        self.free_slots: deque[int] = deque(range(self.num_slots))
        self._free = set(self.free_slots)  # the same slots, to check a free against
        self.bytes_out = self.bytes_in = 0

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def put(self, parts: Sequence[torch.Tensor]) -> int:
        """Copy the byte tensors, one after another, into a free slot; returns the slot."""
        if not self.free_slots:
            raise PoolExhausted(f"all {self.num_slots} slots of {self.slot_size} bytes are in use")
        spans = self._spans(self.free_slots[0], parts)  # (checked before the slot is taken)
        slot = self.free_slots.popleft()
        self._free.discard(slot)
        for part, dst in zip(parts, spans):
            dst.copy_(part)
        self.bytes_out += sum(p.numel() for p in parts)
        return slot

    def get(self, slot: int, parts: Sequence[torch.Tensor]) -> None:
        """Copy a slot back into the byte tensors (the slot stays taken)."""
        self._taken(slot)
        for part, src in zip(parts, self._spans(slot, parts)):
            part.copy_(src)
        self.bytes_in += sum(p.numel() for p in parts)

    def _spans(self, slot: int, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        sizes = [p.numel() for p in parts]
        if sum(sizes) > self.slot_size:
            raise ValueError(f"{sum(sizes)} bytes do not fit a {self.slot_size}-byte slot")
        return list(self.store[slot, :sum(sizes)].split(sizes))

    def discard(self, slot: int) -> None:
        """Free a slot without reading it."""
        self._taken(slot)
        self.free_slots.append(slot)
        self._free.add(slot)

    def _taken(self, slot: int) -> None:
        """A slot freed twice would be handed to two owners, each overwriting the other's bytes."""
        if not (isinstance(slot, int) and 0 <= slot < self.num_slots) or slot in self._free:
            raise DoubleFree(f"swap slot {slot!r} is not one in use (of {self.num_slots})")

    def close(self) -> None:
        """Give the tier back: the file is deleted (a named one truncated and removed)."""
        self.store = None
        if self._map is not None:
            self._map.close()
            name = getattr(self._file, "name", None)
            self._file.close()
            if isinstance(name, str) and os.path.exists(name):
                os.remove(name)
            self._map = self._file = None


class SwapSpace(SlotStore):
    def __init__(self, backend: Backend, nbytes: int, path: str | None = None):
        if nbytes // backend.page_size < 1:
            raise ValueError(f"swap space of {nbytes} bytes holds no {backend.page_size}-byte page")
        super().__init__(backend.device, backend.page_size, nbytes, path)
        self.backend, self.page_size = backend, backend.page_size

    def save(self, addr: int) -> int:
        """Copy the page visible at addr into a free slot; returns the slot."""
        return self.put([self.backend.byte_view(addr, self.page_size)])

    def restore(self, slot: int, addr: int) -> None:
        """Copy a slot back into the (mapped) page at addr and free the slot."""
        self.get(slot, [self.backend.byte_view(addr, self.page_size)])
        self.discard(slot)
