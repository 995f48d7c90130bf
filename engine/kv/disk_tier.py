"""The disk tier of the KV tiers (Note [KV tiers] in engine/kv/tiers.py): one file per entry
under DIR/<namespace>/, written by a writer thread and renamed into place; and `FileSystem`,
every OS call it makes, in one place, so that no file, link, FIFO or error in the directory can
stop or hang the engine.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from stat import S_ISREG

import torch

from engine.kv.events import STORAGE, AnnouncedEntries, KVEventLog
from engine.stats import TierStats

log = logging.getLogger("vkv.tiers")
MAGIC = b"VKVKV\x00\x01\x00"
HEADER = struct.Struct("<8s32s32sQ32s")  # magic, namespace, name, payload bytes, SHA-256 of payload
MAX_PENDING_BYTES = 256 << 20  # disk writes queued (bytes) before new ones are dropped


class FileSystem:
    """Every OS call the disk tier makes, in one place: what fault-injection tests fail in turn
    (tests/kv/test_tier_faults.py), and what keeps the tier's reads bounded. Opening never follows a
    symlink and never blocks (a FIFO opens at once and is then refused by fstat)."""
    OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

    def mkdir(self, path: Path) -> None:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)

    def scandir(self, path: Path) -> list[os.DirEntry]:
        with os.scandir(path) as entries:
            return list(entries)

    def lstat(self, path: Path) -> os.stat_result:
        return os.lstat(path)

    def open(self, path: Path, flags: int) -> int:
        return os.open(path, flags, 0o600)  # a tenant's KV: its owner's alone, as the pool's socket

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def readinto(self, fd: int, buf: memoryview) -> int:
        return os.readv(fd, [buf])

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def close(self, fd: int) -> None:
        os.close(fd)

    def touch(self, fd: int) -> None:
        os.utime(fd)

    def replace(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)

    def unlink(self, path: Path) -> None:
        os.unlink(path)


FS = FileSystem()
FAILURES_TO_TURN_OFF = 32  # OS errors in a row, with no success between, after which the disk tier turns off


class DiskTier:
    """Entries as files under DIR/<namespace>/ (Note [KV tiers]). No OS error on any path stops
    the engine: each is caught where it happens, counted by operation and errno
    (`errors_by`), and the entry dropped or the file left alone; a tier whose calls keep failing
    turns itself off (`off`: why), and the KV cache goes on without it."""
    name = "disk"

    def __init__(self, root: str | os.PathLike, namespace: bytes, entry_bytes: int, nbytes: int,
                 describe: dict | None = None, fs: FileSystem = FS, events: KVEventLog | None = None):
        self.namespace, self.entry_bytes, self.capacity, self.fs = namespace, entry_bytes, nbytes, fs
        self.file_bytes = HEADER.size + entry_bytes
        if nbytes < self.file_bytes:
            raise ValueError(f"kv_offloading_path_size of {nbytes} bytes holds no KV entry of {self.file_bytes} bytes")
        self.dir = Path(root).expanduser() / namespace.hex()[:32]
        self.lock = threading.Lock()
        self.index: OrderedDict[bytes, None] = AnnouncedEntries(events, STORAGE)  # names on disk, least recently used first
        self.pending: dict[bytes, torch.Tensor] = {}  # queued for the writer, readable meanwhile
        self.bytes_written = self.bytes_read = self.restored = self.dropped = self.errors = 0
        self.errors_by: dict[tuple[str, str], int] = {}  # (operation, errno name) -> count
        self.failing = 0  # OS errors since the last call that worked
        self.off: str | None = None  # why the tier turned itself off
        if self._call("mkdir", fs.mkdir, self.dir) is not None:
            if describe is not None:
                self._describe(describe)
            self._scan()
        self.queue: queue.Queue = queue.Queue(max(1, MAX_PENDING_BYTES // entry_bytes))
        self.writer = threading.Thread(target=_write_loop, args=(weakref.ref(self), self.queue),
                                       name="vkv-kv-disk-writer", daemon=True)
        self.writer.start()
        self._stop_writer = weakref.finalize(self, _stop, self.queue)  # a tier dropped unclosed

    # -- OS calls ----------------------------------------------------------------------------
    def _call(self, op: str, fn, *args, default=None):
        """fn(*args), or `default` with the error counted (and the tier turned off when its
        calls keep failing). Lock not held."""
        try:
            result = fn(*args)
        except OSError as exc:
            self._failed(op, errno.errorcode.get(exc.errno, str(exc.errno)), exc)
            return default
        if result is None:
            result = True
        with self.lock:
            self.failing = 0
        return result

    def _count(self, op: str, code: str) -> None:
        """A file found wrong (not an OS failure): counted, not held against the tier."""
        with self.lock:
            self.errors += 1
            self.errors_by[op, code] = self.errors_by.get((op, code), 0) + 1

    def _failed(self, op: str, code: str, why) -> None:
        with self.lock:
            self.errors += 1
            self.errors_by[op, code] = self.errors_by.get((op, code), 0) + 1
            self.failing += 1
            turn_off = self.off is None and self.failing >= FAILURES_TO_TURN_OFF
            if turn_off:
                self.off = f"{self.failing} OS errors in a row, the last {op}: {why}"
                self.index.clear()
                self.pending.clear()
        if turn_off:
            log.error("vkv: the KV disk tier at %s is off: %s; the engine goes on with the pool (and the host "
                      "tier, if any)", self.dir, self.off)
        else:
            log.warning("vkv: KV disk tier %s failed (%s): %s", op, code, why)

    def _unlink(self, path: Path) -> None:
        try:
            self.fs.unlink(path)
        except FileNotFoundError:  # gone already: what was wanted
            pass
        except OSError as exc:
            self._failed("unlink", errno.errorcode.get(exc.errno, str(exc.errno)), exc)

    def _path(self, name: bytes) -> Path:
        return self.dir / f"{name.hex()}.kv"

    def _describe(self, describe: dict) -> None:
        """namespace.json, for a person reading the directory: written beside and renamed into
        place, never through a link."""
        meta = self.dir / "namespace.json"
        try:
            self.fs.lstat(meta)
            return  # there already (or there as something else: left alone)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._failed("lstat", errno.errorcode.get(exc.errno, str(exc.errno)), exc)
            return
        data = json.dumps({"namespace": self.namespace.hex(), **describe}, indent=1, default=str).encode()
        tmp = meta.with_name(f"namespace.{threading.get_ident()}.tmp")
        if self._write_file(tmp, data):
            if self._call("rename", self.fs.replace, tmp, meta) is None:
                self._unlink(tmp)

    def _write_file(self, path: Path, *chunks) -> bool:
        fd = self._call("open", self.fs.open, path, FileSystem.OPEN_NEW)
        if fd is None:
            return False
        try:
            for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    n = self._call("write", self.fs.write, fd, view, default=0)
                    if not n:
                        self._unlink(path)
                        return False
                    view = view[n:]
            return True
        finally:
            self._call("close", self.fs.close, fd)

    def _scan(self) -> None:
        """Index the files a previous run left, oldest use first. Only regular files of the
        right size and name count (never followed through a link); stray temporary files and
        wrong sizes go now, anything else is left alone; checksums are checked when read."""
        files = []
        for entry in self._call("scan", self.fs.scandir, self.dir, default=[]):
            path = Path(entry.path)
            if path.suffix not in (".tmp", ".kv"):
                continue
            stat = self._call("lstat", self.fs.lstat, path)
            if stat is None or not S_ISREG(stat.st_mode):
                if stat is not None:  # a directory, a link, a FIFO: not ours, left alone
                    self._count("scan", "not a regular file")
                continue
            if path.suffix == ".tmp":
                self._unlink(path)
                continue
            try:
                name = bytes.fromhex(path.stem)
            except ValueError:
                continue
            if len(name) != 32 or stat.st_size != self.file_bytes:
                self._unlink(path)
                self._count("scan", "wrong size")
                continue
            files.append((stat.st_mtime_ns, name))
        for _, name in sorted(files):
            self.index[name] = None
        with self.lock:
            doomed = self._trim()
        self._remove(doomed)

    # -- entries ---------------------------------------------------------------------------
    def __contains__(self, name: bytes) -> bool:
        with self.lock:
            return self.off is None and name in self.index

    def put(self, name: bytes, parts: Sequence[torch.Tensor], wait: bool = False) -> None:
        """Queue the entry's bytes for the writer (copied now: the parts may change next).
        wait=False drops the write when the writer is behind."""
        with self.lock:
            if name in self.index or self.off is not None:
                return
        buf = torch.empty(self.entry_bytes, dtype=torch.uint8)
        for part, dst in zip(parts, buf.split([p.numel() for p in parts])):
            dst.copy_(part)
        with self.lock:  # what the tier holds is decided here, on the caller's thread: only the bytes land later
            self.pending[name] = buf
            self.index[name] = None
            doomed = self._trim()
        self._remove(doomed)  # files let go for room: unlinked here, failures counted, never raised
        try:
            self.queue.put((name, buf), block=wait)
        except queue.Full:
            with self.lock:
                self.pending.pop(name, None)
                self.index.pop(name, None)
                self.dropped += 1

    def _write_item(self, name: bytes, buf: torch.Tensor) -> None:
        """(the writer thread) One queued entry to its file."""
        try:
            if not self._write(name, buf):
                with self.lock:
                    self.index.pop(name, None)
        finally:
            with self.lock:
                if self.pending.get(name) is buf:  # (not a later put of the same name)
                    del self.pending[name]

    def _write(self, name: bytes, buf: torch.Tensor) -> bool:
        payload = memoryview(buf.numpy())
        header = HEADER.pack(MAGIC, self.namespace, name, len(payload), hashlib.sha256(payload).digest())
        path = self._path(name)
        tmp = path.with_name(f"{path.stem}.{threading.get_ident()}.tmp")
        if not self._write_file(tmp, header, payload):
            return False
        if self._call("rename", self.fs.replace, tmp, path) is None:
            self._unlink(tmp)
            return False
        with self.lock:
            kept = name in self.index
            if kept:
                self.bytes_written += self.file_bytes
        if not kept:  # let go while it was being written
            self._unlink(path)
        return kept

    def _trim(self) -> list[Path]:
        """Let go of the least recently used entries beyond the byte bound, written or still
        pending (lock held); their files, for the caller to remove without the lock."""
        doomed = []
        while len(self.index) * self.file_bytes > self.capacity:
            name, _ = self.index.popitem(last=False)
            if self.pending.pop(name, None) is None:  # (a pending one has no file yet; its writer removes it)
                doomed.append(self._path(name))
            self.dropped += 1
        return doomed

    def _remove(self, paths: list[Path]) -> None:
        for path in paths:
            self._unlink(path)

    def get(self, name: bytes, parts: Sequence[torch.Tensor]) -> bool:
        """Copy the entry into parts; False when absent or found damaged (then it is deleted
        and counted, and the caller recomputes)."""
        with self.lock:
            buf = self.pending.get(name)
            on_disk = name in self.index and self.off is None
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
        """The entry's payload, read with a bound from a regular file opened without following
        links or blocking; None (the entry dropped, counted) for anything else."""
        path = self._path(name)
        data = bytearray(self.file_bytes + 1)  # one byte more: a longer file is found, not half read
        why, got = None, 0
        fd = self._call("open", self.fs.open, path, FileSystem.OPEN_READ)
        if fd is None:
            why = "could not be opened"
        else:
            try:
                stat = self._call("fstat", self.fs.fstat, fd)
                if stat is None or not S_ISREG(stat.st_mode):
                    why = "is not a regular file" if stat is not None else "could not be examined"
                else:
                    view = memoryview(data)
                    while got < len(data):
                        n = self._call("read", self.fs.readinto, fd, view[got:], default=-1)
                        if n <= 0:
                            why = "could not be read" if n < 0 else None
                            break
                        got += n
                    self._call("touch", self.fs.touch, fd)  # its last use, for the next start's LRU order
            finally:
                self._call("close", self.fs.close, fd)
        if why is None:
            if got != self.file_bytes:
                why = f"{got if got <= self.file_bytes else 'more than ' + str(self.file_bytes)} bytes, " \
                      f"expected {self.file_bytes}"
            else:
                magic, namespace, stored, length, digest = HEADER.unpack_from(data)
                if (magic, namespace, stored, length) != (MAGIC, self.namespace, name, self.entry_bytes):
                    why = "its header names another entry or format"
                elif hashlib.sha256(memoryview(data)[HEADER.size:self.file_bytes]).digest() != digest:
                    why = "checksum mismatch"
        if why is not None:
            log.warning("vkv: KV tier file %s dropped: %s; its tokens are recomputed", path.name, why)
            with self.lock:
                self.index.pop(name, None)
            if fd is not None and why != "could not be read":  # (an OS failure is counted where it happened)
                self._count("read", "not a regular file" if why == "is not a regular file" else "damaged")
            if fd is not None and why != "is not a regular file":  # a file of ours gone bad: removed
                self._unlink(path)
            return None
        with self.lock:
            self.bytes_read += self.file_bytes
        return torch.frombuffer(data, dtype=torch.uint8, offset=HEADER.size, count=self.entry_bytes)

    def stats(self) -> TierStats:
        with self.lock:
            return TierStats("disk", self.capacity, len(self.index) * self.file_bytes, len(self.index),
                             self.bytes_written, self.bytes_read, self.restored, dropped=self.dropped,
                             errors=self.errors, errors_by=tuple(sorted(self.errors_by.items())),
                             off=self.off is not None)

    def close(self) -> None:
        """Finish the queued writes, then stop the writer."""
        self._stop_writer.detach()
        if self.writer.is_alive():
            self.queue.put(None)
            self.writer.join()
        with self.lock:  # the files stay, for the next engine to announce again
            self.index.announce_gone()


def _write_loop(tier: weakref.ref, pending: queue.Queue) -> None:
    """The writer thread: it holds its tier only while writing an entry, so a tier dropped
    without close() is freed, and its writer ends (at the None that close() or the tier's
    finalizer puts, or at the next entry, its tier gone)."""
    while (item := pending.get()) is not None:
        owner = tier()
        if owner is None:
            return
        owner._write_item(*item)
        del owner


def _stop(pending: queue.Queue) -> None:
    """(a dropped tier's finalizer) The writer's last item; a full queue: it finds its tier gone."""
    try:
        pending.put_nowait(None)
    except queue.Full:
        pass
