"""Host backends: real shared memory on Linux, with the same semantics as CUDA VMM; and private
memory for a range mapped once for its life.

Physical pages are page-sized slots of one `memfd_create` file. Creating a page commits its
slot with `fallocate`; releasing it punches the slot out again. A reservation is an
`mmap(PROT_NONE, MAP_NORESERVE)` range; mapping a page is `mmap(MAP_SHARED|MAP_FIXED)` of its
slot over part of that range, and `mprotect` grants access, mirroring cuMemMap + cuMemSetAccess.
Two mappings of one slot are one physical page: a write through either is seen at both.

`PrivateHostBackend` is for a range whose pages are each mapped in one place for their life and
never shared (the model's weights in sleep mode, engine/models/weight_pages.py): its pages are
private anonymous memory, which the kernel backs with 2 MiB pages where asked (transparent huge
pages are usually `madvise` for anonymous memory and `never` for shared memory). Its price: a
page's bytes live in its mapping, not in its handle, so unmapping discards them, a handle is
mapped in one place at a time (refused otherwise) and nothing is copied into a page.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import weakref
from collections.abc import Sequence

import torch

from vmm.backend import Backend, consecutive_runs
from vmm.errors import AlreadyMapped, BackendUnavailable, PoolExhausted, VmmError

PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MADV_HUGEPAGE = 14
THP = "/sys/kernel/mm/transparent_hugepage/enabled"
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
MAP_FAILED = ctypes.c_void_p(-1).value
MIN_PAGE_SIZE = 4096


def _load_libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


class HostBackend(Backend):
    name = "host"
    device = torch.device("cpu")

    def __init__(self, page_size: int = 2 << 20):
        if not hasattr(os, "memfd_create"):
            raise BackendUnavailable("the host backend needs Linux memfd_create")
        if page_size < MIN_PAGE_SIZE or page_size % mmap.PAGESIZE:
            raise ValueError(f"page_size must be >= {MIN_PAGE_SIZE} and a multiple of the OS page "
                             f"({mmap.PAGESIZE}), got {page_size}")
        self.page_size = page_size
        self.libc = _load_libc()
        self.fd = os.memfd_create("vkv-pages", os.MFD_CLOEXEC)
        self._free_slots: list[int] = []
        self._next_slot = 0
        self.attached = False  # True: the pages are another process's (vmm/owner.py)
        self._finalizer = weakref.finalize(self, os.close, self.fd)

    @classmethod
    def attach(cls, fd: int, page_size: int) -> HostBackend:
        """The pages of another process's pool (its memfd, received over a Unix socket): this
        process maps, copies and views them; only their owner creates and releases them."""
        backend = cls(page_size)
        os.close(backend.fd)
        backend._finalizer.detach()
        backend.fd, backend.attached = fd, True
        backend._finalizer = weakref.finalize(backend, os.close, fd)
        return backend

    def create_page(self) -> int:
        if self.attached:
            raise RuntimeError("an attached backend's pages are created by the pool's owner")
        slot = self._free_slots.pop() if self._free_slots else self._next_slot
        if slot == self._next_slot:
            self._next_slot += 1
        if self.libc.fallocate(self.fd, 0, slot * self.page_size, self.page_size) != 0:
            self._free_slots.append(slot)
            raise PoolExhausted(f"cannot commit a {self.page_size}-byte host page: "
                                f"{os.strerror(ctypes.get_errno())}")
        return slot

    def release_page(self, handle: int) -> None:
        if self.attached:
            raise RuntimeError("an attached backend's pages are released by the pool's owner")
        mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        _check(self.libc.fallocate(self.fd, mode, handle * self.page_size, self.page_size),
               "fallocate(PUNCH_HOLE)")
        self._free_slots.append(handle)

    def reserve(self, nbytes: int) -> int:
        addr = self.libc.mmap(None, nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                              -1, 0)
        if addr in (None, MAP_FAILED):
            raise MemoryError(f"cannot reserve {nbytes} bytes of address space: "
                              f"{os.strerror(ctypes.get_errno())}")
        return addr

    def free_reservation(self, addr: int, nbytes: int) -> None:
        _check(self.libc.munmap(addr, nbytes), "munmap")

    def map_handles(self, addr: int, handles: Sequence[int]) -> None:
        done = 0
        for start, count in consecutive_runs(handles):
            got = self.libc.mmap(addr + done, count * self.page_size, PROT_NONE, MAP_SHARED | MAP_FIXED,
                                 self.fd, start * self.page_size)
            if got != addr + done:
                if done:
                    self.unmap(addr, done)
                raise OSError(ctypes.get_errno(), f"mmap(MAP_FIXED) of page slot {start} failed")
            done += count * self.page_size

    def set_access(self, addr: int, nbytes: int) -> None:
        _check(self.libc.mprotect(addr, nbytes, PROT_READ | PROT_WRITE), "mprotect")

    def unmap(self, addr: int, nbytes: int) -> None:
        flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED
        if self.libc.mmap(addr, nbytes, PROT_NONE, flags, -1, 0) != addr:
            raise OSError(ctypes.get_errno(), "mmap(PROT_NONE) over a mapped run failed")

    def copy_page(self, dst: int, src_addr: int) -> None:
        src = (ctypes.c_char * self.page_size).from_address(src_addr)
        written = os.pwrite(self.fd, src, dst * self.page_size)
        if written != self.page_size:
            raise OSError(f"short page copy: {written} of {self.page_size} bytes")

    def byte_view(self, addr: int, nbytes: int) -> torch.Tensor:
        return torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=torch.uint8)

    def max_mapped_pages(self) -> int | None:
        """Each mapped page is its own memory area, and so may the gap after it be: Linux allows
        vm.max_map_count areas per process (65,530 by default)."""
        try:
            with open("/proc/sys/vm/max_map_count") as f:
                return int(f.read()) // 2 - 1024
        except OSError:
            return None

    def close(self) -> None:
        self._finalizer()



def thp_mode() -> str:
    """The kernel's transparent huge page mode for anonymous memory: always, madvise, never, or
    unknown."""
    try:
        with open(THP) as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


def resident_bytes(addr: int, nbytes: int) -> int:
    """How much of [addr, addr + nbytes) (OS-page aligned, reserved by this process) is backed by
    memory now, by mincore."""
    libc = _load_libc()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = -(-nbytes // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    _check(libc.mincore(addr, nbytes, vec), "mincore")
    return sum(b & 1 for b in vec.raw) * mmap.PAGESIZE


class PrivateHostBackend(Backend):
    """Pages of private anonymous memory on 2 MiB transparent huge pages where the kernel allows
    (see the module's note: a handle's bytes live in its one mapping)."""
    name = "host-private"
    device = torch.device("cpu")

    def __init__(self, page_size: int = 2 << 20):
        if page_size < MIN_PAGE_SIZE or page_size % mmap.PAGESIZE:
            raise ValueError(f"page_size must be >= {MIN_PAGE_SIZE} and a multiple of the OS page "
                             f"({mmap.PAGESIZE}), got {page_size}")
        self.page_size, self.libc = page_size, _load_libc()
        self.huge = thp_mode() in ("always", "madvise")
        self._next = 0
        self._at: dict[int, int] = {}  # the address each mapped handle is at, by handle
        self._reserved: dict[int, tuple[int, int]] = {}  # the whole mmap behind each aligned reservation

    def create_page(self) -> int:
        """A handle only: the memory comes with its mapping."""
        self._next += 1
        return self._next - 1

    def release_page(self, handle: int) -> None:
        if handle in self._at:
            raise VmmError(f"page {handle} is still mapped at {self._at[handle]:#x}")

    def reserve(self, nbytes: int) -> int:
        """A range aligned to 2 MiB, so that huge pages fit it."""
        align = max(self.page_size, 2 << 20)
        whole = nbytes + align
        addr = self.libc.mmap(None, whole, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if addr in (None, MAP_FAILED):
            raise MemoryError(f"cannot reserve {nbytes} bytes of address space: "
                              f"{os.strerror(ctypes.get_errno())}")
        start = -(-addr // align) * align
        self._reserved[start] = (addr, whole)
        return start

    def free_reservation(self, addr: int, nbytes: int) -> None:
        whole_addr, whole = self._reserved.pop(addr, (addr, nbytes))
        _check(self.libc.munmap(whole_addr, whole), "munmap")

    def map_handles(self, addr: int, handles: Sequence[int]) -> None:
        """Fresh private memory at addr (zero at first touch), advised onto huge pages."""
        twice = [h for h in handles if h in self._at]
        if twice or len(set(handles)) != len(handles):
            raise AlreadyMapped(f"private host pages are mapped in one place at a time: {twice or handles}")
        nbytes = len(handles) * self.page_size
        if self.libc.mmap(addr, nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != addr:
            raise OSError(ctypes.get_errno(), "mmap(MAP_FIXED) of private pages failed")
        if self.huge:
            self.libc.madvise(addr, nbytes, MADV_HUGEPAGE)  # a hint: refused, the pages are 4 KiB
        for i, handle in enumerate(handles):
            self._at[handle] = addr + i * self.page_size

    def set_access(self, addr: int, nbytes: int) -> None:
        """(Under strict overcommit the memory is committed here: no room is an OSError, not a
        crash at first touch.)"""
        _check(self.libc.mprotect(addr, nbytes, PROT_READ | PROT_WRITE), "mprotect")

    def unmap(self, addr: int, nbytes: int) -> None:
        """The pages' memory goes back to the system with them."""
        flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED
        if self.libc.mmap(addr, nbytes, PROT_NONE, flags, -1, 0) != addr:
            raise OSError(ctypes.get_errno(), "mmap(PROT_NONE) over a mapped run failed")
        end = addr + nbytes
        for handle in [h for h, at in self._at.items() if addr <= at < end]:
            del self._at[handle]

    def copy_page(self, dst: int, src_addr: int) -> None:
        raise VmmError("a private host page's bytes live in its mapping: nothing is copied into one "
                       "(copy-on-write, swap and sharing need the shared host backend)")

    def byte_view(self, addr: int, nbytes: int) -> torch.Tensor:
        return torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=torch.uint8)
