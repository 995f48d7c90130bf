"""The CUDA driver emulator (cuemu.c) for machines without a GPU, and vkv's real CudaBackend
over it.

`load()` compiles cuemu.c with the machine's C compiler (once per session) into a library
named libcuda.so.1 and loads it before any driver call, so cuda-bindings binds to it. The
emulator is a conformance model of the documented VMM API, never a measuring device.

`EmulatedCudaBackend` is CudaBackend with its three torch-CUDA touch points pointed at the
host: device memory is host memory here, so byte views are host tensors over the same
addresses, and waiting for the device is the driver's own `cuCtxSynchronize`. Every driver
call goes through the real code and the real bindings.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from vmm.cuda import CudaBackend, _ok, cu

SOURCE = Path(__file__).parent / "cuemu.c"
_lib: ctypes.CDLL | None = None


class Counts(ctypes.Structure):
    _fields_ = [("allocations", ctypes.c_size_t), ("reservations", ctypes.c_size_t),
                ("mappings", ctypes.c_size_t), ("used_bytes", ctypes.c_size_t), ("context_retains", ctypes.c_int)]


def unavailable_reason() -> str | None:
    if cu is None:
        return "cuda-bindings is not installed"
    if shutil.which(os.environ.get("CC", "cc")) is None:
        return "no C compiler to build the emulator"
    return None


def load() -> ctypes.CDLL:
    """Build and load the emulator as this process's libcuda.so.1 (once)."""
    global _lib
    if _lib is None:
        out = Path(tempfile.mkdtemp(prefix="cuemu-")) / "libcuda.so.1"
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1",
                        "-o", str(out), str(SOURCE), "-lpthread"], check=True, capture_output=True)
        _lib = ctypes.CDLL(str(out), mode=os.RTLD_GLOBAL)
        shutil.rmtree(out.parent, ignore_errors=True)  # (loaded: the mapping outlives the file; no litter in /tmp)
        _lib.cuemu_fail.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    return _lib


def make_backend(page_size: int | None = None, shareable: bool = False) -> CudaBackend:
    """vkv's CudaBackend: over the real driver where there is a GPU, over this emulator where
    there is none."""
    import vmm
    if vmm.cuda_unavailable_reason() is None:
        return CudaBackend(0, page_size, shareable)
    return EmulatedCudaBackend(0, page_size, shareable)


def counts() -> Counts:
    c = Counts()
    load().cuemu_stats(ctypes.byref(c))
    return c


def fail(name: str, nth: int, code: int = 2) -> None:
    """Make the nth next call of `name` fail with `code` (2: CUDA_ERROR_OUT_OF_MEMORY)."""
    load().cuemu_fail(name.encode(), nth, code)


class EmulatedCudaBackend(CudaBackend):
    @staticmethod
    def _unavailable_reason() -> str | None:
        load()
        return None

    def _init_device(self, device: int) -> torch.device:
        return torch.device("cpu")

    def byte_view(self, addr: int, nbytes: int) -> torch.Tensor:
        return torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=torch.uint8)

    def synchronize(self) -> None:
        _ok("cuCtxSynchronize", cu.cuCtxSynchronize())
