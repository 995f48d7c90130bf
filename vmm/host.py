"""Host backend: real shared memory on Linux, with the same semantics as CUDA VMM.

Physical pages are page-sized slots of one `memfd_create` file. Creating a page commits its
slot with `fallocate`; releasing it punches the slot out again. A reservation is an
`mmap(PROT_NONE, MAP_NORESERVE)` range; mapping a page is `mmap(MAP_SHARED|MAP_FIXED)` of its
slot over part of that range, and `mprotect` grants access, mirroring cuMemMap + cuMemSetAccess.
Two mappings of one slot are one physical page: a write through either is seen at both.
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
from vmm.errors import BackendUnavailable, PoolExhausted

PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
MADV_POPULATE_WRITE = 23  # Linux 5.14
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

    def populate(self, addr: int, nbytes: int) -> None:
        self.libc.madvise(addr, nbytes, MADV_POPULATE_WRITE)  # EINVAL before Linux 5.14: faults at first touch

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

