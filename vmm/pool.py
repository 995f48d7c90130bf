"""The physical page pool: every page created up front, then handed out and taken back; after a
sleep (`release_memory`), each is created again when it is first taken.

A page is either free (in `free_ids`, reference count 0) or referenced. Its reference count is
the number of mappings of it plus the explicit holds on it (`alloc` and `hold` each take one).
Free pages wait in a FIFO deque, so alloc and the last drop are O(1).

Three classes are pools to reservations and KV caches, declared by the `Pool` protocol below:
`PagePool` (the pages themselves), `PoolShare` (one tenant's part of a pool several models draw
from, vmm/share.py) and `AttachedPool` (a pool another process owns, vmm/attach.py).
"""
from __future__ import annotations

import threading
import weakref
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from vmm.backend import Backend
from vmm.errors import DoubleFree, InvariantViolation, NoMemory, OutOfRange, PoolExhausted


@dataclass(frozen=True, slots=True)
class PoolStats:
    page_size: int
    total: int
    free: int
    in_use: int
    shared: int
    peak_in_use: int
    asleep: bool = False  # every physical page given back: none in use, none free


class Pool(Protocol):
    """What reservations and KV caches use of a pool, whichever of the three it is."""
    page_size: int
    backend: Backend
    handles: list  # the backend's handle of each page, by id (a PagePool's: None until first taken after a wake)
    ref_counts: list[int]  # (a sequence) each page's references, by id
    lock: threading.RLock  # taken by every call that changes the pool or its mappings

    @property
    def num_pages(self) -> int: ...
    @property
    def most_pages(self) -> int: ...  # the most this user can ever hold (a share's cap, less others' floors)
    @property
    def num_free(self) -> int: ...  # obtainable now without reclaiming anything
    def alloc(self) -> int: ...
    def alloc_many(self, n: int) -> list[int]: ...
    def hold(self, page: int) -> None: ...
    def drop(self, page: int) -> bool: ...  # True when that was the last reference
    def drop_many(self, pages) -> None: ...
    def own_refs(self, page: int) -> int: ...  # references this process holds
    def borrow(self, need: int) -> None: ...  # ask whoever shares the pool for room (no-op alone)
    def borrowable(self) -> int: ...
    def stats(self) -> PoolStats: ...
    def check(self, expected: Mapping[int, int]) -> None: ...
    def audit(self, reservations: Iterable, held: Mapping[int, int] = ...) -> None: ...
    def release_memory(self) -> None: ...
    def restore_memory(self) -> None: ...
    def close(self) -> None: ...


class PageAllocator:
    """Page ids 0..N-1 with reference counts and an O(1) FIFO free queue; no memory of its own.
    `PagePool` puts physical pages behind the ids; the block-table KV cache uses it as is.
    Thread-safe: every method runs under `self.lock`."""

    asleep = False  # a PagePool's release_memory() has given every physical page back

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.page_size = page_size
        self.lock = threading.RLock()
        self.ref_counts = [0] * num_pages
        self.free_ids: deque[int] = deque(range(num_pages))
        self.peak_in_use = 0

    @property
    def num_pages(self) -> int:
        return len(self.ref_counts)

    @property
    def most_pages(self) -> int:
        """The most pages one user can ever hold at once (a PoolShare: fewer)."""
        return self.num_pages

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def alloc(self) -> int:
        """Take a free page; the caller holds its one reference."""
        with self.lock:
            if not self.free_ids:
                raise PoolExhausted(f"all {self.num_pages} pages of {self.page_size} bytes are in use")
            page = self.free_ids.popleft()
            self.ref_counts[page] = 1
            self.peak_in_use = max(self.peak_in_use, self.num_pages - len(self.free_ids))
            return page

    def alloc_many(self, n: int) -> list[int]:
        """Take n pages, all or none."""
        with self.lock:
            if n > len(self.free_ids):
                raise PoolExhausted(f"need {n} pages, {len(self.free_ids)} of {self.num_pages} free")
            pages: list[int] = []
            try:
                for _ in range(n):
                    pages.append(self.alloc())
            except BaseException:  # (NoMemory: a PagePool that cannot create a page after a wake)
                for page in pages:
                    self.drop(page)
                raise
            return pages

    def _check_id(self, page: int) -> None:
        if not 0 <= page < len(self.ref_counts):  # a negative id would index from the end
            raise OutOfRange(f"page {page} is not a page of this pool: ids are 0..{self.num_pages - 1}")

    def hold(self, page: int) -> None:
        """Add a reference to a page that already has one."""
        with self.lock:
            self._check_id(page)
            if self.ref_counts[page] == 0:
                raise DoubleFree(f"page {page} is free: take it with alloc(), not hold()")
            self.ref_counts[page] += 1

    def drop(self, page: int) -> bool:
        """Drop one reference; returns True when that freed the page."""
        with self.lock:
            self._check_id(page)
            if self.ref_counts[page] == 0:
                raise DoubleFree(f"page {page} is already free")
            self.ref_counts[page] -= 1
            if self.ref_counts[page]:
                return False
            self.free_ids.append(page)
            return True

    def drop_many(self, pages) -> None:
        """Drop one reference on each (a pool another process owns tells it once for all)."""
        with self.lock:
            for page in pages:
                self.drop(page)

    def own_refs(self, page: int) -> int:
        """The references this process holds on a page (all of them: the pool is this process's)."""
        return self.ref_counts[page]

    def borrow(self, need: int) -> None:
        """Ask other tenants for pages (a `vmm.PoolShare`); a pool of one's own has none to ask."""

    def borrowable(self) -> int:
        """Pages other tenants could give back now (none: see `vmm.PoolShare`)."""
        return 0

    def stats(self) -> PoolStats:
        with self.lock:
            in_use = 0 if self.asleep else self.num_pages - len(self.free_ids)
            shared = sum(1 for count in self.ref_counts if count > 1)
            return PoolStats(self.page_size, self.num_pages, len(self.free_ids), in_use, shared,
                             self.peak_in_use, self.asleep)

    def check(self, expected: Mapping[int, int]) -> None:
        """Every page is free xor referenced, and its count equals `expected[page]` (the
        references its owners say they hold)."""
        with self.lock:
            free = set(self.free_ids)
            if len(free) != len(self.free_ids):
                raise InvariantViolation("a page is in the free list twice")
            for page, count in enumerate(self.ref_counts):
                if count != expected.get(page, 0):
                    raise InvariantViolation(f"page {page}: ref count {count}, "
                                             f"its owners hold {expected.get(page, 0)}")
                if (count == 0) != (page in free):
                    raise InvariantViolation(f"page {page}: ref count {count} but "
                                             f"{'in' if page in free else 'not in'} the free list")


class PagePool(PageAllocator):
    """Physical pages from a backend behind the allocator's ids, all created up front (after a
    wake: at first `alloc`)."""

    def __init__(self, backend: Backend, num_pages: int):
        limit = backend.max_mapped_pages()
        if limit is not None and num_pages > limit:
            raise ValueError(f"{num_pages} pages of {backend.page_size} bytes exceed the {limit} the "
                             f"{backend.name} backend can map at once: use larger pages or fewer")
        super().__init__(num_pages, backend.page_size)
        self.backend = backend
        self.handles = []
        self._finalizer = weakref.finalize(self, _release_all, backend, self.handles)
        for _ in range(num_pages):
            self.handles.append(backend.create_page())

    def release_memory(self) -> None:
        """Sleep: give every physical page back to the system while every reservation (and
        every view of one) stays valid. All pages must be free; nothing can be mapped until
        `restore_memory`."""
        with self.lock:
            if not self.asleep and self.num_free != self.num_pages:
                raise InvariantViolation(f"{self.num_pages - self.num_free} pages are still referenced: "
                                         f"unmap them before releasing the pool's memory")
            self.free_ids.clear()  # alloc() finds nothing while asleep
            self.asleep = True  # from here on: a failure part way leaves an asleep pool (retry or wake)
            _release_all(self.backend, self.handles)

    def restore_memory(self) -> None:
        """Wake: nothing is created now; each page is created when `alloc` first takes it (its
        contents undefined, as a new page's are), so waking costs nothing and a KV cache pays
        for the pages its requests use, when they use them."""
        with self.lock:
            if not self.asleep:
                return
            _release_all(self.backend, self.handles)  # what a failed release_memory left
            self.handles.extend([None] * self.num_pages)
            self.free_ids.extend(range(self.num_pages))
            self.asleep = False

    def alloc(self) -> int:
        """Take a free page; the caller holds its one reference. A page not created since the
        pool woke is created now (NoMemory if the system has none for it)."""
        with self.lock:
            page = super().alloc()
            if self.handles[page] is None:
                try:
                    self.handles[page] = self.backend.create_page()
                except BaseException as exc:
                    super().drop(page)
                    if isinstance(exc, PoolExhausted):  # (the host backend's word for a failed commit)
                        raise NoMemory(f"cannot create page {page} of a woken pool: {exc}") from exc
                    raise
            return page

    def audit(self, reservations: Iterable, held: Mapping[int, int] = {}) -> None:
        """Each page's count equals its mappings in `reservations` plus its holds in `held`."""
        with self.lock:
            if self.asleep:
                if any(self.ref_counts) or held or any(r.mapped_pages() for r in reservations):
                    raise InvariantViolation("the pool is asleep, yet a page is referenced")
                return
            self.check(expected_refs(reservations, held))

    def close(self) -> None:
        """Release every physical page. Reservations must be released first."""
        self._finalizer()


def expected_refs(reservations: Iterable, held: Mapping[int, int]) -> Counter:
    """The references the owners of pages say they hold: one per mapping in `reservations`,
    plus `held` (what every pool's audit checks its counts against)."""
    expected = Counter(held)
    for reservation in reservations:
        expected.update(reservation.mapped_pages().values())
    return expected


def _release_all(backend: Backend, handles: list) -> None:
    """Release from the end, each handle forgotten once it is released (a retry goes on); a page
    not created since a wake (None) has nothing to release."""
    while handles:
        if handles[-1] is not None:
            backend.release_page(handles[-1])
        handles.pop()
