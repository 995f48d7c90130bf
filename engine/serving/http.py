"""The HTTP guard rails in front of the app: bounded bodies, read deadlines, idle connections.

`BodyGuard` (ASGI middleware) reads a request's whole body before the app sees it: over the
limit, declared or streamed, is a 413; a body that does not arrive within the deadline (a
Content-Length larger than what is sent, a client trickling bytes) is a 408; Content-Length
together with Transfer-Encoding, or a body that is not UTF-8, is a 400. Errors carry OpenAI's
error object.

`GuardedH11Protocol` (uvicorn's HTTP/1.1 protocol) closes a connection whose request line and
headers do not arrive within the header deadline: a socket opened and left silent, or a
slowloris client sending headers a byte at a time, holds nothing for long.
"""
from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.serving.options import ServerOptions
from engine.serving.protocol import error_body


async def send_error(send, status: int, message: str, kind: str = "invalid_request_error") -> None:
    body = json.dumps(error_body(message, kind, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


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
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as ASGI does

        await self.app(scope, replay, send)

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


class GuardedH11Protocol(H11Protocol):
    """H11Protocol with a deadline for each request's line and headers."""
    header_timeout = ServerOptions.header_timeout

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        self._arm()

    def data_received(self, data: bytes) -> None:
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
