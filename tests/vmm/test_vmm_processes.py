"""One physical pool across processes (vmm/owner.py, vmm/attach.py): pages computed in one
process are read in place in another, references are counted over all of them, and a process
that dies gives every reference back at once. Each test runs over host pages (one memfd) and
over CUDA pages exported and imported one by one (vkv's CudaBackend over the real driver, or
over the driver emulator where there is no GPU)."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conftest import BACKENDS, cuda_unavailable, make_cuda_backend
from helpers import TESTS, child_env
from vmm import HostBackend, Reservation
from vmm.attach import AttachedPool, OwnerError
from vmm.errors import PoolExhausted
from vmm.owner import PoolOwner

PAGE = 4096  # host pages; CUDA pages are the driver's granularity
HELPER = TESTS / "pool_process.py"


def owner_backend(kind: str):
    return HostBackend(PAGE) if kind == "host" else make_cuda_backend(shareable=True)


@pytest.fixture(params=BACKENDS)
def owner(tmp_path, request):
    owner = PoolOwner(owner_backend(request.param), 16, str(tmp_path / "pool.sock")).start()
    owner.kind = request.param
    yield owner
    owner.stop()


def attach(owner) -> AttachedPool:
    """This process attached to the owner's pool: a CUDA pool's pages imported through a CUDA
    backend of its own."""
    return AttachedPool(owner.path, None if owner.kind == "host" else make_cuda_backend())


def spawn(owner):
    env = child_env(str(TESTS))
    return subprocess.Popen([sys.executable, str(HELPER), owner.path, owner.kind], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


def ask(proc, line: str) -> list[str]:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().split()


def eventually(predicate, seconds: float) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < seconds, "not within the bound"
        time.sleep(0.005)
    return time.monotonic() - start


def test_a_page_written_in_one_process_is_read_in_place_by_another(owner):
    a, b = spawn(owner), spawn(owner)
    try:
        _, page = ask(a, "write prefix-0 42")
        assert ask(b, "read prefix-0") == ["value", "42"]
        assert ask(b, "read nothing-here") == ["missing"]
        # one physical page, two processes holding it, the directory caching it: nothing copied
        assert owner.holders[int(page)] == {0, *owner.held} and len(owner.held) == 2
        assert owner.pool.num_free == 15
        owner.audit()
        for proc in (a, b):  # leaving unmaps and releases everything the process imported
            assert ask(proc, "leave") in (["driver", "0", "0", "0"], ["driver", "uncounted"])
        eventually(lambda: not owner.held, 1.0)
        owner.audit()
        assert owner.pool.num_free == 15 and owner.stats()["cached"] == 1
    finally:
        a.kill(), b.kill()
        a.wait(), b.wait()


def test_a_process_killed_mid_work_gives_every_reference_back_within_a_second(owner):
    a, b = spawn(owner), spawn(owner)
    try:
        for i in range(5):
            ask(a, f"write p{i} {i + 1}")
        assert ask(b, "read p0") == ["value", "1"]
        assert ask(a, "held") == ["held", "5"]
        killed = time.monotonic()
        os.kill(a.pid, signal.SIGKILL)
        eventually(lambda: len(owner.held) == 1, 1.0)
        took = time.monotonic() - killed
        owner.audit()
        # its published pages stay cached (their bytes are whole); only b's reference remains on p0
        assert owner.stats()["cached"] == 4 and owner.stats()["named"] == 5 and owner.recovered == 5
        assert owner.pool.num_free == 11
        assert ask(b, "read p3") == ["value", "4"]  # read in place after its writer died
        print(f"references of the killed process back in {took * 1e3:.1f} ms")
    finally:
        a.kill(), b.kill()
        a.wait(), b.wait()


def test_a_looked_up_page_is_copied_before_any_write(owner):
    mine, theirs = attach(owner), attach(owner)
    PAGE = mine.page_size
    try:
        r = Reservation(mine, PAGE)
        r.map_new(0)
        r.view(torch.uint8, (PAGE,)).fill_(7)
        mine.publish([(b"sealed", (r.page_at(0),))])
        assert mine.ref_counts[r.page_at(0)] == 2  # others may read it: not writable in place
        s = Reservation(theirs, PAGE)
        (page,), = theirs.lookup([b"sealed"])
        s.map(0, page)
        theirs.drop(page)
        assert s.copy_on_write(0) != page  # a private copy, the published page untouched
        s.view(torch.uint8, (PAGE,)).fill_(9)
        assert int(r.view(torch.uint8, (PAGE,))[0]) == 7
        s.release(), r.release()
        owner.audit()
        assert owner.stats()["cached"] == 1
    finally:
        mine.close(), theirs.close()


def test_cached_pages_nobody_maps_are_evicted_least_recently_used_first(owner):
    pool = attach(owner)
    PAGE = pool.page_size
    try:
        ranges = []
        for i in range(16):
            r = Reservation(pool, PAGE)
            r.map_new(0)
            pool.publish([(f"n{i}".encode(), (r.page_at(0),))])
            ranges.append(r)
        with pytest.raises(PoolExhausted):
            pool.alloc()  # every page mapped: nothing to evict
        for r in ranges[:8]:
            r.release()
        pool.lookup([b"n0"])  # n0 used again: n1 is now the least recently used
        got = pool.alloc_many(2)
        assert owner.evictions == 2 and b"n1" not in owner.directory and b"n0" in owner.directory
        for page in got + list(owner.directory[b"n0"]):
            pool.drop(page)
        for r in ranges[8:]:
            r.release()
        pool.audit([])
    finally:
        pool.close()


def test_the_owner_refuses_what_a_process_does_not_hold(owner):
    pool = attach(owner)
    try:
        with pytest.raises(OwnerError, match="not held"):
            pool._ask({"op": "drop", "pages": [3]})
        with pytest.raises(OwnerError, match="unknown op"):
            pool._ask({"op": "format-disk"})
        owner.audit()
    finally:
        pool.close()


def test_no_process_can_wedge_break_or_flush_the_owner_for_the_others(owner, monkeypatch):
    """A review's reproducers: a process that never reads its answers is let go instead of
    stalling the owner's one thread; an entry listing a page twice, or with a malformed meta, is
    refused; an alloc that eviction could not satisfy evicts nothing; more processes than the
    owner takes are closed, and the owner goes on."""
    import socket

    from vmm import owner as owner_module

    pool, other = attach(owner), attach(owner)
    try:
        evil = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        evil.connect(owner.path)
        evil.settimeout(0.2)
        with pytest.raises(OSError):  # reset once the owner gave up on it, or its own buffer full
            for _ in range(100_000):
                evil.send(b'{"op":"stats"}')
        start = time.monotonic()
        assert pool.alloc_many(1) and time.monotonic() - start < 5  # the owner answers the others
        idle = []  # connections that fill their sockets and never read: the owner never waits on one
        for _ in range(6):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(owner.path)
            s.setblocking(False)
            try:
                for _ in range(20_000):
                    s.send(b'{"op":"stats"}')
            except OSError:
                pass
            idle.append(s)
        worst = 0.0
        for _ in range(200):
            start = time.monotonic()
            pool.owner_stats()
            worst = max(worst, time.monotonic() - start)
        assert worst < 0.5, worst  # (each non-reading connection cost the owner 1 s a round before)
        for s in idle:
            s.close()
        page = pool.alloc_many(1)[0]
        with pytest.raises(OwnerError, match="twice"):
            pool._ask({"op": "publish", "entries": [["aa", [page, page]]]})
        with pytest.raises(OwnerError, match="meta"):
            pool._ask({"op": "publish", "entries": [["ab", [page], "not a dict"]]})
        with pytest.raises(OwnerError, match="meta"):  # (past 64 bits it sank a whole batch of KV events)
            pool._ask({"op": "publish", "entries": [["ab", [page], {"tokens": [2 ** 64]}]]})
        owner.audit()
        assert pool._ask({"op": "publish", "entries": [["ac", [page]]]})[0]["published"] == [True]
        pool.drop_many([page])  # cached now, held by nobody: evictable
        before = owner.stats()
        with pytest.raises(PoolExhausted):
            other.alloc_many(owner.pool.num_pages)  # more than free + evictable (one page is held)
        assert owner.stats()["cached"] == before["cached"]  # and nothing was evicted for it
        second = owner_backend(owner.kind)
        with pytest.raises(ValueError, match="already serves"):  # a second owner on a live owner's path
            PoolOwner(second, 4, owner.path)
        second.close()
        monkeypatch.setattr(owner_module, "MAX_PROCESSES", 2)  # pool and other: a third is closed
        backend = None if owner.kind == "host" else make_cuda_backend()
        with pytest.raises(OwnerError):
            AttachedPool(owner.path, backend)
        assert backend is None or not backend._scratch  # closed by the refused attach, context and all
        assert pool.alloc_many(1)
        owner.audit()
    finally:
        pool.close()
        other.close()


class CrossProcessTraffic(RuleBasedStateMachine):
    """Processes (each its own connection, as separate processes are) allocate, publish, look
    up, copy on write, release, and die without a word; after every step each page is free,
    held or cached, its count equals its holders over all processes, every process's own count
    equals its mappings, and a name always reads the bytes it was published with."""

    kind = "host"

    def __init__(self):
        super().__init__()
        import tempfile
        self.dir = tempfile.mkdtemp()
        self.owner = PoolOwner(owner_backend(self.kind), 12, os.path.join(self.dir, "pool.sock")).start()
        self.owner.kind = self.kind
        self.page = self.owner.pool.page_size
        self.procs: list[tuple[AttachedPool, list[Reservation]]] = []
        self.names: dict[bytes, int] = {}  # name -> the byte its page holds
        self.counter = 0

    def teardown(self):
        for pool, ranges in self.procs:
            for r in ranges:
                r.release()
            pool.close()
        self.owner.stop()

    @precondition(lambda self: len(self.procs) < 4)
    @rule()
    def join(self):
        self.procs.append((attach(self.owner), []))

    @precondition(lambda self: self.procs)
    @rule(i=st.integers(0, 3), publish=st.booleans())
    def write(self, i, publish):
        pool, ranges = self.procs[i % len(self.procs)]
        r = Reservation(pool, self.page)
        try:
            r.map_new(0)
        except PoolExhausted:
            r.release()
            return
        self.counter += 1
        value = self.counter % 251
        r.view(torch.uint8, (self.page,)).fill_(value)
        ranges.append(r)
        if publish:
            name = f"page-{self.counter}".encode()
            pool.publish([(name, (r.page_at(0),))])
            self.names[name] = value

    @precondition(lambda self: self.procs and self.names)
    @rule(i=st.integers(0, 3), pick=st.integers(0, 1000), write=st.booleans())
    def read(self, i, pick, write):
        pool, ranges = self.procs[i % len(self.procs)]
        name = sorted(self.names)[pick % len(self.names)]
        found = pool.lookup([name])
        if not found:  # evicted meanwhile
            return
        pages = found[0]
        r = Reservation(pool, self.page)
        r.map(0, pages[0])
        pool.drop(pages[0])
        assert int(r.view(torch.uint8, (self.page,))[0]) == self.names[name]
        if write:
            try:
                r.copy_on_write(0)
            except PoolExhausted:
                pass
            else:
                r.view(torch.uint8, (self.page,)).fill_(0)
        ranges.append(r)

    @precondition(lambda self: self.procs and self.names)
    @rule(i=st.integers(0, 3), pick=st.integers(0, 1000))
    def take(self, i, pick):
        """A named page handed whole to one process (a handoff's last page): it leaves the
        directory, and its taker, its one holder, writes on it in place."""
        pool, ranges = self.procs[i % len(self.procs)]
        name = sorted(self.names)[pick % len(self.names)]
        mapped = any(p.local[page] for p, _ in self.procs for page in self.owner.directory.get(name, ()))
        pages = pool.take(name)
        if pages is None:  # evicted meanwhile, or a process maps it
            assert name not in self.owner.directory or mapped
            return
        value = self.names.pop(name)
        assert name not in self.owner.directory and pool.ref_counts[pages[0]] == 1  # writable in place
        r = Reservation(pool, self.page)
        r.map(0, pages[0])
        pool.drop(pages[0])
        assert int(r.view(torch.uint8, (self.page,))[0]) == value
        r.view(torch.uint8, (self.page,)).fill_(0)
        ranges.append(r)

    @precondition(lambda self: any(ranges for _, ranges in self.procs))
    @rule(i=st.integers(0, 3), j=st.integers(0, 100))
    def release(self, i, j):
        live = [p for p in self.procs if p[1]]
        pool, ranges = live[i % len(live)]
        ranges.pop(j % len(ranges)).release()

    @precondition(lambda self: self.procs)
    @rule(i=st.integers(0, 3))
    def die(self, i):
        """The process is gone without a word: its socket closes, its mappings vanish with it."""
        pool, ranges = self.procs.pop(i % len(self.procs))
        pool._sock.close()
        for r in ranges:  # what the kernel (the driver) does to a dead process's address space
            r._finalizer.detach()
            if self.kind != "host":
                pool.backend.unmap(r.addr, r.nbytes)
            pool.backend.free_reservation(r.addr, r.nbytes)
        if self.kind != "host":  # ... and to its imported handles
            pool._release_imported()
            pool.backend.close()
        eventually(lambda: pool.process not in self.owner.held, 1.0)

    @invariant()
    def whole(self):
        for pool, ranges in self.procs:
            pool.audit(ranges)
        self.owner.audit()
        for name, (page,) in self.owner.directory.items():
            holder = next(((pool, page) for pool, _ in self.procs if pool.local[page]), None)
            if holder is not None:
                r = Reservation(holder[0], self.page)
                r.map(0, page)
                assert int(r.view(torch.uint8, (self.page,))[0]) == self.names[name]
                r.release()


TestCrossProcessTraffic = CrossProcessTraffic.TestCase
TestCrossProcessTraffic.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])


class CrossProcessTrafficCuda(CrossProcessTraffic):
    """The same traffic over CUDA pages, exported by the owner and imported by each process."""
    kind = "cuda"


TestCrossProcessTrafficCuda = pytest.mark.cuda_emulated(pytest.mark.skipif(
    cuda_unavailable() is not None, reason=f"no CUDA backend: {cuda_unavailable()}")(CrossProcessTrafficCuda.TestCase))
TestCrossProcessTrafficCuda.settings = settings(max_examples=20, stateful_step_count=30, deadline=None,
                                                suppress_health_check=[HealthCheck.too_slow])


def test_lookups_and_allocs_larger_than_one_message_go_in_parts(tmp_path):
    owner = PoolOwner(HostBackend(PAGE), 6000, str(tmp_path / "big.sock")).start()
    pool = AttachedPool(owner.path)
    try:
        pages = pool.alloc_many(5000)  # two answers
        names = [f"entry-{i:05d}".encode() * 4 for i in range(2500)]
        pool.publish([(n, (p,)) for n, p in zip(names, pages[:2500])])
        found = pool.lookup(names + [b"absent"])  # 20 messages, the last one short
        assert [p for (p,) in found] == pages[:2500]
        for page in pages + pages[:2500]:
            pool.drop(page)
        pool.audit([])
        owner.audit()
    finally:
        pool.close()
        owner.stop()


def test_an_owner_that_stops_answering_is_an_error_not_a_hang(tmp_path, monkeypatch):
    """An owner that hangs (stopped, not dead: its socket stays open) is an OwnerError within the
    timeout, not a process blocked for ever."""
    import socket

    import vmm.attach
    monkeypatch.setattr(vmm.attach, "OWNER_TIMEOUT", 0.2)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    silent.bind(str(tmp_path / "silent.sock"))
    silent.listen(1)  # connections are queued, never answered
    try:
        started = time.monotonic()
        with pytest.raises(OwnerError, match="gone"):
            AttachedPool(str(tmp_path / "silent.sock"))
        assert time.monotonic() - started < 5
    finally:
        silent.close()
