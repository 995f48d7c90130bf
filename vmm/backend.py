"""The interface every physical-memory backend implements.

A backend knows four things: physical pages (create, release), virtual ranges (reserve, free),
mappings between them (map, set access, unmap) and how to look at memory (byte views, copies).
It keeps no bookkeeping of its own: `PagePool` and `Reservation` own all state and call these
methods under the pool's lock. Page handles are opaque to everything above the backend.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

PageHandle = object


def consecutive_runs(values: Sequence[int]) -> list[tuple[int, int]]:
    """Group integers into (first, count) runs of consecutive values, keeping their order."""
    runs: list[tuple[int, int]] = []
    for value in values:
        if runs and sum(runs[-1]) == value:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((value, 1))
    return runs


class Backend(ABC):
    name: str
    page_size: int
    device: torch.device

    @abstractmethod
    def create_page(self) -> PageHandle:
        """Allocate one physical page of `page_size` bytes."""

    @abstractmethod
    def release_page(self, handle: PageHandle) -> None:
        """Give a physical page back to the system; it must be mapped nowhere."""

    @abstractmethod
    def reserve(self, nbytes: int) -> int:
        """Reserve `nbytes` (a multiple of page_size) of virtual addresses; nothing is accessible."""

    @abstractmethod
    def free_reservation(self, addr: int, nbytes: int) -> None:
        """Give a reserved range back; it must hold no mapping."""

    @abstractmethod
    def map_handles(self, addr: int, handles: Sequence[PageHandle]) -> None:
        """Map pages back to back from `addr`, not yet accessible (see `set_access`); on failure
        the pages already mapped are unmapped again."""

    @abstractmethod
    def set_access(self, addr: int, nbytes: int) -> None:
        """Make a mapped run readable and writable: one call covers a whole contiguous run."""

    @abstractmethod
    def unmap(self, addr: int, nbytes: int) -> None:
        """Unmap a run; the range stays reserved. Waits for work that may still read it."""

    @abstractmethod
    def copy_page(self, dst: PageHandle, src_addr: int) -> None:
        """Fill physical page `dst` with the page_size bytes currently visible at `src_addr`."""

    @abstractmethod
    def byte_view(self, addr: int, nbytes: int) -> torch.Tensor:
        """A zero-copy uint8 tensor over [addr, addr + nbytes)."""

    def map(self, addr: int, handles: Sequence[PageHandle]) -> None:
        """Map a run of pages and make it accessible with one access call; on failure nothing
        stays mapped."""
        self.map_handles(addr, handles)
        try:
            self.set_access(addr, len(handles) * self.page_size)
        except BaseException:
            self.unmap(addr, len(handles) * self.page_size)
            raise

    def max_mapped_pages(self) -> int | None:
        """How many pages can be mapped at once, if the system bounds it."""
        return None

    def synchronize(self) -> None:
        """Wait until every kernel that may read mapped memory is done (no-op on the host)."""

    def close(self) -> None:
        """Release backend-wide resources; called once, after every page and range is gone."""
