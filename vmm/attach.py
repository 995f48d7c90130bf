"""A process's view of a pool another process owns (vmm/owner.py, Note [Pool across processes]).

`AttachedPool` has the PagePool interface that reservations and KV caches use (page ids,
handles, backend, lock, reference counts, alloc/hold/drop, stats, audit), so everything built
over a pool runs over it unchanged. Who writes what: the owner records which processes hold each
page; this process counts its own mappings and holds (`local`), and tells the owner only when a
page enters it (alloc, lookup) or leaves it (the last local reference dropped).

A page some other process may also reference (one this process published under its name, or
one it looked up) is never written in place: its reference count reads one more than this
process's own, so copy-on-write copies it before any write, as it copies a page shared inside
one process.
"""
from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence

from vmm import wire
from vmm.backend import Backend
from vmm.errors import DoubleFree, InvariantViolation, PoolExhausted, VmmError
from vmm.host import HostBackend
from vmm.pool import PoolStats, expected_refs


LOOKUP_BATCH = 128  # names per lookup message (an answer: 128 entries of up to 2 x layers pages each)
ALLOC_BATCH = 4096  # pages per alloc answer
OWNER_TIMEOUT = 60.0  # seconds for the owner to answer (it answers in microseconds when alive)


class OwnerError(VmmError):
    """The owner refused a request, or is gone."""


class _Counts(Sequence):
    """ref_counts as the rest of vmm reads them: this process's references, plus one for a page
    other processes may reference too."""

    def __init__(self, pool: AttachedPool):
        self.pool = pool

    def __len__(self) -> int:
        return len(self.pool.local)

    def __getitem__(self, page: int) -> int:
        count = self.pool.local[page]
        return count + 1 if count and page in self.pool.foreign else count


class AttachedPool:
    asleep = False

    def __init__(self, path: str, backend: Backend | None = None):
        """Attach to the pool served at `path`. A host pool brings its own backend (its memfd); a
        CUDA pool's pages are imported through `backend`, this process's CudaBackend on the
        device the owner created them on. The pool owns `backend` from this call on: it is closed
        with the pool, or here if attaching fails."""
        self.closed = False  # left the pool (or the owner is gone): the owner holds nothing of ours
        self.path = path
        self.gone: str | None = None  # why nothing more can be asked, when the owner went away
        self._imported: list = []  # CUDA handles imported here: this process's to release
        self.lock = threading.RLock()
        self._sock_lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds: list[int] = []
        try:
            wire.connect(self._sock, path, OWNER_TIMEOUT)  # a busy owner is waited for, a hung one an error
            self._sock.settimeout(OWNER_TIMEOUT)  # an owner that hangs is an error here, not a hang
            hello, fds = self._ask({"op": "hello"}, max_fds=1)  # refused (too many processes): raises
            self.page_size = hello["page_size"]
            self.process = hello["process"]  # the owner's id for this process
            self.announces = bool(hello.get("announce"))  # the owner announces its directory: describe entries
            kind = hello.get("backend", "host")
            if (backend.name if backend is not None else "host") != kind:
                raise OwnerError(f"the pool's pages are {kind} memory: attach with a {kind} backend of this process")
            if kind == "host":
                if len(fds) != 1:
                    raise OwnerError("the pool's owner sent no memory descriptor")
                self.handles: list = [h for start, count in hello["handles"] for h in range(start, start + count)]
                self.backend = HostBackend.attach(fds.pop(), self.page_size)
            else:
                if backend.page_size != self.page_size:
                    raise OwnerError(f"the pool's pages are {self.page_size} bytes, this backend's {backend.page_size}")
                self.backend = backend
                self.handles = self._import(hello["num_pages"])
        except BaseException:  # undo: nothing imported, nothing open, the owner sees this process leave
            self._release_imported()
            for fd in fds:
                os.close(fd)
            self._sock.close()
            if backend is not None:
                backend.close()
            raise
        self.local = [0] * hello["num_pages"]
        self.foreign: set[int] = set()  # held pages other processes may reference (looked up or published)
        self.ref_counts = _Counts(self)
        self.peak_in_use = 0
        self._held = 0  # pages with a local reference

    @property
    def num_pages(self) -> int:
        return len(self.local)

    @property
    def most_pages(self) -> int:
        """The most pages this process can ever hold at once: the whole pool (others permitting)."""
        return self.num_pages

    def _import(self, num_pages: int) -> list:
        """Every page of a CUDA pool, imported as handles of this process's (all or none)."""
        try:
            while len(self._imported) < num_pages:
                count = min(wire.FD_BATCH, num_pages - len(self._imported))
                _, fds = self._ask({"op": "export", "start": len(self._imported), "count": count}, max_fds=count)
                try:
                    if len(fds) != count:
                        raise OwnerError(f"the pool's owner sent {len(fds)} of {count} page descriptors")
                    for fd in fds:
                        self._imported.append(self.backend.import_page(fd))
                finally:
                    for fd in fds:
                        os.close(fd)
        except BaseException:
            self._release_imported()
            raise
        return list(self._imported)

    def _release_imported(self) -> None:
        while self._imported:
            self.backend.release_page(self._imported.pop())

    def _ask(self, message: dict, max_fds: int = 0) -> tuple[dict, list[int]]:
        if self.closed:
            raise OwnerError(self.gone or "this process has left the pool")
        with self._sock_lock:
            try:
                wire.send(self._sock, message)
                answer, fds = wire.receive(self._sock, max_fds)
            except (wire.WireError, OSError) as exc:  # closed, reset, a broken pipe, or no answer in time
                self.closed = True  # nothing more can be asked; the owner releases our references
                self.gone = f"the KV pool's owner at {self.path} is gone ({type(exc).__name__})"
                raise OwnerError(self.gone) from exc
        if "error" in answer:
            raise OwnerError(f"the pool's owner refused {message.get('op')}: {answer['message']}")
        return answer, fds

    # -- the PagePool interface -----------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages an alloc can get now: free in the whole pool, or cached with no process
        referencing them (the owner evicts those for an alloc). Other processes may take them
        before this one does."""
        return self._ask({"op": "stats"})[0]["obtainable"]

    def alloc(self) -> int:
        return self.alloc_many(1)[0]

    def alloc_many(self, n: int) -> list[int]:
        """Take n pages, all or none (the owner evicts cached pages nobody maps to find them)."""
        with self.lock:
            if n == 0:
                return []
            if n > self.num_pages:  # as any pool: more than it has is exhaustion, not a bad request
                raise PoolExhausted(f"need {n} pages, the shared pool has {self.num_pages}")
            if n > ALLOC_BATCH:  # more than one answer holds: in parts, all or none
                taken: list[int] = []
                try:
                    while len(taken) < n:
                        taken += self.alloc_many(min(ALLOC_BATCH, n - len(taken)))
                except PoolExhausted:
                    for page in taken:
                        self.drop(page)
                    raise
                return taken
            answer, _ = self._ask({"op": "alloc", "n": n})
            if not answer["pages"]:
                raise PoolExhausted(answer.get("capped") or
                                    f"need {n} pages, {answer['free']} of {self.num_pages} free in the shared pool")
            for page in answer["pages"]:
                self._take(page)
            return answer["pages"]

    def _take(self, page: int) -> None:
        self.local[page] = 1
        self._held += 1
        self.peak_in_use = max(self.peak_in_use, self._held)

    def own_refs(self, page: int) -> int:
        """This process's references (ref_counts adds one for a page others may reference)."""
        return self.local[page]

    def hold(self, page: int) -> None:
        with self.lock:
            if self.local[page] == 0:
                raise DoubleFree(f"page {page} is not held by this process: take it with alloc() or lookup()")
            self.local[page] += 1

    def drop(self, page: int) -> bool:
        """Drop one reference; the last one tells the owner (True: this process let go of it)."""
        return bool(self._drop([page]))

    def drop_many(self, pages) -> None:
        """Drop one reference on each; the owner hears of those let go in one message (a batch)."""
        self._drop(list(pages))

    def _drop(self, pages: list[int]) -> list[int]:
        with self.lock:
            gone = []
            for page in pages:
                if self.local[page] == 0:
                    raise DoubleFree(f"page {page} is already free in this process")
                self.local[page] -= 1
                if not self.local[page]:
                    self._held -= 1
                    self.foreign.discard(page)
                    gone.append(page)
            if gone and not self.closed:  # once it left, the owner dropped all of its references already
                try:
                    for start in range(0, len(gone), ALLOC_BATCH):
                        self._ask({"op": "drop", "pages": gone[start:start + ALLOC_BATCH]})
                except OwnerError:
                    if not self.closed:
                        raise
            return gone

    def borrow(self, need: int) -> None:
        """Other tenants are other processes: the owner frees cached pages for an alloc itself."""

    def borrowable(self) -> int:
        return 0

    # -- names: what replicas share --------------------------------------------------------
    def publish(self, entries: Iterable[tuple[bytes, tuple[int, ...]]],
                meta: Sequence[dict | None] | None = None) -> list[bool]:
        """Cache sealed entries (name, the page of each region) for every process; from now on
        their pages are never written in place here. Returns, per entry, whether it was new.
        meta: per entry, what the owner announces of it (if it announces: `announces`; its parent's
        name, tokens and adapter, JSON; a description too large for one message loses its tokens)."""
        entries = [(name, tuple(pages)) for name, pages in entries]
        described = list(meta) if meta is not None and self.announces else [None] * len(entries)
        published: list[bool] = []
        with self.lock:
            for _, pages in entries:
                for page in pages:
                    if self.local[page] == 0:
                        raise DoubleFree(f"page {page} is not held by this process: it cannot publish it")
            for batch in _batches([[name.hex(), list(pages), *([m] if m is not None else [])]
                                   for (name, pages), m in zip(entries, described)]):
                answer, _ = self._ask({"op": "publish", "entries": batch})
                for entry, new in zip(batch, answer["published"]):
                    if new:
                        self.foreign.update(entry[1])
                published += answer["published"]
            return published

    def lookup(self, names: Sequence[bytes]) -> list[tuple[int, ...]]:
        """The entries of the longest prefix of `names` that any process published, each page
        now with one reference of this process's (drop it when done). Asked LOOKUP_BATCH names
        at a time (a message is one datagram), until a batch comes back short."""
        found: list[tuple[int, ...]] = []
        with self.lock:
            start = 0
            while start < len(names):
                batch = names[start:start + LOOKUP_BATCH]
                answer, _ = self._ask({"op": "lookup", "names": [name.hex() for name in batch]})
                start += len(answer["pages"])
                for pages in answer["pages"]:
                    for page in pages:
                        if self.local[page]:
                            self.local[page] += 1
                        else:
                            self._take(page)
                        self.foreign.add(page)
                    found.append(tuple(pages))
                if len(answer["pages"]) < len(batch) and not (answer.get("full") and answer["pages"]):
                    break  # the longest prefix ends here (else the answer was full: ask on)
            return found

    def take(self, name: bytes) -> tuple[int, ...] | None:
        """The entry published under `name`, handed to this process alone: out of the directory,
        its pages referenced here only, so they may be written in place (None: unknown, or
        another process maps it)."""
        with self.lock:
            pages = self._ask({"op": "take", "name": name.hex()})[0]["pages"]
            for page in pages or ():  # no process held them, this one included
                self._take(page)
            return None if pages is None else tuple(pages)

    # -- numbers and the audit --------------------------------------------------------------
    def owner_alive(self) -> bool:
        """Is the owner still there? (Its end of the socket closed reads as empty at once, without
        a round trip; a process that must not go on without it checks this.)"""
        if self.closed:
            return False
        with self._sock_lock:
            try:
                self._sock.setblocking(False)
                try:
                    gone = self._sock.recv(1, socket.MSG_PEEK) == b""
                except BlockingIOError:  # nothing to read: still connected
                    gone = False
                finally:
                    self._sock.settimeout(OWNER_TIMEOUT)
            except OSError:
                gone = True
        if gone:
            self.closed, self.gone = True, f"the KV pool's owner at {self.path} is gone"
        return not gone

    def owner_stats(self) -> dict:
        return self._ask({"op": "stats"})[0]

    def stats(self) -> PoolStats:
        with self.lock:
            owner = self.owner_stats()
            shared = sum(1 for page, count in enumerate(self.local) if count > 1 or (count and page in self.foreign))
            return PoolStats(self.page_size, self.num_pages, owner["obtainable"], self._held, shared,
                             self.peak_in_use)

    def check(self, expected: Mapping[int, int]) -> None:
        """This process's count of each page equals the references its owners here say they hold,
        and the pool's owner records exactly the pages this process references."""
        with self.lock:
            for page, count in enumerate(self.local):
                if count != expected.get(page, 0):
                    raise InvariantViolation(f"page {page}: this process counts {count}, "
                                             f"its holders here hold {expected.get(page, 0)}")
            try:
                self._ask({"op": "audit", "held": [p for p, count in enumerate(self.local) if count]})
            except OwnerError as exc:
                raise InvariantViolation(str(exc)) from None

    def audit(self, reservations: Iterable, held: Mapping[int, int] = {}) -> None:
        with self.lock:
            self.check(expected_refs(reservations, held))

    def release_memory(self) -> None:
        raise VmmError("a pool shared across processes sleeps with its owner, not one process")

    def restore_memory(self) -> None:
        raise VmmError("a pool shared across processes sleeps with its owner, not one process")

    def close(self) -> None:
        """Leave the pool: the owner drops every reference this process still holds. Its
        reservations must be released first (their mappings would outlive the references)."""
        self.closed = True
        self._sock.close()
        self._release_imported()
        self.backend.close()


def _batches(entries: list[list]) -> Iterator[list[list]]:
    """Publish messages: at most LOOKUP_BATCH entries and half a datagram each; an entry whose
    description alone would not fit keeps it without its tokens."""
    batch, size = [], 0
    for entry in entries:
        n = len(json.dumps(entry, separators=(",", ":")))
        if n > wire.MAX_MESSAGE // 2 and len(entry) > 2:
            entry[2] = {**entry[2], "tokens": []}
            n = len(json.dumps(entry, separators=(",", ":")))
        if batch and (len(batch) == LOOKUP_BATCH or size + n > wire.MAX_MESSAGE // 2):
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += n
    if batch:
        yield batch
