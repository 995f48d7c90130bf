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
region); the layouts say where those are (engine/kv/base.py `entry_views`, `page_views`).

Limitations. A disk read is synchronous, on the scheduling thread (~2 ms for a 4 MiB entry
from the page cache, with its checksum). KV written on one machine restores on another only
if its kernels round the same way; the namespace does not hold the CPU's ISA. Several
processes may share a directory (renames are atomic) but each indexes it only at start.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.stats import TierStats
from vmm import SlotStore

log = logging.getLogger("vkv.tiers")
MAGIC = b"VKVKV\x00\x01\x00"
HEADER = struct.Struct("<8s32s32sQ32s")  # magic, namespace, name, payload bytes, SHA-256 of payload
MAX_PENDING_BYTES = 256 << 20  # disk writes queued (bytes) before new ones are dropped


class HostTier:
    name = "host"

    def __init__(self, device: torch.device, entry_bytes: int, nbytes: int):
        if nbytes < entry_bytes:
            raise ValueError(f"kv_offloading_size of {nbytes} bytes holds no KV entry of {entry_bytes} bytes")
        self.store = SlotStore(device, entry_bytes, nbytes)
        self.entries: OrderedDict[bytes, int] = OrderedDict()  # name -> slot, least recently used first
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
        self.store.close()


class DiskTier:
    name = "disk"

    def __init__(self, root: str | os.PathLike, namespace: bytes, entry_bytes: int, nbytes: int,
                 describe: dict | None = None):
        self.namespace, self.entry_bytes, self.capacity = namespace, entry_bytes, nbytes
        self.file_bytes = HEADER.size + entry_bytes
        if nbytes < self.file_bytes:
            raise ValueError(f"kv_offloading_path_size of {nbytes} bytes holds no KV entry of {self.file_bytes} bytes")
        self.dir = Path(root).expanduser() / namespace.hex()[:32]
        self.dir.mkdir(parents=True, exist_ok=True)
        meta = self.dir / "namespace.json"
        if describe is not None and not meta.exists():
            meta.write_text(json.dumps({"namespace": namespace.hex(), **describe}, indent=1, default=str))
        self.lock = threading.Lock()
        self.index: OrderedDict[bytes, None] = OrderedDict()  # names on disk, least recently used first
        self.pending: dict[bytes, torch.Tensor] = {}  # queued for the writer, readable meanwhile
        self.bytes_written = self.bytes_read = self.restored = self.dropped = self.errors = 0
        self._scan()
        self.queue: queue.Queue = queue.Queue(max(1, MAX_PENDING_BYTES // entry_bytes))
        self.writer = threading.Thread(target=self._write_loop, name="vkv-kv-disk-writer", daemon=True)
        self.writer.start()

    def _path(self, name: bytes) -> Path:
        return self.dir / f"{name.hex()}.kv"

    def _scan(self) -> None:
        """Index the files a previous run left, oldest use first; wrong sizes and stray
        temporary files go now, checksums are checked when an entry is read."""
        files = []
        for path in self.dir.iterdir():
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)
                continue
            if path.suffix != ".kv":
                continue
            try:
                name, stat = bytes.fromhex(path.stem), path.stat()
            except (ValueError, OSError):
                continue
            if len(name) != 32 or stat.st_size != self.file_bytes:
                path.unlink(missing_ok=True)
                self.errors += 1
                continue
            files.append((stat.st_mtime_ns, name))
        for _, name in sorted(files):
            self.index[name] = None
        self._trim()

    def __contains__(self, name: bytes) -> bool:
        with self.lock:
            return name in self.index

    def put(self, name: bytes, parts: Sequence[torch.Tensor], wait: bool = False) -> None:
        """Queue the entry's bytes for the writer (copied now: the parts may change next).
        wait=False drops the write when the writer is behind."""
        with self.lock:
            if name in self.index:
                return
        buf = torch.empty(self.entry_bytes, dtype=torch.uint8)
        for part, dst in zip(parts, buf.split([p.numel() for p in parts])):
            dst.copy_(part)
        with self.lock:  # what the tier holds is decided here, on the caller's thread: only the bytes land later
            self.pending[name] = buf
            self.index[name] = None
            self._trim()
        try:
            self.queue.put((name, buf), block=wait)
        except queue.Full:
            with self.lock:
                self.pending.pop(name, None)
                self.index.pop(name, None)
                self.dropped += 1

    def _write_loop(self) -> None:
        while (item := self.queue.get()) is not None:
            name, buf = item
            try:
                self._write(name, buf)
            except OSError as exc:  # a full or read-only disk: the entry is simply not kept
                log.warning("vkv: KV tier write of %s failed: %s", name.hex()[:16], exc)
                with self.lock:
                    self.index.pop(name, None)
                    self.errors += 1
            finally:
                with self.lock:
                    if self.pending.get(name) is buf:  # (not a later put of the same name)
                        del self.pending[name]

    def _write(self, name: bytes, buf: torch.Tensor) -> None:
        payload = memoryview(buf.numpy())
        header = HEADER.pack(MAGIC, self.namespace, name, len(payload), hashlib.sha256(payload).digest())
        path = self._path(name)
        tmp = path.with_name(f"{path.stem}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)
        with self.lock:
            if name in self.index:
                self.bytes_written += self.file_bytes
            else:  # let go while it was being written
                path.unlink(missing_ok=True)

    def _trim(self) -> None:
        """Let go of the least recently used entries beyond the byte bound, written or still
        pending (lock held, or at start)."""
        while len(self.index) * self.file_bytes > self.capacity:
            name, _ = self.index.popitem(last=False)
            self.pending.pop(name, None)
            self._path(name).unlink(missing_ok=True)
            self.dropped += 1

    def get(self, name: bytes, parts: Sequence[torch.Tensor]) -> bool:
        """Copy the entry into parts; False when absent or found damaged (then it is deleted
        and counted, and the caller recomputes)."""
        with self.lock:
            buf = self.pending.get(name)
            on_disk = name in self.index
        if buf is None and not on_disk:
            return False
        if buf is None:
            buf = self._read(name)
            if buf is None:
                return False
        for part, src in zip(parts, buf.split([p.numel() for p in parts])):
            part.copy_(src)
        with self.lock:
            if name in self.index:
                self.index.move_to_end(name)
            self.restored += 1
        return True

    def _read(self, name: bytes) -> torch.Tensor | None:
        path = self._path(name)
        data = bytearray(self.file_bytes)
        why = None
        try:
            with open(path, "rb") as f:
                got = f.readinto(data)
                extra = f.read(1)
            os.utime(path)  # its last use, for the next start's LRU order
        except OSError as exc:
            got, extra, why = 0, b"", f"unreadable ({exc.strerror})"
        if why is None:
            if got != self.file_bytes or extra:
                why = f"{got}{'+' if extra else ''} bytes, expected {self.file_bytes}"
            else:
                magic, namespace, stored, length, digest = HEADER.unpack_from(data)
                if (magic, namespace, stored, length) != (MAGIC, self.namespace, name, self.entry_bytes):
                    why = "its header names another entry or format"
                elif hashlib.sha256(memoryview(data)[HEADER.size:]).digest() != digest:
                    why = "checksum mismatch"
        if why is not None:
            log.warning("vkv: KV tier file %s dropped: %s; its tokens are recomputed", path.name, why)
            path.unlink(missing_ok=True)
            with self.lock:
                self.index.pop(name, None)
                self.errors += 1
            return None
        with self.lock:
            self.bytes_read += self.file_bytes
        return torch.frombuffer(data, dtype=torch.uint8, offset=HEADER.size)

    def stats(self) -> TierStats:
        with self.lock:
            return TierStats("disk", self.capacity, len(self.index) * self.file_bytes, len(self.index),
                             self.bytes_written, self.bytes_read, self.restored, dropped=self.dropped,
                             errors=self.errors)

    def close(self) -> None:
        """Finish the queued writes, then stop the writer."""
        if self.writer.is_alive():
            self.queue.put(None)
            self.writer.join()


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
               namespace: bytes, describe: dict) -> KVTiers:
    host = HostTier(device, entry_bytes, host_bytes) if host_bytes else None
    disk = DiskTier(path, namespace, entry_bytes, path_bytes, describe) if path else None
    return KVTiers(host, disk)


def namespace_of(weights: bytes, geometry: dict) -> bytes:
    """What a KV page's bytes depend on besides its tokens: the weights and the KV geometry."""
    return hashlib.sha256(weights + json.dumps(geometry, sort_keys=True, default=str).encode()).digest()
