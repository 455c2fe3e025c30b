"""The ASGI middleware in front of every route (Host header, API key, body size) and the
loopback check of the address the server listens on."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sfi.server.schemas import error_response


async def _send_error(send: Send, status: int, message: str, kind: str, code: str,
                      headers: dict[str, str] | None = None) -> None:
    response = error_response(status, message, kind, code=code, headers=headers)
    await send({"type": "http.response.start", "status": status,
                "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


class Guard:
    """ASGI middleware in front of every route: the Host header (against DNS rebinding), the
    API key on ``/v1/*`` (constant-time comparison; ``/health`` and ``/metrics`` stay open), and
    the body size (413 past ``max_body_bytes``, counted as the body arrives)."""

    def __init__(self, app: ASGIApp, api_key: str | None, allowed_hosts: list[str] | None,
                 max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.allowed_hosts = None if not allowed_hosts or "*" in allowed_hosts \
            else {h.lower() for h in allowed_hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        if self.allowed_hosts is not None:
            host = headers.get("host", "")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name.lower() not in self.allowed_hosts:
                await _send_error(send, 400, f"the Host header {host!r} is not one this server "
                                  "answers to", "invalid_request_error", "invalid_host")
                return
        if self.api_key is not None and scope.get("path", "").startswith("/v1/"):
            given = headers.get("authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                await _send_error(send, 401, "a valid API key is needed: send it as "
                                  "'Authorization: Bearer <key>'", "invalid_request_error",
                                  "invalid_api_key", {"WWW-Authenticate": "Bearer"})
                return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await _send_error(send, 413, f"the request body is over {self.max_body_bytes} bytes",
                              "invalid_request_error", "request_too_large")
            return
        body = b""
        more = scope.get("method") in ("POST", "PUT", "PATCH")
        while more:  # read the body here (at most max_body_bytes), then replay it
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                await _send_error(send, 413, f"the request body is over {self.max_body_bytes} "
                                  "bytes", "invalid_request_error", "request_too_large")
                return
        await self.app(scope, _replay(body, receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` first, then what the client sends (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")
