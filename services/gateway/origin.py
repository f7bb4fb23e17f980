"""Who may talk to the gateway from a browser, as ASGI middleware in front of every route.

A keyless gateway on a laptop is reachable by any web page its user visits: a page may open a
WebSocket to localhost (browsers send its Origin but do not block the handshake), and a DNS
rebinding page reaches the loopback address under a hostname of its own. So:
- a WebSocket handshake whose Origin is another site is refused (403) unless `--allowed-origins`
  lists it ("*" allows every origin); a handshake without Origin (not a browser: `rill chat`,
  `websockets`, the openai client) and the gateway's own chat page (same origin) pass;
- when the gateway listens on loopback only, a request (HTTP or WebSocket) whose Host is not a
  loopback name is refused (403): a rebound hostname never gets an answer.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from rill.services.gateway.errors import APIError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_NAMES or host.startswith("127.")


def host_name(host_header: str) -> str:
    """The name of a Host header, without its port ("[::1]:8000" -> "::1")."""
    return (urlsplit(f"//{host_header}").hostname or "").lower()


class OriginGuard:
    def __init__(self, app: ASGIApp, bind_host: str, allowed_origins: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.loopback_only = is_loopback(bind_host)
        self.allowed = frozenset(o.rstrip("/").lower() for o in allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        why = self.refusal(scope["type"], headers)
        if why is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": why})  # before accept: HTTP 403
        else:
            await APIError(why, 403, type="forbidden").response()(scope, receive, send)

    def refusal(self, kind: str, headers: Headers) -> str | None:
        host = headers.get("host", "")
        if self.loopback_only and not is_loopback(host_name(host)):
            return f"Host {host!r} is not this server's (it listens on loopback only)"
        origin = headers.get("origin")
        if kind != "websocket" or origin is None or "*" in self.allowed:
            return None
        origin = origin.rstrip("/").lower()
        parts = urlsplit(origin)
        if parts.netloc == host.lower() or origin in self.allowed:
            return None
        return f"cross-origin WebSocket from {origin!r} refused (see --allowed-origins)"
