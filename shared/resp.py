"""A bare RESP connection for the step loop's hot path (plans, results, detok batches).

redis-py spends about twice the CPU per command (pool checkout, the retry wrapper,
observability hooks, response callbacks) of packing with hiredis and parsing its replies on a
plain socket (scripts/benchmarks.md). On a small CPU server the scheduler, worker and
detokenizer share the cores with the worker's compute threads and each issue a few commands
per step, so the difference is a measurable share of a decode step.

Only what the hot path needs: a batch of commands written at once and their replies read back
(a pipeline, one round trip), replies as hiredis gives them (bytes, ints, nested lists, None).
Failures look like redis-py's, so the loops' handling stays as it is: an error reply raises
redis.ResponseError (after every reply of the batch was read, so the connection stays in step),
a socket failure redis.ConnectionError. As with bus.connect(), a batch that fails on the socket
is retried once, at once, on a fresh connection. One connection per loop: not thread-safe.

A loop can also split a round trip: post() writes commands and returns at once, take() reads
their replies later. The worker posts its read of the next plan before it runs a step and takes
the reply after it: the scheduler sends that plan while the step runs, so the reply is already
in the socket's buffer and the broker round trip leaves the step-to-step gap. Posted commands
are not retried (a blocking read's outcome is unknown after a failure; the loop reissues it).
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Sequence
from typing import Any

import hiredis
import redis
from redis.connection import parse_url

Command = Sequence[bytes | str | int | float]

CONNECT_TIMEOUT_S = 5.0
RECV_BYTES = 1 << 16


class _Target:
    """Where the broker is and how to greet it (AUTH, SELECT, CLIENT SETNAME), from a redis URL."""

    def __init__(self, url: str, name: str | None = None) -> None:
        opts = parse_url(url)
        self.host: str = opts.get("host", "localhost")
        self.port: int = int(opts.get("port", 6379))
        self.path: str | None = opts.get("path")  # unix socket
        self.tls = opts.get("connection_class") is redis.SSLConnection
        self.verify = opts.get("ssl_cert_reqs", "required") not in ("none", ssl.CERT_NONE)
        self.db = int(opts.get("db", 0) or 0)
        self.username: str | None = opts.get("username")
        self.password: str | None = opts.get("password")
        self.name = name

    def tls_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        if not self.verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def hello(self) -> list[Command]:
        hello: list[Command] = []
        if self.password:
            hello.append(("AUTH", self.username, self.password) if self.username else ("AUTH", self.password))
        if self.db:
            hello.append(("SELECT", self.db))
        if self.name:
            hello.append(("CLIENT", "SETNAME", self.name))
        return hello


def _pack(commands: Sequence[Command]) -> bytes:
    return b"".join(hiredis.pack_command(tuple(c)) for c in commands)


def _check(replies: list[Any]) -> list[Any]:
    for reply in replies:
        if isinstance(reply, hiredis.ReplyError):
            raise redis.ResponseError(str(reply))
    return replies


class RespConnection(_Target):
    """One socket to the broker, opened on first use and reopened after a failure."""

    def __init__(self, url: str, name: str | None = None) -> None:
        super().__init__(url, name)
        self._sock: socket.socket | None = None
        self._reader: hiredis.Reader | None = None
        self._posted = 0  # commands written by post() whose replies are unread

    def execute(self, *args: bytes | str | int | float) -> Any:
        return self.pipeline([args])[0]

    def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        """Send every command, then read every reply, in one round trip (after the replies of
        anything posted, which are checked and dropped)."""
        if self._posted:
            self.take()
        for attempt in (0, 1):
            try:
                if self._sock is None:
                    self._connect()
                return self._roundtrip(commands)
            except (OSError, EOFError, hiredis.ProtocolError) as exc:
                self.close()
                if attempt:
                    raise redis.ConnectionError(f"broker connection failed: {exc!r}") from exc
        raise AssertionError("unreachable")

    @property
    def posted(self) -> int:
        """Commands posted whose replies have not been taken."""
        return self._posted

    def post(self, commands: Sequence[Command]) -> None:
        """Write `commands` now without reading anything: take() reads their replies."""
        try:
            if self._sock is None:
                self._connect()
            self._send(commands)
        except (OSError, EOFError, hiredis.ProtocolError) as exc:
            raise redis.ConnectionError(f"broker connection failed: {exc!r}") from exc
        self._posted += len(commands)

    def take(self, check: bool = True) -> list[Any]:
        """The replies of every command posted since the last take(), waiting for them; unless
        `check`, error replies come back in their places (hiredis.ReplyError), not raised."""
        n, self._posted = self._posted, 0
        if not n:
            return []
        try:
            replies = self._read(n)
            return _check(replies) if check else replies
        except (OSError, EOFError, hiredis.ProtocolError) as exc:
            raise redis.ConnectionError(f"broker connection failed: {exc!r}") from exc

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        self._reader = None
        self._posted = 0

    # ---------------------------------------------------------------------------- internals

    def _connect(self) -> None:
        if self.path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.connect(self.path)
        else:
            sock = socket.create_connection((self.host, self.port), timeout=CONNECT_TIMEOUT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if self.tls:
                sock = self.tls_context().wrap_socket(sock, server_hostname=self.host)
        sock.settimeout(None)  # blocking reads (XREAD BLOCK) wait as long as they asked to
        self._sock, self._reader = sock, hiredis.Reader()
        hello = self.hello()
        if hello:
            try:
                self._roundtrip(hello)
            except redis.ResponseError:
                self.close()  # wrong password or db: the caller sees the broker's own error
                raise

    def _roundtrip(self, commands: Sequence[Command]) -> list[Any]:
        self._send(commands)
        return _check(self._read(len(commands)))

    def _send(self, commands: Sequence[Command]) -> None:
        assert self._sock is not None
        try:
            self._sock.sendall(_pack(commands))
        except BaseException:
            self.close()  # part of a batch may have gone out: out of step
            raise

    def _read(self, n: int) -> list[Any]:
        sock, reader = self._sock, self._reader
        assert sock is not None and reader is not None
        try:
            replies: list[Any] = []
            while len(replies) < n:
                reply = reader.gets()
                if reply is False:  # incomplete: read more
                    data = sock.recv(RECV_BYTES)
                    if not data:
                        raise EOFError("the broker closed the connection")
                    reader.feed(data)
                    continue
                replies.append(reply)
        except BaseException:
            # Interrupted mid-exchange (error, signal): replies may be left unread, so this
            # connection is out of step and must not be reused.
            self.close()
            raise
        return replies
