"""vmm: contiguous virtual ranges backed by physical pages mapped on demand.

Note [Virtual KV memory]
------------------------
A `PagePool` creates N physical pages once (on an H100 a 2 MiB page's `cuMemCreate` took
8.9 us and mapping it with access 27 us: creating up front keeps the first off a step's path).
A `Reservation` is a contiguous range of virtual addresses with nothing behind it;
`map_new`/`map_run` put pool pages behind parts of it as a sequence grows, so kernels that
want one contiguous tensor (stock FlashAttention, torch SDPA) read it in place while the
physical pages sit anywhere. The same page may be mapped into several ranges: every mapping is
one reference, so prefix sharing, parallel sampling and beam search cost no copies until a
sharer must write, when `copy_on_write` gives it a private copy of that one page.

Costs and hazards. Mapping costs microseconds per page and access grants tens (CUDA), so runs
of pages are mapped with one access call and callers map ahead of need. Touching an unmapped
address kills the process (host: SIGSEGV) or the CUDA context, so views are only as safe as
the mappings behind them: `view(check=True)` refuses spans with holes, and a view must not
outlive its reservation. The CUDA backend waits for the device before it unmaps.

Sleep and swap: `PagePool.release_memory` gives every (free) physical page back while every
reservation, and every view into one, stays valid; after `restore_memory` each is created again
when first taken, so nothing built over the addresses is rebuilt and waking costs nothing. A
`SwapSpace` holds page contents in a slower tier (a file, pinned host memory) so a page can be
unmapped and a fresh one mapped at the same address later with the same bytes.

Threads: every pool and reservation method takes the pool's lock, so a worker thread may map
while another thread computes. All memory goes back at `release()`/`close()`, on garbage
collection, or at interpreter exit.

Limitations. Pages are all one size, fixed when the backend is made: CUDA's granularity is 2 MiB
(a per-layer layout then wastes most of a page on short sequences; the engine's interleaved
layout is the answer, not this library). The pool is created whole up front, so its size is a
decision made before any traffic, and growing it means creating pages on the critical path.
Address space is reserved for the worst case (every slot at max length): cheap on 64-bit
hosts, but on the host backend each mapped page is a memory area of its own, and Linux allows
`vm.max_map_count` (65,530 by default) of them per process, which bounds the pool
(`max_mapped_pages`). Mapping and unmapping take the pool's lock and, on CUDA, unmapping waits
for the device, so they cost microseconds per page on whatever thread calls them; nothing
here hides that cost (the engine decides when to map). A view is only as safe as the mappings
behind it: the library cannot stop a kernel from reading past what is mapped.

    pool = PagePool(HostBackend(page_size=4096), num_pages=64)
    seq = Reservation(pool, 1 << 20)
    seq.map_new(0, count=2)
    x = seq.view(torch.float32, (2048,))
"""
from vmm.backend import Backend
from vmm.cuda import CudaBackend, unavailable_reason as cuda_unavailable_reason
from vmm.errors import (AlreadyMapped, BackendUnavailable, DoubleFree, InvariantViolation, NoMemory,
                        NotMapped, OutOfRange, PartialUnmap, PoolExhausted, ReservationReleased, UnmappedAccess,
                        VmmError)
from vmm.attach import AttachedPool
from vmm.host import HostBackend, PrivateHostBackend
from vmm.pool import PageAllocator, PagePool, Pool, PoolStats
from vmm.reservation import Reservation
from vmm.owner import PoolOwner
from vmm.share import PoolShare, SharedPool, Tenant
from vmm.swap import SlotStore, SwapSpace


def make_backend(name: str, page_size: int | None = None, device: int = 0, shareable: bool = False) -> Backend:
    """`host`, `host-private` or `cuda`; page_size None means 2 MiB on the host and the granularity
    on CUDA; shareable: CUDA pages that can be exported to other processes (host pages always can;
    `host-private` pages never: vmm/host.py)."""
    if name == "host":
        return HostBackend(page_size or 2 << 20)
    if name == "host-private":
        return PrivateHostBackend(page_size or 2 << 20)
    if name == "cuda":
        return CudaBackend(device, page_size, shareable)
    raise ValueError(f"unknown backend {name!r}: choose 'host', 'host-private' or 'cuda'")


__all__ = ["Backend", "HostBackend", "PrivateHostBackend", "CudaBackend", "cuda_unavailable_reason", "make_backend",
           "PageAllocator", "PagePool", "Pool", "Tenant", "PoolOwner", "AttachedPool", "PoolStats", "Reservation", "SharedPool", "PoolShare", "SlotStore", "SwapSpace", "VmmError", "BackendUnavailable",
           "PoolExhausted", "DoubleFree", "NotMapped", "AlreadyMapped", "OutOfRange",
           "UnmappedAccess", "ReservationReleased", "InvariantViolation", "PartialUnmap", "NoMemory"]
