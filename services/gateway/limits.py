"""Request-body limits, as ASGI middleware in front of every HTTP route.

- A body larger than `max_body_bytes` gets 413 (OpenAI error JSON): at once when Content-Length
  says so, else as soon as the bytes read so far pass the limit (chunked uploads), so no body
  larger than the limit is ever held in memory.
- A POST to a JSON endpoint with a Content-Type other than application/json (or a `+json` type)
  gets 400. A missing Content-Type is read as JSON, as many clients omit it.

The body is read here (it is small and every JSON handler reads it whole anyway) and replayed to
the app; after the replay the app's receive() is the server's again, so handlers still see
`http.disconnect`.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rill.services.gateway.errors import APIError

DEFAULT_MAX_BODY_BYTES = 16 << 20  # 16 MiB: far above any prompt that fits a context window
JSON_POST_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                             "/v1/tokenize", "/v1/detokenize"})


def too_large(limit: int) -> APIError:
    return APIError(f"The request body is larger than the limit of {limit} bytes.", 413,
                    code="request_too_large")


def content_type_error(headers: Headers) -> APIError | None:
    value = headers.get("content-type")
    if value is None:
        return None
    media = value.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return None
    return APIError(f"Content-Type must be application/json, got {value!r}.", 400, param="Content-Type")


def declared_length(headers: Headers) -> int | None:
    value = headers.get("content-length")
    return int(value) if value is not None and value.strip().isdigit() else None


class RequestLimits:
    """ASGI middleware: body size limit and JSON content type (see the module docstring)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, got {max_body_bytes}")
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        err = None
        if scope["method"] == "POST" and scope["path"] in JSON_POST_PATHS:
            err = content_type_error(headers)
        length = declared_length(headers)
        if err is None and length is not None and length > self.limit:
            err = too_large(self.limit)
        if err is not None:
            await err.response()(scope, receive, send)
            return
        body = await self._read_body(receive)
        if body is None:
            await too_large(self.limit).response()(scope, receive, send)
            return
        if isinstance(body, dict):  # the client left before its body arrived: nobody to answer
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | Message | None:
        """The whole body; None past the limit; the disconnect message if the client left."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
