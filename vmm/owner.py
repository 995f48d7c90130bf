"""One physical page pool, several processes: the owner that allocates, counts and names pages.

Note [Pool across processes]
----------------------------
Rationale. Replicas of a model on one host, or a prefill process and a decode process, each
keep a pool of their own today, so a prefix one of them computed is computed again by the
other, and handing a prompt's KV from prefill to decode means copying it. The pages are already
a file (host: one memfd) that any process can map: if the processes map the same pages, a page
computed by one is read in place by the others, with no copy and no descriptor list.

Approach. One process, the owner, holds the authority; every other process attaches
(`vmm.attach.AttachedPool`) over a Unix socket and receives the pool's memory as file
descriptors (SCM_RIGHTS), then maps pages into its own reservations as it always did. Host
pages are one memfd, sent once with the first answer; CUDA pages are one exported descriptor
each (`cuMemExportToShareableHandle`, created shareable), sent wire.FD_BATCH to an answer, which
the process imports into handles of its own and releases when it leaves (vmm/cuda.py). The
owner keeps:
  - allocation: the free pages (a process asks for n, gets n or none);
  - references: per page, the set of holders: each process that references it (however many
    mappings it has inside: those it counts itself) and the directory;
  - names: the directory of sealed entries, name -> pages (an entry is the page of each KV
    region holding the same tokens; its name is the chained SHA-256 of engine/kv/prefix_cache.py),
    published by whoever computed them and looked up by anyone; a lookup takes a reference for
    the caller in the same step, so nothing is evicted between;
  - eviction: when a process asks for more pages than are free, the least recently used
    directory entries that no process references are freed first.
Why an owner and not a shared table with leases: every change is a message the owner applies
alone, in order, so there is one writer and no cross-process lock or atomics to get right; a
process that dies is noticed at once (its socket reads empty, or errors) and the owner drops
every reference it held in the same loop iteration. The cost is a round trip (tens of us) when
a page enters or leaves a process, not per mapping: a process counts its own mappings.

Implementation. `PoolOwner` wraps a `PagePool` (page ids, physical pages, per-page counts,
free FIFO) whose count per page is its number of holders, and serves a SOCK_SEQPACKET socket
from one thread (`serve`, or `start` for a background thread). Verbs: hello (the geometry, and
the host pool's descriptor), export (CUDA: descriptors for a run of pages), alloc, drop,
publish, lookup, take (an entry handed whole to one process: the last page of a prefill-to-
decode handoff, written on by the decoder), stats, audit. `audit` checks every page is free,
held by a process, or cached (held by the directory), that its count equals its holders, and
that a process's claim of what it holds equals the owner's record.
Announcing (`announce=True`): the owner, the one writer of the directory, is also the one that
says what it holds, for routers (engine/kv/pool_events.py turns it into vLLM's KV events): an
entry published with a description (`meta`: its parent's name, its tokens, its adapter, as the
publisher knows them; vmm reads none of it) is logged as stored, and logged as removed when it
leaves the directory (evicted, taken, or at stop); `take_changes` hands the log over. An entry
published without one (a prompt's partial last page) is not announced.

Admission. Every process that connects can read every page, so the owner admits only processes
of its own user (SO_PEERCRED's uid; `allowed_uids` widens it), the socket is created with mode
0600 (bound under a private name, then renamed into place: no window with another mode; 0666
when other users are allowed, whom the uid check then admits alone), a
connection must finish its hello within HELLO_TIMEOUT (only attached processes count toward
MAX_PROCESSES; at most MAX_PENDING wait for theirs, the longest silent closed to make room, so a
flood of idle connections cannot keep out an engine, which says hello at once), and `max_pages_per_process` caps what one
process may hold at once (an alloc past it is refused as exhaustion, by name), so one greedy or
broken process cannot hold the pool.

Limitations. A CUDA pool shares pages between processes on one device: every process maps them
on the device they were created on (peer access across devices is not set up). On the CUDA
driver emulator (tests/cuda_emulator) an imported page keeps a file open; the real driver does
not. A process that hangs without dying keeps its references (no leases). The owner is a
single point of failure: if it dies, the pages stay mapped in every process (the memfd lives
while mapped) but no process can allocate or look up again. The socket path is protected by the
file system: every process that can connect can read every page, so it belongs in a directory
only the server's user can open.
"""
from __future__ import annotations

import logging
import os
import re
import secrets
import selectors
import socket
import threading
import time
from collections import OrderedDict, deque

from vmm import wire
from vmm.backend import Backend, consecutive_runs
from vmm.errors import InvariantViolation, VmmError
from vmm.host import HostBackend
from vmm.pool import PagePool

log = logging.getLogger("vkv.pool")
DIRECTORY = 0  # the holder id of the name directory; processes are 1, 2, ...
LOOKUP_ANSWER_PAGES = 8192  # page ids in one lookup answer (well inside a datagram); the caller asks again
MAX_CHANGES = 1 << 20  # directory changes kept for `take_changes`; past this the oldest go (counted)
MAX_PROCESSES = 256  # attached at once; more are closed at once (each costs the owner a descriptor)
MAX_PENDING = 64  # connected but not yet through their hello; more are closed at once
HELLO_TIMEOUT = 5.0  # seconds a new connection has to say hello before it is closed
PARK_TIMEOUT = 10.0  # seconds an answer may wait for room in a process's socket. The owner never
# blocks on a send: an answer with no room waits (and its process is not read from) while the owner
# serves the others; a process that leaves it waiting this long is let go (its references released)


PENDING = object()  # a connection's selector data until its hello


class CapReached(ValueError):
    """An alloc past max_pages_per_process."""


def peer_uid(conn: socket.socket) -> int:
    """The connected process's user id (SO_PEERCRED: pid, uid, gid)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    return int.from_bytes(creds[4:8], "little")


def check_meta(meta) -> None:
    """What a published entry says of itself, for the owner's announcements (engine/kv/pool_events.py
    reads it): None, or {"parent": hex name or None, "tokens": ids, "size": n, "lora": name or None}."""
    if meta is None:
        return
    count = lambda x: isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 32  # noqa: E731
    # (token ids and sizes are 32-bit where names chain them; a 2**64 one sank a whole batch of events)
    parent = meta.get("parent") if isinstance(meta, dict) else None
    tokens = meta.get("tokens", []) if isinstance(meta, dict) else None
    if not (isinstance(meta, dict) and set(meta) <= {"parent", "tokens", "size", "lora"}
            and (parent is None or (isinstance(parent, str) and re.fullmatch(r"(?:[0-9a-f]{2}){0,64}", parent)))
            and isinstance(tokens, list) and all(map(count, tokens)) and count(meta.get("size", 0))
            and (meta.get("lora") is None or isinstance(meta["lora"], str))):
        raise ValueError("an entry's meta must be {parent: hex or null, tokens: [ids], size: n, lora: name or null}")


class PoolOwner:
    def __init__(self, backend: Backend, num_pages: int, path: str, announce: bool = False,
                 allowed_uids: frozenset[int] | None = None, max_pages_per_process: int | None = None):
        """announce: log the directory's changes for `take_changes`; allowed_uids: the users whose
        processes may attach (default: this process's own); max_pages_per_process: the most one
        process may hold at once (default: the whole pool). See the note."""
        if max_pages_per_process is not None and not 1 <= max_pages_per_process <= num_pages:
            raise ValueError(f"max_pages_per_process must be in [1, {num_pages}], got {max_pages_per_process}")
        if not isinstance(backend, HostBackend) and not getattr(backend, "shareable", False):
            raise ValueError(f"a pool shared across processes needs the host backend or a CUDA backend made "
                             f"with shareable=True, not {backend.name}")
        if os.path.exists(path):  # a live owner's socket is refused; a dead one's is taken over
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                wire.connect(probe, path, 1.0)
            except (ConnectionRefusedError, FileNotFoundError):  # nobody listens: left by an owner that died
                os.unlink(path)
            except TimeoutError:  # (a full backlog past the probe's second: an owner lives there, busy)
                raise ValueError(f"a pool owner already serves {path} (it accepts no connection now)") from None
            except OSError as exc:  # (not ours to take: another user's socket, not a socket of this kind)
                raise ValueError(f"{path} is in the way of a pool owner's socket ({exc.strerror})") from None
            else:
                raise ValueError(f"a pool owner already serves {path}: processes attached to it would split "
                                 f"across two pools (stop it, or give this one another path)")
            finally:
                probe.close()
        self.pool = PagePool(backend, num_pages)
        self.path = path
        self.holders: list[set[int]] = [set() for _ in range(num_pages)]
        self.held: dict[int, set[int]] = {}  # process -> the pages it holds
        self.pids: dict[int, int] = {}  # process -> its pid (SO_PEERCRED), for logs
        self.directory: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()  # name -> pages, least recently used first
        self.name_of: dict[int, bytes] = {}
        self.evictions = self.recovered = 0  # directory entries evicted; pages released for dead processes
        self.unreferenced = 0  # cached pages no process references: what an alloc may evict
        self.announce = announce
        self.allowed_uids = frozenset(allowed_uids) if allowed_uids is not None else frozenset({os.getuid()})
        self.max_pages_per_process = max_pages_per_process or num_pages
        self.refused = 0  # connections closed: another user's, past a limit, or silent past the hello deadline
        self.changes: deque[tuple] = deque()  # ("stored", name, meta) / ("removed", name), oldest first
        self.announced: set[bytes] = set()  # names logged as stored and not yet as removed
        self.changes_dropped = 0
        self._next_id = DIRECTORY + 1
        self._stopping = threading.Event()
        self.lock = threading.Lock()  # the loop's steps, and stats/audit from other threads
        self._thread: threading.Thread | None = None
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        private = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"  # bound, made 0600, then moved into place
        try:
            self._listener.bind(private)  # (another allowed user must reach it: SO_PEERCRED admits by uid then)
            os.chmod(private, 0o600 if self.allowed_uids == {os.getuid()} else 0o666)
            os.rename(private, path)
        except BaseException:
            self._listener.close()
            if os.path.exists(private):
                os.unlink(private)
            raise
        self._listener.listen(64)

    # -- the loop ------------------------------------------------------------------------
    def start(self) -> PoolOwner:
        """Serve from a background thread."""
        self._thread = threading.Thread(target=self.serve, name="vkv-pool-owner", daemon=True)
        self._thread.start()
        return self

    def serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ, None)
        conns: dict[socket.socket, int] = {}
        pending: dict[socket.socket, float] = {}  # connected, hello not yet heard: since when
        parked: dict[socket.socket, tuple[dict, list[int], float]] = {}  # answers waiting for room
        refusing = False  # accept failing (said once until it works again)

        def refuse(conn: socket.socket, why: str) -> None:
            self.refused += 1
            if self.refused == 1 or self.refused % 100 == 0:
                log.warning("vkv: the pool's owner closed a connection (%s; %d so far)", why, self.refused)
            if pending.pop(conn, None) is not None:
                selector.unregister(conn)
            conn.close()

        def drop(conn: socket.socket) -> None:
            client = conns.pop(conn)
            selector.unregister(conn)
            conn.close()
            for fd in parked.pop(conn, (None, [], 0))[1]:
                os.close(fd)
            with self.lock:
                self._leave(client)

        def deliver(conn: socket.socket, answer: dict, fds: list[int], since: float) -> None:
            """Send now, or park the answer (fds kept open) and read nothing more from conn until
            it is sent. Exported copies are closed once sent."""
            try:
                wire.send(conn, answer, fds)
            except BlockingIOError:
                parked[conn] = (answer, fds, since)
                selector.modify(conn, selectors.EVENT_WRITE, conns[conn])
                return
            except ValueError as exc:  # too large for one datagram: said, not fatal
                for fd in fds:
                    os.close(fd)
                deliver(conn, {"error": "ValueError", "message": str(exc)}, [], since)
                return
            for fd in fds:
                os.close(fd)
            if parked.pop(conn, None) is not None:
                selector.modify(conn, selectors.EVENT_READ, conns[conn])

        try:
            while not self._stopping.is_set():
                for key, events in selector.select(timeout=0.1):
                    if key.data is None:
                        try:
                            conn, _ = self._listener.accept()
                        except OSError as exc:  # out of descriptors (EMFILE): the owner goes on
                            if not refusing:
                                log.warning("vkv: the pool's owner cannot accept a process now: %s", exc)
                            refusing = True
                            time.sleep(0.05)
                            continue
                        refusing = False
                        uid = peer_uid(conn)
                        if uid not in self.allowed_uids:  # it reads the end at once: refused
                            refuse(conn, f"uid {uid} is not allowed to attach")
                        else:
                            if len(pending) >= MAX_PENDING:  # the longest silent makes room: an engine says
                                refuse(min(pending, key=pending.get), "silent while others wait")  # hello at once
                            conn.setblocking(False)  # see PARK_TIMEOUT
                            pending[conn] = time.monotonic()
                            selector.register(conn, selectors.EVENT_READ, PENDING)
                        continue
                    conn, client = key.fileobj, key.data
                    if client is PENDING:  # its first message must be hello, and room must remain
                        try:
                            message, _ = wire.receive(conn)
                        except (wire.WireError, BlockingIOError, OSError):
                            refuse(conn, "gone before its hello")
                            continue
                        if message.get("op") != "hello":
                            refuse(conn, f"{message.get('op')!r} before hello")
                            continue
                        if len(conns) >= MAX_PROCESSES:
                            refuse(conn, f"{MAX_PROCESSES} processes attached")
                            continue
                        del pending[conn]
                        with self.lock:
                            conns[conn] = client = self._join(conn)
                            answer, fds = self._answer(client, message)
                        selector.modify(conn, selectors.EVENT_READ, client)
                        deliver(conn, answer, [os.dup(fd) for fd in fds], time.monotonic())
                        continue
                    try:
                        if conn in parked:  # room at last for the answer it waits for
                            deliver(conn, *parked[conn])
                            continue
                        message, _ = wire.receive(conn)
                        with self.lock:
                            answer, fds = self._answer(client, message)
                        if message.get("op") != "export":
                            fds = [os.dup(fd) for fd in fds]  # (kept open until sent; the owner keeps its own)
                        deliver(conn, answer, fds, time.monotonic())
                    except Exception as exc:  # gone, a bug, or a process that speaks nonsense: it alone is let go
                        if not isinstance(exc, (wire.WireError, BlockingIOError)):
                            log.exception("vkv: pool process %d: %s", client, exc)
                        drop(conn)
                now = time.monotonic()
                for conn in [c for c, since in pending.items() if now - since > HELLO_TIMEOUT]:
                    refuse(conn, f"no hello within {HELLO_TIMEOUT:g} s")
                for conn in [c for c, (_, _, since) in parked.items() if now - since > PARK_TIMEOUT]:
                    log.warning("vkv: pool process %d has not read its answer for %.0f s: let go", conns[conn],
                                now - parked[conn][2])
                    drop(conn)
        finally:
            for conn in list(conns):
                drop(conn)
            for conn in list(pending):
                refuse(conn, "the owner stops")
            selector.close()

    @property
    def serving(self) -> bool:
        """Serving from its thread (start()), and not asked to stop."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def request_stop(self) -> None:
        """Ask `serve` to return (from a signal handler or another thread)."""
        self._stopping.set()

    def stop(self) -> None:
        """Stop serving (every process's references go) and give the pages back."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._listener.close()
        if os.path.exists(self.path):
            os.unlink(self.path)
        for name in list(self.directory):
            self._uncache(name)
        self.pool.close()
        self.pool.backend.close()

    def _join(self, conn: socket.socket) -> int:
        client, self._next_id = self._next_id, self._next_id + 1
        self.held[client] = set()
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        self.pids[client] = int.from_bytes(creds[:4], "little")
        return client

    def _leave(self, client: int) -> None:
        """A process went away (closed, or died): every reference it held goes."""
        pages = self.held.pop(client, set())
        for page in pages:
            self._release(client, page)
        self.recovered += len(pages)
        if pages:
            log.info("vkv: pool process %d (pid %s) left holding %d pages: released", client,
                     self.pids.get(client), len(pages))
        self.pids.pop(client, None)

    # -- the verbs -----------------------------------------------------------------------
    def _answer(self, client: int, m: dict) -> tuple[dict, list[int]]:
        op = m.get("op")
        try:
            if op == "hello":
                hello = {"backend": self.pool.backend.name, "page_size": self.pool.page_size,
                         "num_pages": self.pool.num_pages, "process": client, "announce": self.announce}
                if isinstance(self.pool.backend, HostBackend):  # one file holds every page: slots in it
                    return {**hello, "handles": consecutive_runs(self.pool.handles)}, [self.pool.backend.fd]
                return hello, []
            if op == "export":
                return {"start": int(m["start"])}, self._export(int(m["start"]), int(m["count"]))
            if op == "alloc":
                try:
                    return {"pages": self._alloc(client, int(m["n"])), "free": self.pool.num_free}, []
                except CapReached as exc:  # exhaustion for this process: it preempts or waits, as for a full pool
                    return {"pages": [], "free": self.pool.num_free, "capped": str(exc)}, []
            if op == "drop":
                for page in m["pages"]:
                    self._give_up(client, int(page))
                return {"free": self.pool.num_free}, []
            if op == "publish":  # entries: [name, pages] or [name, pages, meta]
                return {"published": [self._publish(client, bytes.fromhex(e[0]), tuple(map(int, e[1])),
                                                    e[2] if len(e) > 2 else None)
                                      for e in m["entries"]]}, []
            if op == "lookup":
                names = [bytes.fromhex(n) for n in m["names"]]
                found = self._lookup(client, names)
                full = len(found) < len(names) and names[len(found)] in self.directory  # ask again from there
                return {"pages": found, "full": full}, []
            if op == "take":
                return {"pages": self._take(client, bytes.fromhex(m["name"]))}, []
            if op == "stats":
                return self._stats(), []
            if op == "audit":
                self._audit({client: {int(p) for p in m["held"]}})
                return {"ok": True}, []
        except (KeyError, TypeError, ValueError, VmmError) as exc:  # a driver error too: said, not fatal
            return {"error": type(exc).__name__, "message": str(exc)}, []
        return {"error": "ValueError", "message": f"unknown op {op!r}"}, []

    def _export(self, start: int, count: int) -> list[int]:
        """Descriptors for pages start .. start + count of a CUDA pool (all, or none and the error)."""
        if isinstance(self.pool.backend, HostBackend):
            raise ValueError("a host pool's pages come with hello, in one descriptor")
        if not (0 <= start < self.pool.num_pages and 1 <= count <= wire.FD_BATCH):
            raise ValueError(f"export of pages [{start}, {start + count}) of {self.pool.num_pages}, "
                             f"at most {wire.FD_BATCH} at once")
        fds: list[int] = []
        try:
            for handle in self.pool.handles[start:start + count]:
                fds.append(self.pool.backend.export_page(handle))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def _alloc(self, client: int, n: int) -> list[int]:
        if not 1 <= n <= self.pool.num_pages:
            raise ValueError(f"alloc n must be in [1, {self.pool.num_pages}], got {n}")
        if len(self.held[client]) + n > self.max_pages_per_process:
            raise CapReached(f"this process holds {len(self.held[client])} pages; {n} more pass the "
                             f"{self.max_pages_per_process} one process may hold")
        if self.pool.num_free + self.unreferenced < n:  # eviction could not make the room: none of it
            return []
        if self.pool.num_free < n:
            self._evict(n)
        pages = self.pool.alloc_many(n) if self.pool.num_free >= n else []
        for page in pages:
            self._add(page, client)
            self.held[client].add(page)
        return pages

    def _give_up(self, client: int, page: int) -> None:
        if page not in self.held[client]:
            raise ValueError(f"page {page} is not held by this process")
        self.held[client].discard(page)
        self._release(client, page)

    def _add(self, page: int, holder: int) -> None:
        """One more holder of page (the one place holders grow, so `unreferenced` stays true)."""
        self.unreferenced -= self.holders[page] == {DIRECTORY}
        self.holders[page].add(holder)

    def _release(self, holder: int, page: int) -> None:
        """One holder less (the one place holders shrink); the last one frees the page."""
        self.unreferenced -= self.holders[page] == {DIRECTORY}
        self.holders[page].discard(holder)
        self.unreferenced += self.holders[page] == {DIRECTORY}
        self.pool.drop(page)

    def _publish(self, client: int, name: bytes, pages: tuple[int, ...], meta: dict | None = None) -> bool:
        """Cache a sealed entry under its name (the directory takes a reference on each page);
        False if the name, or one of its pages, is known already (the caller's stay its own).
        meta: what to announce of it (see the note), or None."""
        if not pages or any(page not in self.held[client] for page in pages):
            raise ValueError(f"pages {list(pages)[:8]} are not all held by this process")
        if len(set(pages)) != len(pages):
            raise ValueError(f"an entry lists a page twice: {list(pages)[:8]}")
        check_meta(meta)
        if name in self.directory or any(page in self.name_of for page in pages):
            return False
        self.directory[name] = pages
        for page in pages:
            self.name_of[page] = name
            self._add(page, DIRECTORY)
            self.pool.hold(page)
        if self.announce and meta is not None:
            self._log(("stored", name, meta))
            self.announced.add(name)
        return True

    def _lookup(self, client: int, names: list[bytes]) -> list[tuple[int, ...]]:
        """The entries of the longest prefix of names the directory has, each page now also
        held by the caller (at most one reference per process)."""
        found, budget = [], LOOKUP_ANSWER_PAGES
        for name in names:
            pages = self.directory.get(name)
            if pages is None or len(pages) > budget:  # the rest in the caller's next message
                break
            budget -= len(pages)
            self.directory.move_to_end(name)
            for page in pages:
                if page not in self.held[client]:
                    self.held[client].add(page)
                    self._add(page, client)
                    self.pool.hold(page)
            found.append(pages)
        return found

    def _take(self, client: int, name: bytes) -> tuple[int, ...] | None:
        """A cached entry handed to one process whole: out of the directory, its pages held by
        the caller alone, who may write them (nobody can find them any more). None if the name is
        unknown or a process maps one of its pages (then it is only for lookups)."""
        pages = self.directory.get(name)
        if pages is None or any(self.holders[page] != {DIRECTORY} for page in pages):
            return None
        for page in pages:
            self.held[client].add(page)
            self._add(page, client)
            self.pool.hold(page)
        self._uncache(name)
        return pages

    def _evict(self, need: int) -> None:
        """Free least recently used cached entries that no process references until `need`
        pages are free."""
        for name in list(self.directory):
            if self.pool.num_free >= need:
                return
            if all(self.holders[page] == {DIRECTORY} for page in self.directory[name]):
                self._uncache(name)
                self.evictions += 1

    def _uncache(self, name: bytes) -> None:
        for page in self.directory.pop(name):
            del self.name_of[page]
            self._release(DIRECTORY, page)
        if name in self.announced:
            self.announced.discard(name)
            self._log(("removed", name))

    def _log(self, change: tuple) -> None:
        if len(self.changes) >= MAX_CHANGES:  # nobody takes them: the oldest go, counted
            self.changes.popleft()
            self.changes_dropped += 1
        self.changes.append(change)

    def take_changes(self) -> list[tuple]:
        """The directory's changes since the last call, oldest first (with announce=True)."""
        with self.lock:
            changes, self.changes = list(self.changes), deque()
            return changes

    # -- numbers and the audit -------------------------------------------------------------
    def stats(self) -> dict:
        with self.lock:
            return self._stats()

    def _stats(self) -> dict:
        return {"free": self.pool.num_free, "total": self.pool.num_pages, "cached": self.unreferenced,
                "obtainable": self.pool.num_free + self.unreferenced,
                "named": len(self.directory), "processes": len(self.held), "evictions": self.evictions,
                "refused": self.refused,
                "recovered": self.recovered,
                "held": {str(self.pids.get(c, c)): len(p) for c, p in self.held.items()}}

    def audit(self, claims: dict[int, set[int]] | None = None) -> None:
        """Every page free, held by a process, or cached; its count equals its holders; the
        directory and each process's record agree; a process's claim (the pages it says it
        references) equals the owner's record of it."""
        with self.lock:
            self._audit(claims)

    def _audit(self, claims: dict[int, set[int]] | None = None) -> None:
        expected = {page: len(h) for page, h in enumerate(self.holders) if h}
        self.pool.check(expected)
        unreferenced = sum(1 for holders in self.holders if holders == {DIRECTORY})
        if unreferenced != self.unreferenced:
            raise InvariantViolation(f"{unreferenced} cached pages no process references, counted {self.unreferenced}")
        for client, pages in self.held.items():
            for page in pages:
                if client not in self.holders[page]:
                    raise InvariantViolation(f"process {client} holds page {page}, which does not list it")
        for page, holders in enumerate(self.holders):
            for holder in holders - {DIRECTORY}:
                if page not in self.held.get(holder, ()):
                    raise InvariantViolation(f"page {page} lists process {holder}, which is gone or does not hold it")
            if (DIRECTORY in holders) != (page in self.name_of):
                raise InvariantViolation(f"page {page}: the directory's reference and its name disagree")
        for name, pages in self.directory.items():
            for page in pages:
                if self.name_of.get(page) != name:
                    raise InvariantViolation(f"page {page}: named twice or not at all")
        for client, claim in (claims or {}).items():
            if claim != self.held.get(client, set()):
                extra, missing = claim - self.held.get(client, set()), self.held.get(client, set()) - claim
                raise InvariantViolation(f"process {client} references pages the owner does not record "
                                         f"({sorted(extra)[:5]}) or not those it records ({sorted(missing)[:5]})")
