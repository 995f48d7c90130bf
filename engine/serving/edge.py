"""The edge: what every front door decides the same way before a request reaches an engine.

Three front doors take requests: one server's app (engine/serving/api/), the replicas' front
door (engine/serving/dp/front_door.py) and the Ray ingress (engine/serving/dp/ray_serve.py).
Each must name the client alike (fairness, and with --isolate-clients the salt its pages are
named with, which the Ray router must compute exactly as the replica does), check the key
alike, refuse in OpenAI's error object and end a stream that failed midway alike. Each rule is
written here once; the front doors only call it.

  client_of      who asks: "key" when the server has an API key (one key, one client), else the
                 peer's address; OpenAI's `user` field appended when the request names one
  client_salt    --isolate-clients: the cache_salt of a client's requests that give none
  key_ok         the Authorization header against the server's key (constant time)
  error_body     OpenAI's error object; `refusal` the same as a JSON response
  stream_tail    the bytes that end a stream that failed after it began: an error event, [DONE]
"""
from __future__ import annotations

import hashlib
import hmac
import json

from fastapi.responses import JSONResponse

UNAUTHORIZED = "invalid or missing API key"


def client_of(api_key: str | None, peer: str | None, user: object = None) -> str:
    """Who asks. `user` counts only when it is a non-empty string (anything else is refused by
    the request's schema where one is checked)."""
    who = "key" if api_key is not None else (peer or "unknown")
    return f"{who}/{user}" if isinstance(user, str) and user else who


def client_salt(client: str) -> str:
    """The cache_salt a client's requests get under --isolate-clients when they give none: its
    pages are named apart from every other client's, in every process and router."""
    return "client:" + hashlib.sha256(client.encode()).hexdigest()


def key_ok(authorization: str | None, api_key: str | None) -> bool:
    """Whether an Authorization header carries the key (always, where the server has none)."""
    if api_key is None:
        return True
    return hmac.compare_digest((authorization or "").encode(), f"Bearer {api_key}".encode())


def error_body(message: str, kind: str = "invalid_request_error", code: int | str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def refusal(status: int, message: str, kind: str = "invalid_request_error", retry_after: float | None = None
            ) -> JSONResponse:
    """OpenAI's error object as a response; retry_after: seconds a client should wait (a 503's
    Retry-After)."""
    headers = {"retry-after": str(max(1, round(retry_after)))} if retry_after is not None else None
    return JSONResponse(error_body(message, kind, status), status_code=status, headers=headers)


def stream_tail(message: str, kind: str = "service_unavailable", status: int = 503) -> bytes:
    """What ends a server-sent event stream that failed after its first chunk: an error event in
    OpenAI's object, then [DONE], so a client never reads a stream cut off without a reason."""
    return f"data: {json.dumps(error_body(message, kind, status))}\n\ndata: [DONE]\n\n".encode()
