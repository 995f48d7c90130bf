"""CUDA backend: the driver's virtual memory management API through `cuda.bindings.driver`.

Physical pages come from `cuMemCreate` (about 200 us each, so pools create them once, up
front); ranges from `cuMemAddressReserve`; `cuMemMap` puts a page at an address and
`cuMemSetAccess` makes a whole contiguous run readable and writable in one call. PyTorch's
context must exist before any driver call, so the backend initialises it first.
Importing this module never needs a GPU: `CudaBackend()` raises `BackendUnavailable` with the
reason instead.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from vmm.backend import Backend
from vmm.errors import BackendUnavailable, PoolExhausted, VmmError

try:
    from cuda.bindings import driver as cu
except ImportError as exc:  # cuda-python is the optional extra `vkv[cuda]`
    cu = None
    _IMPORT_ERROR = f"cuda-python is not installed ({exc}); pip install 'vkv[cuda]'"


class CudaDriverError(VmmError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


def _ok(what: str, result: tuple):
    err, *values = result
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise PoolExhausted(f"{what}: the GPU is out of memory")
        raise CudaDriverError(f"{what} failed: {name.decode() if name else err}")
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

    def __init__(self, device: int = 0, page_size: int | None = None):
        reason = unavailable_reason()
        if reason:
            raise BackendUnavailable(reason)
        self.device = torch.device("cuda", device)
        torch.cuda.set_device(self.device)
        torch.zeros(1, device=self.device)  # PyTorch's primary context becomes current
        _ok("cuInit", cu.cuInit(0))
        self.prop = cu.CUmemAllocationProp()
        self.prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = device
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

    def create_page(self):
        return _ok("cuMemCreate", cu.cuMemCreate(self.page_size, self.prop, 0))

    def release_page(self, handle) -> None:
        _ok("cuMemRelease", cu.cuMemRelease(handle))

    def reserve(self, nbytes: int) -> int:
        return int(_ok("cuMemAddressReserve", cu.cuMemAddressReserve(nbytes, self.page_size, 0, 0)))

    def free_reservation(self, addr: int, nbytes: int) -> None:
        _ok("cuMemAddressFree", cu.cuMemAddressFree(addr, nbytes))

    def map_handles(self, addr: int, handles: Sequence) -> None:
        for i, handle in enumerate(handles):
            _ok("cuMemMap", cu.cuMemMap(addr + i * self.page_size, self.page_size, 0, handle, 0))

    def set_access(self, addr: int, nbytes: int) -> None:
        _ok("cuMemSetAccess", cu.cuMemSetAccess(addr, nbytes, [self.access], 1))

    def unmap(self, addr: int, nbytes: int) -> None:
        self.synchronize()  # a kernel still reading the run would fault after cuMemUnmap
        _ok("cuMemUnmap", cu.cuMemUnmap(addr, nbytes))

    def copy_page(self, dst, src_addr: int) -> None:
        self.map(self._scratch, [dst])
        self.byte_view(self._scratch, self.page_size).copy_(self.byte_view(src_addr, self.page_size))
        self.unmap(self._scratch, self.page_size)

    def byte_view(self, addr: int, nbytes: int) -> torch.Tensor:
        return torch.as_tensor(_DeviceBytes(addr, nbytes), device=self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        if self._scratch:
            self.free_reservation(self._scratch, self.page_size)
            self._scratch = 0
