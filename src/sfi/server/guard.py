"""Who may use the server: :class:`Access` (the API key, the Host names answered, the body
limit, checked once), the ASGI middleware that enforces it in front of every route, and the
loopback check of the address the server listens on."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sfi.errors import SFIError
from sfi.server.schemas import error_response

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]", "::1")


@dataclass(frozen=True)
class Access:
    """What the :class:`Guard` enforces: ``api_key`` (None: open), ``allowed_hosts`` (Host
    header names answered; None or ``"*"`` among them: any), ``max_body_bytes``."""

    api_key: str | None = None
    allowed_hosts: tuple[str, ...] | None = None
    max_body_bytes: int = 4 * 2 ** 20

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise SFIError("the API key is set but empty")
        if self.max_body_bytes <= 0:
            raise SFIError(f"the request body limit must be > 0 bytes (got {self.max_body_bytes})")

    @classmethod
    def listening_on(cls, host: str, api_key: str | None = None,
                     allowed_hosts: list[str] | None = None,
                     max_body_bytes: int = 4 * 2 ** 20) -> Access:
        """The access of a server listening on ``host``: unless given, the Host names answered
        are the loopback names on a loopback address and any name elsewhere."""
        if allowed_hosts is None:
            allowed_hosts = list(LOOPBACK_NAMES) if is_loopback(host) else ["*"]
        return cls(api_key, tuple(allowed_hosts), max_body_bytes)

    def open_to_anyone(self, host: str) -> bool:
        """Whether whoever reaches ``host`` may use the model (no key, not loopback)."""
        return self.api_key is None and not is_loopback(host)


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

    def __init__(self, app: ASGIApp, access: Access):
        self.app, self.api_key, self.max_body_bytes = app, access.api_key, access.max_body_bytes
        hosts = access.allowed_hosts
        self.allowed_hosts = None if not hosts or "*" in hosts else {h.lower() for h in hosts}

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
