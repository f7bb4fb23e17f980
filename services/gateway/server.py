"""The HTTP server around the gateway app: limits for slow and many clients, and a drain on SIGTERM.

uvicorn alone never closes a connection that trickles its request headers (its only timer is the
keep-alive one, armed after a response), takes any number of sockets, and accepts 16 MiB
WebSocket frames. `GuardedH11` adds a read deadline per request (headers from the connection's
first byte or, kept alive, the next request's; then the body) and a cap on open connections
(HTTP and WebSocket alike); `server_config` sets the frame limit to the request body limit, and
keeps an idle connection longer than clients and proxies keep theirs: where both wait 5 s
(uvicorn's default, httpx's), a request sent as the server closes the socket is lost.
`DrainingServer` turns the first SIGTERM/SIGINT into a drain (drain.py) before uvicorn's own
shutdown; a second signal exits at once.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from rill.services.gateway.errors import APIError

DEFAULT_HEADER_TIMEOUT_S = 10.0  # a request's headers must arrive within this (slowloris)
DEFAULT_BODY_TIMEOUT_S = 60.0  # and its body within this after them (16 MiB at ~280 KB/s)
DEFAULT_MAX_CONNECTIONS = 4096  # open sockets, HTTP and WebSocket; above it new ones get 503 (0: no cap)
DEFAULT_KEEP_ALIVE_S = 75.0  # an idle kept-alive connection, as nginx: over proxies' 60 s and clients' 5-15 s


@dataclass(frozen=True)
class ServerLimits:
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S


def _busy_response() -> bytes:
    body = APIError("Too many open connections; try again later.", 503).response().body
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))


def guarded_h11(limits: ServerLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a read deadline and a connection cap (see the module docstring)."""

    class GuardedH11(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _phase: str | None = None  # what the deadline waits for: "headers" or "body"

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if 0 < limits.max_connections < len(self.connections):  # refused unread: cheapest under a flood
                transport.write(BUSY_RESPONSE)
                transport.close()
                return
            self._arm(limits.header_timeout_s)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._rearm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._rearm()  # idle: uvicorn's keep-alive timer; the next request's first byte arms ours

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _rearm(self) -> None:
            if self.transport.is_closing() or self.transport.get_protocol() is not self:
                self._disarm()  # closed, or upgraded to a WebSocket (its own limits apply)
            elif self.conn.their_state is h11.IDLE:
                if not self.conn.trailing_data[0]:
                    self._disarm()  # nothing of a next request yet: idle, not slow
                elif self._deadline is None:
                    self._arm(limits.header_timeout_s)
            elif self.conn.their_state is h11.SEND_BODY:
                if self._phase != "body":
                    self._arm(limits.body_timeout_s, "body")
            else:  # the whole request is in: the answer may take as long as it takes
                self._disarm()

        def _arm(self, seconds: float, phase: str = "headers") -> None:
            self._disarm()
            self._phase = phase
            if seconds <= 0:  # no deadline for this phase
                return
            self._deadline = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            self._phase = None

        def _expired(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()  # a handler waiting on the body sees http.disconnect

    return GuardedH11


BUSY_RESPONSE = _busy_response()


def server_config(app: Any, host: str, port: int, limits: ServerLimits, ws_max_size: int,
                  graceful_s: float = 5.0) -> uvicorn.Config:
    """The uvicorn settings of a deployed gateway. log_config=None keeps Rill's log format; the
    graceful timeout stops a stream whose engine died from holding the process open."""
    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, log_config=None,
                          http=guarded_h11(limits), ws_max_size=ws_max_size,
                          timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
                          timeout_graceful_shutdown=max(1, round(graceful_s)))


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT runs `drain` (which returns once the requests in flight ended)
    and only then lets uvicorn shut down; a second signal skips the drain."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._draining: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining is not None or self._loop is None or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)
            return
        # Signal handlers run on the loop's thread between callbacks: scheduling a task is safe.
        self._draining = self._loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        finally:
            self.should_exit = True


def reuse_port_socket(host: str, port: int) -> socket.socket:
    if not hasattr(socket, "SO_REUSEPORT"):
        raise SystemExit("rill: several gateway replicas on one port need SO_REUSEPORT (Linux)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock
