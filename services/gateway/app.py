"""The gateway process: the Starlette app (routes, middleware, lifespan) and its entry point.
Several gateway replicas can share one port (SO_REUSEPORT, see `run`)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rill.services.gateway import (
    chat_page,
    info_api,
    metrics,
    openai_api,
    openapi_spec,
    responses_api,
    websocket,
)
from rill.services.gateway.admission import DEFAULT_MAX_WAITING_REQUESTS
from rill.services.gateway.auth import BearerAuth
from rill.services.gateway.bodies import DEFAULT_MAX_LOGPROBS
from rill.services.gateway.chat_output import DEFAULT_PARSERS, ChatParsers
from rill.services.gateway.deadline import DEFAULT_PROGRESS_TIMEOUT_S
from rill.services.gateway.drain import DEFAULT_SHUTDOWN_TIMEOUT_S, DrainHealth, drain
from rill.services.gateway.errors import (
    APIError,
    api_error_handler,
    http_exception_handler,
    internal_error_handler,
)
from rill.services.gateway.gateway import Gateway
from rill.services.gateway.limits import DEFAULT_MAX_BODY_BYTES, RequestLimits
from rill.services.gateway.origin import OriginGuard
from rill.services.gateway.server import DrainingServer, ServerLimits, reuse_port_socket, server_config
from rill.services.gateway.websocket import DEFAULT_WS_IDLE_TIMEOUT_S


class GatewayHeader:
    """Names the replica that answered (`x-rill-gateway`), for clients of a shared port and tests."""

    def __init__(self, app: ASGIApp, gateway_id: str) -> None:
        self.app = app
        self.header = (b"x-rill-gateway", gateway_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


def create_app(redis_url: str, prefix: str, model_name: str, max_model_len: int,
               gateway_id: str | None = None, watch_engine: bool = False,
               max_logprobs: int = DEFAULT_MAX_LOGPROBS, api_key: str | None = None,
               max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES, ignore_unknown_fields: bool = False,
               bind_host: str = "0.0.0.0", allowed_origins: frozenset[str] = frozenset(),
               max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
               progress_timeout_s: float = DEFAULT_PROGRESS_TIMEOUT_S,
               ws_idle_timeout_s: float = DEFAULT_WS_IDLE_TIMEOUT_S,
               chat_parsers: ChatParsers = DEFAULT_PARSERS) -> Starlette:
    """`api_key`: guard the API routes with this bearer token (see auth.py); None or empty: open.
    `bind_host` / `allowed_origins`: who may talk to it from a browser (origin.py)."""
    gateway = Gateway(redis_url, prefix, model_name, max_model_len, watch_engine=watch_engine,
                      max_logprobs=max_logprobs, ignore_unknown_fields=ignore_unknown_fields,
                      max_waiting_requests=max_waiting_requests, progress_timeout_s=progress_timeout_s,
                      ws_idle_timeout_s=ws_idle_timeout_s, chat_parsers=chat_parsers,
                      **({"gateway_id": gateway_id} if gateway_id else {}))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = Starlette(
        routes=[*openai_api.routes(), *info_api.routes(), *websocket.routes(), *chat_page.routes(), *metrics.routes(),
                *openapi_spec.routes(), *responses_api.routes()],
        lifespan=lifespan,
        exception_handlers={HTTPException: http_exception_handler, APIError: api_error_handler,
                            Exception: internal_error_handler},
        # Outermost first: Host and Origin, then the key, both before any body is read, then the
        # body limits.
        middleware=[Middleware(GatewayHeader, gateway_id=gateway.gateway_id),
                    Middleware(DrainHealth, gateway=gateway),
                    Middleware(OriginGuard, bind_host=bind_host, allowed_origins=allowed_origins),
                    *([Middleware(BearerAuth, api_key=api_key)] if api_key else []),
                    Middleware(RequestLimits, max_body_bytes=max_request_body_bytes)],
    )
    app.state.gateway = gateway
    return app


def run(redis_url: str, prefix: str, model_name: str, max_model_len: int, host: str, port: int,
        replica: str | None = None, reuse_port: bool = False, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        api_key: str | None = None, max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        ignore_unknown_fields: bool = False, allowed_origins: frozenset[str] = frozenset(),
        server_limits: ServerLimits | None = None, max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
        progress_timeout_s: float = DEFAULT_PROGRESS_TIMEOUT_S, ws_idle_timeout_s: float = DEFAULT_WS_IDLE_TIMEOUT_S,
        shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S, chat_parsers: ChatParsers = DEFAULT_PARSERS) -> None:
    """Serve until SIGTERM/SIGINT, then drain (drain.py). `reuse_port`: bind with SO_REUSEPORT, so
    several gateway replicas listen on the same port and the kernel spreads connections across them."""
    from rill.shared.logs import setup_logging

    setup_logging("gateway")
    # Unique per process start: a restarted replica gets a fresh reply stream, and the requests
    # of the one that died are aborted by the engines once its heartbeat expires.
    gateway_id = f"{replica}-{uuid.uuid4().hex[:8]}" if replica else uuid.uuid4().hex
    app = create_app(redis_url, prefix, model_name, max_model_len, gateway_id=gateway_id, watch_engine=True,
                     max_logprobs=max_logprobs, api_key=api_key, max_request_body_bytes=max_request_body_bytes,
                     ignore_unknown_fields=ignore_unknown_fields, bind_host=host, allowed_origins=allowed_origins,
                     max_waiting_requests=max_waiting_requests, progress_timeout_s=progress_timeout_s,
                     ws_idle_timeout_s=ws_idle_timeout_s, chat_parsers=chat_parsers)
    config = server_config(app, host, port, server_limits or ServerLimits(), ws_max_size=max_request_body_bytes)
    server = DrainingServer(config, lambda: drain(app.state.gateway, shutdown_timeout_s))
    if not reuse_port:
        server.run()
        return
    server.run(sockets=[reuse_port_socket(host, port)])
