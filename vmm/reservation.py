"""A contiguous virtual range with pool pages mapped into it on demand.

Indices are page numbers inside the range (byte offset = index * page_size). Each mapping of
a page is one reference on it in the pool, so a page mapped into two ranges has a count of 2,
and unmapping or releasing drops exactly the references the range took.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch

from vmm.backend import consecutive_runs
from vmm.errors import (AlreadyMapped, DoubleFree, NotMapped, OutOfRange, PartialUnmap, ReservationReleased,
                        UnmappedAccess)
from vmm.pool import PagePool


class Reservation:
    def __init__(self, pool: PagePool, nbytes: int):
        if nbytes < 1:
            raise ValueError(f"a reservation needs at least one byte, got {nbytes}")
        self.pool = pool
        self.page_size = pool.page_size
        self.num_pages = math.ceil(nbytes / self.page_size)
        self.nbytes = self.num_pages * self.page_size
        self._pages: dict[int, int] = {}
        self.addr = pool.backend.reserve(self.nbytes)
        self._finalizer = weakref.finalize(self, _release, pool, self.addr, self.nbytes, self._pages)

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def offset_of(self, index: int) -> int:
        return index * self.page_size

    def page_at(self, index: int) -> int | None:
        return self._pages.get(index)

    def mapped_pages(self) -> dict[int, int]:
        """{page index: pool page id} of every mapping, as a copy."""
        with self.pool.lock:
            return dict(self._pages)

    def map(self, index: int, page: int) -> None:
        self.map_run(index, [page])

    def map_run(self, index: int, pages: Sequence[int]) -> None:
        """Map pool pages at index, index+1, ... with one access call for the run. The caller
        keeps its own references; the range takes one more on each page."""
        with self.pool.lock:
            self._check_range(index, len(pages))
            taken = [i for i in range(index, index + len(pages)) if i in self._pages]
            if taken:
                raise AlreadyMapped(f"page index {taken[0]} already has page {self._pages[taken[0]]}")
            ids = len(self.pool.ref_counts)  # (a PoolShare's pages are its group pool's: num_pages is its cap)
            outside = [page for page in pages if not 0 <= page < ids]
            if outside:  # a negative id would index another page's count from the end
                raise OutOfRange(f"page {outside[0]} is not a page of the pool: ids are 0..{ids - 1}")
            unheld = [page for page in pages if self.pool.ref_counts[page] == 0]
            if unheld:
                raise DoubleFree(f"page {unheld[0]} is free: take it with alloc() before mapping it")
            handles = [self.pool.handles[page] for page in pages]
            for page in pages:
                self.pool.hold(page)
            try:
                self.pool.backend.map(self.addr + self.offset_of(index), handles)
            except BaseException:
                for page in pages:
                    self.pool.drop(page)
                raise
            self._pages.update(zip(range(index, index + len(pages)), pages))

    def map_new(self, index: int, count: int = 1) -> list[int]:
        """Map `count` fresh pages from the pool; the range holds their only reference."""
        with self.pool.lock:
            self._check_range(index, count)
            pages = self.pool.alloc_many(count)
            try:
                self.map_run(index, pages)
            finally:
                for page in pages:
                    self.pool.drop(page)
            return pages

    def share(self, source: Reservation, src_index: int, dst_index: int, count: int = 1) -> None:
        """Map the pages that `source` has at src_index.. at dst_index.. here too."""
        with self.pool.lock:
            source._check_range(src_index, count)
            pages = [source._mapped(i) for i in range(src_index, src_index + count)]
            self.map_run(dst_index, pages)

    def unmap(self, index: int, count: int = 1) -> None:
        with self.pool.lock:
            self._check_range(index, count)
            pages = [self._mapped(i) for i in range(index, index + count)]
            try:
                self.pool.backend.unmap(self.addr + self.offset_of(index), count * self.page_size)
            except PartialUnmap as exc:  # the bookkeeping follows the driver: the first `done` went
                self._forget(index, pages[:exc.done])
                raise
            self._forget(index, pages)

    def _forget(self, index: int, pages: list[int]) -> None:
        for i in range(index, index + len(pages)):
            del self._pages[i]
        self.pool.drop_many(pages)

    def copy_on_write(self, index: int) -> int:
        """Make the page at index private: if others map it too, put a copy of its bytes in a
        fresh page here. Returns the page now mapped at index. On failure the original page
        stays mapped and no page is leaked."""
        with self.pool.lock:
            self._check_range(index, 1)
            page = self._mapped(index)
            if self.pool.ref_counts[page] == 1:
                return page
            copy = self.pool.alloc()
            addr = self.addr + self.offset_of(index)
            backend = self.pool.backend
            try:
                backend.copy_page(self.pool.handles[copy], addr)
                backend.unmap(addr, self.page_size)
            except BaseException:
                self.pool.drop(copy)  # the original stays where it was
                raise
            try:
                backend.map(addr, [self.pool.handles[copy]])
            except BaseException:
                backend.map(addr, [self.pool.handles[page]])  # put the original back
                self.pool.drop(copy)
                raise
            self._pages[index] = copy  # the alloc reference becomes the mapping's
            self.pool.drop(page)
            return copy

    def view(self, dtype: torch.dtype, shape: Sequence[int], strides: Sequence[int] | None = None,
             offset: int = 0, check: bool = False) -> torch.Tensor:
        """A zero-copy tensor over the range. `offset` is in bytes; strides in elements.
        With check=True every page the view spans must be mapped."""
        if self.released:
            raise ReservationReleased("the reservation was already released")
        itemsize = torch.empty((), dtype=dtype).element_size()
        strides = tuple(strides) if strides is not None else _contiguous_strides(shape)
        if offset % itemsize:
            raise ValueError(f"offset {offset} is not a multiple of the item size {itemsize}")
        span = itemsize * (1 + sum((n - 1) * s for n, s in zip(shape, strides))) if all(shape) else 0
        if offset < 0 or offset + span > self.nbytes or min(strides, default=0) < 0:
            raise OutOfRange(f"view of {span} bytes at offset {offset} exceeds {self.nbytes} bytes")
        if check and span:
            first, last = offset // self.page_size, (offset + span - 1) // self.page_size
            missing = [i for i in range(first, last + 1) if i not in self._pages]
            if missing:
                raise UnmappedAccess(f"the view spans page indices {missing[:8]} that are unmapped")
        whole = self.pool.backend.byte_view(self.addr, self.nbytes).view(dtype)
        return whole.as_strided(tuple(shape), strides, offset // itemsize)

    def release(self) -> None:
        """Unmap everything, drop this range's references and give the addresses back. If the
        backend fails part way, what it unmapped is given back to the pool, the rest stays
        mapped, and release() can be called again."""
        if self.released:
            raise ReservationReleased("the reservation was already released")
        _release(self.pool, self.addr, self.nbytes, self._pages)
        self._finalizer.detach()

    def _mapped(self, index: int) -> int:
        if index not in self._pages:
            raise NotMapped(f"page index {index} has no page mapped")
        return self._pages[index]

    def _check_range(self, index: int, count: int) -> None:
        if self.released:
            raise ReservationReleased("the reservation was already released")
        if count < 1 or index < 0 or index + count > self.num_pages:
            raise OutOfRange(f"page indices [{index}, {index + count}) outside [0, {self.num_pages})")


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _release(pool: PagePool, addr: int, nbytes: int, pages: dict[int, int]) -> None:
    """Unmap run by run, each run's references dropped as soon as the backend has unmapped it
    (so a failure part way leaves `pages` exactly what is still mapped), then free the range."""
    with pool.lock:
        for index, count in consecutive_runs(sorted(pages)):
            try:
                pool.backend.unmap(addr + index * pool.page_size, count * pool.page_size)
            except PartialUnmap as exc:  # the first `done` of the run went
                pool.drop_many([pages.pop(i) for i in range(index, index + exc.done)])
                raise
            pool.drop_many([pages.pop(i) for i in range(index, index + count)])
        pool.backend.free_reservation(addr, nbytes)

