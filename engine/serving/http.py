"""The HTTP guard rails in front of the app: bounded bodies, read deadlines, idle connections.

`BodyGuard` (ASGI middleware) reads a request's whole body before the app sees it: over the
limit, declared or streamed, is a 413; a body that does not arrive within the deadline (a
Content-Length larger than what is sent, a client trickling bytes) is a 408; Content-Length
together with Transfer-Encoding, or a body that is not UTF-8, is a 400. Errors carry OpenAI's
error object.

`GuardedH11Protocol` (uvicorn's HTTP/1.1 protocol) closes a connection whose request line and
headers do not arrive within the header deadline: a socket opened and left silent, or a
slowloris client sending headers a byte at a time, holds nothing for long. It also caps the
connections one address may hold open, so a client reconnecting slowly over and over cannot
take the whole connection limit; and past that limit, uvicorn's 503 is OpenAI's error object.
"""
from __future__ import annotations

import asyncio
import json
from collections import Counter

from uvicorn.protocols.http import h11_impl
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.serving.options import ServerOptions
from engine.serving.edge import error_body


async def send_error(send, status: int, message: str, kind: str = "invalid_request_error") -> None:
    body = json.dumps(error_body(message, kind, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def body_once(body: bytes, then):
    """An ASGI receive that hands the app the whole body once, then whatever `then()` gives (the
    client's disconnect, when it comes)."""
    given = False

    async def receive():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await then()
    return receive


class BodyGuard:
    def __init__(self, app, max_bytes: int, timeout: float):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and b"transfer-encoding" in headers:
            return await send_error(send, 400, "a request may not carry both Content-Length and Transfer-Encoding")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await send_error(send, 413, f"request body exceeds {self.max_bytes} bytes")
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout)
        except asyncio.TimeoutError:
            return await send_error(send, 408, f"the request body did not arrive within {self.timeout:g} s")
        except _TooLarge:
            return await send_error(send, 413, f"request body exceeds {self.max_bytes} bytes")
        if body is None:  # the client went away
            return
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            return await send_error(send, 400, f"the request body is not valid UTF-8 (byte {exc.start})")
        await self.app(scope, body_once(body, receive), send)  # after the body: the disconnect, as ASGI does

    async def _read(self, receive) -> bytes | None:
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _TooLarge(Exception):
    pass


async def _service_unavailable(scope, receive, send) -> None:
    """uvicorn's answer past --limit-concurrency, in OpenAI's error shape instead of plain text."""
    await send_error(send, 503, "the server is at its connection limit: retry shortly", "service_unavailable")

# uvicorn's H11 protocol looks this app up as a module global when the concurrency limit is hit;
# it has no setting for it, so the server's own replaces it here.
h11_impl.service_unavailable = _service_unavailable


def _too_many(limit: int) -> bytes:
    body = json.dumps(error_body(f"more than {limit} connections from one address: close some and retry",
                                 "rate_limit_exceeded", 429)).encode()
    return (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class GuardedH11Protocol(H11Protocol):
    """H11Protocol with a deadline for each request's line and headers, and at most
    `max_per_peer` open connections from one address (more are answered 429 and closed, so
    one client's idle or slow connections cannot use up the server's connection limit).
    `peers` counts the open connections per address: give each server its own Counter."""
    header_timeout = ServerOptions.header_timeout
    max_per_peer = ServerOptions.max_connections_per_peer
    peers: Counter = Counter()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        peer = transport.get_extra_info("peername")
        self._peer = peer[0] if peer else None
        self.peers[self._peer] += 1
        self._over = self.peers[self._peer] > self.max_per_peer  # answered 429 once its request arrives
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._over:  # the request is read (so closing resets nothing), answered and the connection closed
            if not self.transport.is_closing():
                self.transport.write(_too_many(self.max_per_peer))
                self.transport.close()
            return
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # a request is in progress: its headers are in
        elif self._header_timer is None:
            self._arm()  # bytes of a next request on a kept-alive connection

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()  # the keep-alive timer takes over until the next bytes

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.peers[self._peer] -= 1
        if self.peers[self._peer] <= 0:
            del self.peers[self._peer]
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.transport.close()


def guarded_protocol(options: ServerOptions) -> type[GuardedH11Protocol]:
    """The protocol class one server runs (its own count of connections per address)."""
    return type("GuardedH11", (GuardedH11Protocol,), {"header_timeout": options.header_timeout, "peers": Counter(),
                                                      "max_per_peer": options.max_connections_per_peer})
