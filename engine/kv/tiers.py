"""KV tiers: where evicted prefix-cache entries go, and where they come back from.

Note [KV tiers]
---------------
Rationale. An evicted prefix-cache entry used to be gone: the next request with that prefix
paid its prefill again (1,000 tokens: ~3.7 s on a 2-core CPU, against ~0.1 s for a hit). Host
memory is larger than the pool (on a GPU, much larger), and disk is larger still and outlives
the process.

Approach. An entry is the pages (one per KV region) that hold one page's worth of tokens, named
by the SHA-256 chain of engine/kv/prefix_cache.py. When the pool evicts an entry, its bytes are
copied into the tiers first, under the same name. When a sequence is admitted, the pages after
its cached prefix are looked up by name in the tiers; each one found is restored by mapping a
fresh page at that page's place in the sequence's own slot (or block) and copying the bytes in:
the virtual addresses are the ones the prefill would have written, so nothing else changes.
  host  a `vmm.SlotStore` (a sparse file on the host, pinned memory on CUDA), one slot per
        entry, its own LRU: when full, its oldest entry goes.
  disk  one file per entry under DIR/<namespace>/, where the namespace is a SHA-256 of the
        model's weights and the KV geometry (dtype, layout, page size, rows): another model or
        dtype looks in another directory and uses other names. A file is a header (magic,
        namespace, name, length, SHA-256 of the payload) and the payload; written to a
        temporary name by a writer thread and renamed into place, so a reader sees a whole
        file or none. Bounded by bytes: the oldest files (by last use) go first.
Writes: the host copy is made on the evicting thread (the copy itself is the cost); a disk
write copies the bytes once into a buffer and a writer thread does the rest (checksum, file).
The writer's queue is bounded: when the disk falls behind, writes are dropped and counted,
never waited for, except at close, which drains it (so a restarted server finds what the
last one cached). An entry goes to both tiers; restoring prefers host.

Implementation. `KVTiers` is what the KV cache sees: `where(name)`, `offload(name, parts)`,
`restore(name, parts)`. A part is a 1-D uint8 tensor over the entry's bytes (a page of each
region); the layouts say where those are (engine/kv/layout.py `entry_views`, `page_views`).

Failures. Nothing the directory holds can stop or hang the engine (engine/kv/disk_tier.py:
class DiskTier, class FileSystem): files are opened without following links and without blocking, checked to be
regular files of the right size, read with a bound; every OS error at every site (scan, open,
read, write, rename, unlink, trim, the namespace file) is caught where it happens, counted by
operation and errno (`vkv:kv_tier_errors_total{tier,op,errno}`), and the entry dropped; a tier
whose calls keep failing turns itself off with one log line (`vkv:kv_tier_off`).

Limitations. A disk read is synchronous, on the scheduling thread (~2 ms for a 4 MiB entry
from the page cache, with its checksum). KV written on one machine restores on another only
if its kernels round the same way; the namespace does not hold the CPU's ISA. Several
processes may share a directory (renames are atomic) but each indexes it only at start.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence

import torch

from engine.kv.disk_tier import DiskTier
from engine.kv.events import CPU, AnnouncedEntries, KVEventLog
from engine.stats import TierStats
from vmm import SlotStore



class HostTier:
    name = "host"

    def __init__(self, device: torch.device, entry_bytes: int, nbytes: int, events: KVEventLog | None = None):
        if nbytes < entry_bytes:
            raise ValueError(f"kv_offloading_size of {nbytes} bytes holds no KV entry of {entry_bytes} bytes")
        self.store = SlotStore(device, entry_bytes, nbytes)
        self.entries: OrderedDict[bytes, int] = AnnouncedEntries(events, CPU)  # name -> slot, least recently used first
        self.restored = self.dropped = 0

    def __contains__(self, name: bytes) -> bool:
        return name in self.entries

    def put(self, name: bytes, parts: Sequence[torch.Tensor]) -> None:
        if name in self.entries:
            self.entries.move_to_end(name)
            return
        if not self.store.num_free:
            _, slot = self.entries.popitem(last=False)
            self.store.discard(slot)
            self.dropped += 1
        self.entries[name] = self.store.put(parts)

    def get(self, name: bytes, parts: Sequence[torch.Tensor]) -> bool:
        slot = self.entries.get(name)
        if slot is None:
            return False
        self.store.get(slot, parts)
        self.entries.move_to_end(name)
        self.restored += 1
        return True

    def stats(self) -> TierStats:
        s = self.store
        return TierStats("host", s.num_slots * s.slot_size, len(self.entries) * s.slot_size, len(self.entries),
                         s.bytes_out, s.bytes_in, self.restored, dropped=self.dropped)

    def close(self) -> None:
        self.entries.clear()  # announced removed: its memory goes with the engine
        self.store.close()


class KVTiers:
    """The tiers below the pool, fastest first, as one cache of named entries."""

    def __init__(self, host: HostTier | None, disk: DiskTier | None):
        if host is None and disk is None:
            raise ValueError("KVTiers needs a host tier, a disk tier, or both")
        self.tiers = [t for t in (host, disk) if t is not None]
        self.host, self.disk = host, disk

    def where(self, name: bytes) -> str | None:
        """The fastest tier holding the entry, or None."""
        return next((t.name for t in self.tiers if name in t), None)

    def offload(self, name: bytes, parts: Sequence[torch.Tensor], wait: bool = False) -> None:
        if self.host:
            self.host.put(name, parts)
        if self.disk:
            self.disk.put(name, parts, wait=wait)

    def restore(self, name: bytes, parts: Sequence[torch.Tensor]) -> str | None:
        """Copy the entry into parts from the fastest tier that has it whole; which one, or None."""
        return next((t.name for t in self.tiers if t.get(name, parts)), None)

    def stats(self) -> list[TierStats]:
        return [t.stats() for t in self.tiers]

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


def make_tiers(device: torch.device, entry_bytes: int, host_bytes: int, path: str | None, path_bytes: int,
               namespace: bytes, describe: dict, events: KVEventLog | None = None) -> KVTiers:
    """The tiers; what comes and goes in each is recorded in `events` (Note [KV events])."""
    host = HostTier(device, entry_bytes, host_bytes, events) if host_bytes else None
    disk = DiskTier(path, namespace, entry_bytes, path_bytes, describe, events=events) if path else None
    return KVTiers(host, disk)


def namespace_of(weights: bytes, geometry: dict) -> bytes:
    """What a KV page's bytes depend on besides its tokens: the weights and the KV geometry."""
    return hashlib.sha256(weights + json.dumps(geometry, sort_keys=True, default=str).encode()).digest()
