"""--api-key (or RILL_API_KEY): every request to the API routes needs `Authorization: Bearer <key>`.

Guarded: /v1/* (the WebSocket /v1/ws too, which also takes the key as `?api_key=` since a
browser cannot set headers on a WebSocket), /tokenize, /tokenizer_info and /detokenize, as vLLM
guards its API routes. Open: /health and /metrics (probes and scrapers carry no key), /stats, /openapi.json and
the chat page's files (the page's own API calls are what need the key). A refused HTTP request
gets 401 with the OpenAI error JSON; a refused WebSocket handshake gets the same 401 where the
server can answer a handshake with a response, else it is closed with code 1008 (policy).
"""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from rill.services.gateway.errors import APIError
from rill.shared import envs

GUARDED_PREFIXES = ("/v1", "/tokenize", "/detokenize")  # "/tokenize" covers /tokenizer_info
MISSING = "Missing API key: send it as the header `Authorization: Bearer <key>`."
INVALID = "Incorrect API key provided."


def api_key_from_env(value: str | None) -> str | None:
    """The flag's value, else the environment's; empty means no key (an open server)."""
    key = value if value is not None else envs.RILL_API_KEY
    return key or None


def is_guarded(path: str) -> bool:
    return path.startswith(GUARDED_PREFIXES)


def bearer_token(headers: Headers) -> str | None:
    value = headers.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def query_token(scope: Scope) -> str | None:
    """`?api_key=` on a WebSocket URL: browsers cannot set headers on a WebSocket handshake."""
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key")
    return values[0] if values else None


class BearerAuth:
    """ASGI middleware: refuses guarded requests whose bearer token is not the key."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("an empty API key would let every request in")
        self.app = app
        self.key = api_key.encode()

    def _error(self, scope: Scope) -> APIError | None:
        token = bearer_token(Headers(scope=scope))
        if token is None and scope["type"] == "websocket":
            token = query_token(scope)
        if token is None:
            return APIError(MISSING, 401, code="invalid_api_key")
        # Constant time: the comparison must not tell how much of a guess was right.
        if not hmac.compare_digest(token.encode(), self.key):
            return APIError(INVALID, 401, code="invalid_api_key")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not is_guarded(scope["path"]):
            await self.app(scope, receive, send)
            return
        err = self._error(scope)
        if err is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            resp = err.response()
            resp.headers["WWW-Authenticate"] = "Bearer"
            await resp(scope, receive, send)
        else:
            await self._refuse_websocket(scope, receive, send, err)

    async def _refuse_websocket(self, scope: Scope, receive: Receive, send: Send, err: APIError) -> None:
        await receive()  # websocket.connect
        if "websocket.http.response" in scope.get("extensions", {}):
            resp = err.response()
            await send({"type": "websocket.http.response.start", "status": 401,
                        "headers": [*resp.raw_headers, (b"www-authenticate", b"Bearer")]})
            await send({"type": "websocket.http.response.body", "body": resp.body})
        else:
            await send({"type": "websocket.close", "code": 1008, "reason": err.message})
