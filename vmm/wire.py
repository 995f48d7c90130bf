"""The pool owner's wire: one message per datagram on a Unix SOCK_SEQPACKET socket.

A message is a JSON object (page names travel as hex); file descriptors travel beside it
(SCM_RIGHTS): the host pool's memfd with the first answer, a CUDA pool's exported pages
FD_BATCH to an answer, so the other process maps the very same physical pages. SOCK_SEQPACKET
keeps message boundaries and tells the owner at once when a process is gone (its end reads
empty), which is how references of a dead process come back.
"""
from __future__ import annotations

import json
import socket
import time

MAX_MESSAGE = 128 << 10  # one datagram; the kernel's default socket buffer (212,992 bytes) bounds it
FD_BATCH = 250  # descriptors in one message (the kernel passes at most 253: SCM_MAX_FD)


class WireError(ConnectionError):
    """The other end went away, or sent what is not a message."""


def connect(sock: socket.socket, path: str, timeout: float) -> None:
    """Connect `sock` to the owner at `path` within `timeout` seconds. A Unix socket whose listen
    backlog is full refuses a connect with a deadline at once (EAGAIN, not EINPROGRESS: the kernel
    has no half-open state for it to wait in), so a burst of other connections would otherwise fail
    an engine's attach; it is tried again until the deadline. A path nobody listens on
    (ConnectionRefusedError, FileNotFoundError) fails at once."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() + pause > deadline:
                raise TimeoutError(f"the pool's owner at {path} accepted no connection within {timeout:g} s") from None
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"a {len(data)}-byte message is over the wire's {MAX_MESSAGE}")
    try:
        if fds:
            socket.send_fds(sock, [data], list(fds))
        else:
            sock.send(data)
    except BlockingIOError:  # a non-blocking socket with no room: the caller waits for it
        raise
    except OSError as exc:
        raise WireError(f"the other end went away: {exc}") from exc


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict, list[int]]:
    """One message (and the descriptors that came with it); WireError if the other end is gone."""
    try:
        if max_fds:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, max_fds)
        else:
            data, fds = sock.recv(MAX_MESSAGE), []
    except OSError as exc:
        raise WireError(f"the other end went away: {exc}") from exc
    if not data:
        raise WireError("the other end closed the connection")
    try:
        message = json.loads(data)
    except ValueError as exc:
        raise WireError("not a message") from exc
    if not isinstance(message, dict):
        raise WireError("not a message")
    return message, fds
