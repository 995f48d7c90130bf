"""The GEMM panels on transparent huge pages.

Note [Panels on huge pages]
---------------------------
Rationale. A decode step streams every panel once (540 MB a token for the bundled model in
fp32, 270 MB in bf16). On 4 KiB pages that is one TLB entry, and one page walk, per 4 KiB
read: 132,000 a token in fp32, far beyond the TLB. The kernel gives an anonymous range 2 MiB
pages only where asked (`transparent_hugepage/enabled` is usually `madvise`), and torch's
allocator never asks (measured: benchmarks/results/cpu/design_choices.json, "huge_pages").

Approach. After packing, every panel moves into one arena whose 2 MiB-aligned span is advised
`MADV_HUGEPAGE` before a byte of it is touched, so its first writes fault in huge pages.
Each panel keeps its Python object (its storage is `set_` to its slice of the arena), so
whoever holds it (the one-call decode path's lists, `Linear.assign`) holds valid memory.

Implementation. `onto_huge_pages` lays the panels out at 64-byte offsets, allocates the arena
(torch's CPU allocator; untouched memory costs nothing), advises the aligned span, then copies
panel by panel, each old storage freed as its panel moves (the peak is the arena plus one panel).
Who writes what: the model's `prepare` calls it once, before sleep mode moves the weights.

Limitations. Where the kernel has THP off (`never`), refuses the advice or the arena cannot be
allocated, the panels stay where they are and the returned line says why. Sleep mode then moves
every weight into pages of its own, advised the same way (vmm's `PrivateHostBackend`). The kernel may still back
part of the span with 4 KiB pages (fragmented memory); `AnonHugePages` in /proc/self/smaps says.
"""
from __future__ import annotations

import ctypes
import ctypes.util

import torch

from vmm.host import MADV_HUGEPAGE, thp_mode

HUGE = 2 << 20


def onto_huge_pages(tensors: list[torch.Tensor]) -> str:
    """Move the CPU tensors into one arena advised onto 2 MiB pages, in place; what was done."""
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in tensors), "contiguous CPU tensors"
    mode = thp_mode()
    if mode not in ("always", "madvise"):
        return f"panels on 4 KiB pages (transparent huge pages: {mode})"
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.nbytes // 64) * 64
    if end < HUGE:
        return "panels on 4 KiB pages (under 2 MiB in all)"
    try:
        arena = torch.empty(end + HUGE, dtype=torch.uint8)
    except RuntimeError:  # no room for a second copy's address space: the panels stay, the engine starts
        return "panels on 4 KiB pages (no memory for the arena)"
    start = -(-arena.data_ptr() // HUGE) * HUGE
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    span = (arena.data_ptr() + arena.nbytes - start) // HUGE * HUGE  # whole pages inside the arena
    if libc.madvise(start, span, MADV_HUGEPAGE) != 0:
        return f"panels on 4 KiB pages (madvise: errno {ctypes.get_errno()})"
    storage, base = arena.untyped_storage(), start - arena.data_ptr()
    with torch.no_grad():
        for t, offset in zip(tensors, offsets):
            slot = arena[base + offset:base + offset + t.nbytes].view(t.dtype).view(t.shape)
            slot.copy_(t)
            t.set_(storage, (base + offset) // t.element_size(), t.shape, t.stride())
    return f"panels on 2 MiB pages ({end / 2**20:.0f} MiB)"


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's malloc_trim; nothing elsewhere).
    Memory freed below malloc's mmap threshold, which rises to the largest block freed so far,
    stays resident otherwise: a loaded model's temporaries (a GGUF's rows rearranged, a
    checkpoint's tensors fused, packed weights given back) kept a 1B Q4_K_M model at 1.6x its
    file's size."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # (no libc by that name, or no malloc_trim in it)
        pass
