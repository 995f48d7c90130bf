"""CUDA backend: the driver's virtual memory management API through `cuda.bindings.driver`.

Physical pages come from `cuMemCreate` (8.9 us for 2 MiB on an H100, the CUDA driver 580;
pools create them once, up front, so a step never waits for one); ranges from
`cuMemAddressReserve`, aligned to the allocation granularity; `cuMemMap` puts a page at an
address and `cuMemSetAccess` makes a whole contiguous run readable and writable in one call.
Unmapping is one `cuMemUnmap` per page mapped (the documentation promises a call only for "the
entire contiguous address range that was mapped"), after waiting for the device. Every operation undoes what it did before it raises.

Driver calls act on the calling thread's current context. The backend retains the device's
primary context (the one PyTorch uses) and makes it current in any thread before its first
driver call there, so a worker thread that has run no CUDA code yet can map pages; the
context is released at `close()`.

The torch side (making the device current, tensors over device addresses, waiting for
kernels) is confined to `_init_device`, `byte_view` and `synchronize`, so the same driver
code runs against the driver emulator of the test suite with host tensors. Importing this
module never needs a GPU: `CudaBackend()` raises `BackendUnavailable` with the reason instead.

Pages for other processes (vmm/owner.py). `CudaBackend(shareable=True)` asks for
`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` at `cuMemCreate` (a page created without it cannot be
exported); `export_page` gives a file descriptor for one page (`cuMemExportToShareableHandle`),
which travels over a Unix socket; `import_page` in the other process turns it into a handle of
that process's own (`cuMemImportFromShareableHandle`), which it maps into its own reservations,
grants its own access to, and releases itself with `release_page`. The physical page lives until
every handle in every process is released and every mapping unmapped.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from vmm.backend import Backend
from vmm.errors import BackendUnavailable, PartialUnmap, PoolExhausted, VmmError

try:
    from cuda.bindings import driver as cu
except ImportError as exc:  # cuda-bindings is the optional extra `vkv[cuda]`
    cu = None
    _IMPORT_ERROR = f"cuda-bindings is not installed ({exc}); pip install 'vkv[cuda]'"
else:
    POSIX_FD = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


class CudaDriverError(VmmError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


def _ok(what: str, result: tuple):
    err, *values = result
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise PoolExhausted(f"{what}: the GPU is out of memory")
        raise CudaDriverError(f"{what} failed: {name.decode() if name else int(err)}")
    return values[0] if len(values) == 1 else None


def unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run here, or None when it can."""
    if cu is None:
        return _IMPORT_ERROR
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA GPU (CPU build of torch, no driver, or no device)"
    return None


class _DeviceBytes:
    """The smallest object with `__cuda_array_interface__`: torch wraps it without copying."""

    def __init__(self, addr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (addr, False), "version": 3, "strides": None}


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, device: int = 0, page_size: int | None = None, shareable: bool = False):
        reason = self._unavailable_reason()
        if reason:
            raise BackendUnavailable(reason)
        self.shareable = shareable  # pages created for export to other processes
        self.device = self._init_device(device)
        self._current = threading.local()
        self._views_by_storage = False  # byte_view's fallback, taken once as_tensor has refused
        _ok("cuInit", cu.cuInit(0))
        self.cu_device = _ok("cuDeviceGet", cu.cuDeviceGet(device))
        self.context = _ok("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(self.cu_device))
        self._scratch = 0
        try:
            self._setup(device, page_size)
        except BaseException:  # undo the retain: a failed construction leaks no context
            if self._scratch:
                self.free_reservation(self._scratch, self.page_size)
            self._release_context()
            raise

    def _setup(self, device: int, page_size: int | None) -> None:
        self._in_context()
        self.prop = cu.CUmemAllocationProp()
        self.prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = device
        if self.shareable:
            self.prop.requestedHandleTypes = POSIX_FD
        self.access = cu.CUmemAccessDesc()
        self.access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.access.location.id = device
        self.access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.granularity = int(_ok("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(
            self.prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
        self.page_size = page_size or self.granularity
        if self.page_size % self.granularity:
            raise ValueError(f"page_size must be a multiple of the granularity {self.granularity}")
        self._scratch = self.reserve(self.page_size)

    # -- the torch side: what the emulated backend of the tests replaces -------------------
    @staticmethod
    def _unavailable_reason() -> str | None:
        return unavailable_reason()

    def _init_device(self, device: int) -> torch.device:
        """Make PyTorch's primary context exist (driver calls need it) on `device`."""
        dev = torch.device("cuda", device)
        torch.cuda.set_device(dev)
        torch.zeros(1, device=dev)
        return dev

    def byte_view(self, addr: int, nbytes: int) -> torch.Tensor:
        if not self._views_by_storage:
            try:
                return torch.as_tensor(_DeviceBytes(addr, nbytes), device=self.device)
            except RuntimeError:  # a torch that asks the driver who owns the (still unmapped) range
                self._views_by_storage = True  # from now on, without asking again
        # a storage over the address on our device, which asks the driver nothing (torch >= 2.1)
        storage = torch._C._construct_storage_from_data_pointer(addr, self.device, nbytes)
        return torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, 0, (nbytes,), (1,))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    # -- the driver ------------------------------------------------------------------------
    def _in_context(self) -> None:
        """Make the primary context current in this thread, once per thread."""
        if getattr(self._current, "set", False):
            return
        if int(_ok("cuCtxGetCurrent", cu.cuCtxGetCurrent())) != int(self.context):
            _ok("cuCtxSetCurrent", cu.cuCtxSetCurrent(self.context))
        self._current.set = True

    def create_page(self):
        self._in_context()
        return _ok("cuMemCreate", cu.cuMemCreate(self.page_size, self.prop, 0))

    def release_page(self, handle) -> None:
        self._in_context()
        _ok("cuMemRelease", cu.cuMemRelease(handle))

    def export_page(self, handle) -> int:
        """A new file descriptor for a page of a shareable backend (the caller closes it)."""
        self._in_context()
        return int(_ok("cuMemExportToShareableHandle", cu.cuMemExportToShareableHandle(handle, POSIX_FD, 0)))

    def import_page(self, fd: int):
        """This process's handle to a page another process exported (release it with release_page;
        the descriptor may be closed at once)."""
        self._in_context()
        return _ok("cuMemImportFromShareableHandle", cu.cuMemImportFromShareableHandle(fd, POSIX_FD))

    def reserve(self, nbytes: int) -> int:
        self._in_context()
        return int(_ok("cuMemAddressReserve", cu.cuMemAddressReserve(nbytes, self.granularity, 0, 0)))

    def free_reservation(self, addr: int, nbytes: int) -> None:
        self._in_context()
        _ok("cuMemAddressFree", cu.cuMemAddressFree(addr, nbytes))

    def map_handles(self, addr: int, handles: Sequence) -> None:
        self._in_context()
        for i, handle in enumerate(handles):
            try:
                _ok("cuMemMap", cu.cuMemMap(addr + i * self.page_size, self.page_size, 0, handle, 0))
            except BaseException:
                self._unmap_pages(addr, i)  # undo the pages already mapped
                raise

    def set_access(self, addr: int, nbytes: int) -> None:
        self._in_context()
        _ok("cuMemSetAccess", cu.cuMemSetAccess(addr, nbytes, [self.access], 1))

    def unmap(self, addr: int, nbytes: int) -> None:
        self._in_context()
        self.synchronize()  # a kernel still reading the run would fault after cuMemUnmap
        self._unmap_pages(addr, nbytes // self.page_size)

    def _unmap_pages(self, addr: int, count: int) -> None:
        """Page by page (a mapping is unmapped whole); a failure says how many went."""
        for i in range(count):
            try:
                _ok("cuMemUnmap", cu.cuMemUnmap(addr + i * self.page_size, self.page_size))
            except VmmError as exc:
                raise PartialUnmap(f"{exc} (after {i} of {count} pages)", i) from exc

    def copy_page(self, dst, src_addr: int) -> None:
        self.map(self._scratch, [dst])
        try:
            self.byte_view(self._scratch, self.page_size).copy_(self.byte_view(src_addr, self.page_size))
        finally:
            self.unmap(self._scratch, self.page_size)

    def close(self) -> None:
        if self._scratch:
            self.free_reservation(self._scratch, self.page_size)
            self._scratch = 0
            self._release_context()

    def _release_context(self) -> None:
        _ok("cuDevicePrimaryCtxRelease", cu.cuDevicePrimaryCtxRelease(self.cu_device))
