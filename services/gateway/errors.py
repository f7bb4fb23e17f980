"""OpenAI-style error bodies and the exception that carries one through a handler."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

_json = msgspec.json.Encoder()

# OpenAI error `type` per HTTP status, for errors that do not name their own.
_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 500: "internal_server_error", 503: "service_unavailable",
          504: "timeout"}


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: Any = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class APIError(Exception):
    """A request-level failure shown to the client; never crashes the gateway."""

    def __init__(self, message: str, status: int = 400, type: str | None = None,
                 param: str | None = None, code: Any = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}  # e.g. Retry-After on a 429

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> Response:
        resp = json_response(self.body(), self.status)
        resp.headers.update(self.headers)
        return resp


def json_response(content: Any, status: int = 200) -> Response:
    # msgspec encodes several times faster than the stdlib; responses are on the request path.
    return Response(_json.encode(content), status_code=status, media_type="application/json")


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Routing errors (unknown path, wrong method) as OpenAI JSON instead of plain text."""
    assert isinstance(exc, HTTPException)
    message = {404: f"Not found: {request.url.path}",
               405: f"Method {request.method} not allowed for {request.url.path}"}.get(
        exc.status_code, str(exc.detail))
    resp = APIError(message, exc.status_code).response()
    if exc.headers:
        resp.headers.update(exc.headers)
    return resp


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def internal_error_handler(request: Request, exc: Exception) -> Response:
    return APIError("Internal server error", 500).response()
