"""The GEMM panels on transparent huge pages.

Note [Panels on huge pages]
---------------------------
Rationale. A decode step streams every panel once (540 MB a token for the bundled model in
fp32, 270 MB in bf16). On 4 KiB pages that is one TLB entry, and one page walk, per 4 KiB
read: 132,000 a token in fp32, far beyond the TLB. The kernel gives an anonymous range 2 MiB
pages only where asked (`transparent_hugepage/enabled` is usually `madvise`), and torch's
allocator never asks (measured: benchmarks/results/cpu/design_choices.json, "huge_pages").

Approach. Every panel is written into one arena whose 2 MiB-aligned span is advised
`MADV_HUGEPAGE` before a byte of it is touched, so its first writes fault in huge pages.

Implementation. `huge_page_slots` lays tensors out at 64-byte offsets, allocates the arena
(torch's CPU allocator; untouched memory costs nothing), advises the aligned span, and hands out
a view per tensor: the model's `prepare` packs each projection's panels straight into its slot
(one pass over the weights). `onto_huge_pages` moves tensors made elsewhere (the LM head's pick
copy) into an arena of their own, each keeping its Python object (its storage `set_` to its
slice), so whoever holds one holds valid memory. Who writes what: `prepare`, once, before sleep
mode moves the weights.

Limitations. Where the kernel has THP off (`never`), refuses the advice or the arena cannot be
allocated, the panels are allocated one by one and the returned line says why. Sleep mode then moves
every weight into pages of its own, advised the same way (vmm's `PrivateHostBackend`). The kernel may still back
part of the span with 4 KiB pages (fragmented memory); `AnonHugePages` in /proc/self/smaps says.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math

import torch

from vmm.host import MADV_HUGEPAGE, thp_mode

HUGE = 2 << 20


def huge_page_slots(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[torch.Tensor] | None, str]:
    """Empty tensors of the given (shape, dtype), at 64-byte offsets in one arena advised onto
    2 MiB pages before a byte of it is touched (so that writing them faults in huge pages), and
    what was done; None and why not where that cannot be had (the caller allocates them itself)."""
    mode = thp_mode()
    if mode not in ("always", "madvise"):
        return None, f"panels on 4 KiB pages (transparent huge pages: {mode})"
    offsets, end = [], 0
    for shape, dtype in specs:
        offsets.append(end)
        end += -(-math.prod(shape) * dtype.itemsize // 64) * 64
    if end < HUGE:
        return None, "panels on 4 KiB pages (under 2 MiB in all)"
    try:
        arena = torch.empty(end + HUGE, dtype=torch.uint8)
    except RuntimeError:  # no room for a second copy's address space: the panels stay, the engine starts
        return None, "panels on 4 KiB pages (no memory for the arena)"
    start = -(-arena.data_ptr() // HUGE) * HUGE
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    span = (arena.data_ptr() + arena.nbytes - start) // HUGE * HUGE  # whole pages inside the arena
    if libc.madvise(start, span, MADV_HUGEPAGE) != 0:
        return None, f"panels on 4 KiB pages (madvise: errno {ctypes.get_errno()})"
    base = start - arena.data_ptr()
    slots = [arena[base + offset:base + offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
             for (shape, dtype), offset in zip(specs, offsets)]
    return slots, f"panels on 2 MiB pages ({end / 2**20:.0f} MiB)"


def onto_huge_pages(tensors: list[torch.Tensor]) -> str:
    """Move the CPU tensors into one arena advised onto 2 MiB pages (huge_page_slots), in place;
    what was done."""
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in tensors), "contiguous CPU tensors"
    slots, done = huge_page_slots([(tuple(t.shape), t.dtype) for t in tensors])
    with torch.no_grad():
        for t, slot in zip(tensors, slots or []):
            slot.copy_(t)
            t.set_(slot.untyped_storage(), slot.storage_offset(), t.shape, t.stride())
    return done


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
