"""Who may use a pool several processes share, and how much (Note [Pool across processes],
Admission): only its user's processes, through a socket that is 0600 from the moment it exists;
a connection that never says hello is closed and never counts toward the limit, so idle
connections cannot keep an engine out; one process cannot hold more than its cap."""
import os
import socket
import stat
import threading
import time

import pytest

import vmm
from vmm import owner as owner_module
from vmm import wire
from vmm.attach import AttachedPool, OwnerError


def start(tmp_path, **options) -> vmm.PoolOwner:
    return vmm.PoolOwner(vmm.HostBackend(4096), 32, str(tmp_path / "pool.sock"), **options).start()


def test_the_socket_is_0600_from_the_start_and_nothing_else_is_left(tmp_path):
    owner = start(tmp_path)
    try:
        assert stat.S_IMODE(os.stat(owner.path).st_mode) == 0o600
        assert os.listdir(tmp_path) == ["pool.sock"]  # (bound under a private name, then moved)
    finally:
        owner.stop()
    assert os.listdir(tmp_path) == []


def test_a_process_of_a_user_not_allowed_is_refused(tmp_path):
    owner = start(tmp_path, allowed_uids=frozenset({os.getuid() + 12345}))
    try:
        with pytest.raises(OwnerError, match="gone"):
            AttachedPool(owner.path)
        assert owner.stats()["refused"] == 1 and owner.stats()["processes"] == 0
    finally:
        owner.stop()


def test_silent_connections_are_closed_and_never_keep_an_engine_out(tmp_path, monkeypatch):
    monkeypatch.setattr(owner_module, "HELLO_TIMEOUT", 0.5)
    monkeypatch.setattr(owner_module, "MAX_PROCESSES", 2)
    owner = start(tmp_path)
    idle = []
    try:
        for _ in range(owner_module.MAX_PENDING + 20):  # more than may wait: the rest closed at once
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.connect(owner.path)
            idle.append(sock)
        pool = AttachedPool(owner.path)  # attached past them all: they are not processes
        assert owner.stats()["processes"] == 1
        time.sleep(1.0)
        assert all(sock.recv(1) == b"" for sock in idle)  # the owner closed every one
        assert owner.stats()["refused"] >= len(idle)
        pool.close()
    finally:
        for sock in idle:
            sock.close()
        owner.stop()


def test_one_process_cannot_hold_more_than_its_cap(tmp_path):
    owner = start(tmp_path, max_pages_per_process=20)
    greedy, other = AttachedPool(owner.path), AttachedPool(owner.path)
    try:
        held = greedy.alloc_many(20)
        with pytest.raises(vmm.PoolExhausted, match="the 20 one process may hold"):
            greedy.alloc()
        assert len(other.alloc_many(12)) == 12  # the rest of the pool is the other's
        greedy.drop_many(held)
        owner.audit()
    finally:
        greedy.close()
        other.close()
        owner.stop()
    with pytest.raises(ValueError, match="max_pages_per_process"):
        start(tmp_path, max_pages_per_process=33)


def test_a_full_backlog_is_waited_for_within_the_deadline_and_never_taken_for_a_dead_owner(tmp_path):
    path = str(tmp_path / "busy.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(0)  # a backlog of one: the second connection finds it full
    waiting = []
    try:
        while True:  # fill it (a connect with a deadline then fails at once with EAGAIN)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.setblocking(False)
            try:
                sock.connect(path)
            except BlockingIOError:
                sock.close()
                break
            waiting.append(sock)
        with pytest.raises(ValueError, match="already serves"):  # busy, not dead: its socket is kept
            vmm.PoolOwner(vmm.HostBackend(4096), 4, path)
        assert os.path.exists(path)
        late = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with pytest.raises(TimeoutError, match="accepted no connection within 0.2 s"):
            wire.connect(late, path, 0.2)
        late.close()
        accepted = []
        threading.Timer(0.2, lambda: accepted.append(listener.accept()[0])).start()  # room, later
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        started = time.monotonic()
        wire.connect(sock, path, 5.0)
        assert 0.15 < time.monotonic() - started < 4.0
        waiting.append(sock)
        time.sleep(0.05)
        waiting.extend(accepted)
    finally:
        for sock in waiting:
            sock.close()
        listener.close()
