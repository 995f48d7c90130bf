"""A slower tier for page contents: where a preempted sequence's private pages wait.

Swapping a page out copies its bytes into a free slot here, and the caller unmaps the page;
swapping in maps a fresh page at the same virtual address and copies the bytes back, so every
pointer and view into the range stays what it was. On the host the tier is a file of its own
(sparse: disk is used only by slots written), on CUDA pinned host memory, so both directions
are one copy each.
"""
from __future__ import annotations

import mmap
import os
import tempfile
from collections import deque

import torch

from vmm.backend import Backend
from vmm.errors import PoolExhausted


class SwapSpace:
    def __init__(self, backend: Backend, nbytes: int, path: str | None = None):
        self.backend, self.page_size = backend, backend.page_size
        self.num_slots = nbytes // self.page_size
        if self.num_slots < 1:
            raise ValueError(f"swap space of {nbytes} bytes holds no {self.page_size}-byte page")
        size = self.num_slots * self.page_size
        if backend.device.type == "cuda":
            self._file = self._map = None
            self.store = torch.empty((self.num_slots, self.page_size), dtype=torch.uint8, pin_memory=True)
        else:
            self._file = open(path, "w+b") if path else tempfile.TemporaryFile(prefix="vkv-swap-")
            self._file.truncate(size)
            self._map = mmap.mmap(self._file.fileno(), size)
            self.store = torch.frombuffer(self._map, dtype=torch.uint8).view(self.num_slots, self.page_size)
        self.free_slots: deque[int] = deque(range(self.num_slots))
        self.bytes_out = self.bytes_in = 0

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def save(self, addr: int) -> int:
        """Copy the page visible at addr into a free slot; returns the slot."""
        if not self.free_slots:
            raise PoolExhausted(f"all {self.num_slots} swap slots are in use")
        slot = self.free_slots.popleft()
        self.store[slot].copy_(self.backend.byte_view(addr, self.page_size))
        self.bytes_out += self.page_size
        return slot

    def restore(self, slot: int, addr: int) -> None:
        """Copy a slot back into the (mapped) page at addr and free the slot."""
        self.backend.byte_view(addr, self.page_size).copy_(self.store[slot])
        self.bytes_in += self.page_size
        self.discard(slot)

    def discard(self, slot: int) -> None:
        """Free a slot without reading it (its sequence ended while swapped out)."""
        self.free_slots.append(slot)

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
