"""Graceful drain: on SIGTERM a gateway stops taking requests and lets those in flight finish.

While draining, /health answers 503 (a load balancer takes the replica out) and new requests get
503. Requests in flight run on for up to the shutdown timeout; whatever is left then ends with
DRAIN_ERROR and is aborted on the engines, so their KV blocks are freed before the engines stop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Receive, Scope, Send

from rill.services.gateway.errors import json_response
from rill.shared.schema import ErrorReply

if TYPE_CHECKING:
    from rill.services.gateway.gateway import Gateway

log = logging.getLogger("rill.gateway")

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DRAINING = "The server is shutting down and takes no new requests; retry on another replica or later."
DRAIN_ERROR = "The server shut down before this request finished (shutdown timeout); please retry."


class DrainHealth:
    """ASGI middleware: /health answers 503 while the gateway drains, so a load balancer (or a
    test) sees the replica going before it stops listening."""

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.gateway.draining and scope["type"] == "http" and scope["path"] == "/health":
            resp = json_response({"status": "draining", "reason": "the server is shutting down"}, 503)
            await resp(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def drain(gw: Gateway, timeout_s: float) -> None:
    gw.draining = True
    deadline = time.monotonic() + timeout_s
    log.info("draining: %d requests in flight, up to %g s", len(gw.tracker), timeout_s)
    while len(gw.tracker) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = gw.tracker.ids()
    if not left:
        return
    log.warning("shutdown timeout: ending %d requests still in flight", len(left))
    for rid in left:
        gw.tracker.fail(rid, ErrorReply.of(rid, DRAIN_ERROR, 503))
    try:
        await asyncio.wait_for(gw.abort(left, reason="shutdown"), 5.0)
    except Exception as exc:  # the broker is gone: the engines stop with it anyway
        log.warning("abort at shutdown failed: %r", exc)
