"""POST a JSON body over plain HTTP/1.1 and hand each line of the response body to a callback as
it arrives: the load generator's streaming client (`rill bench serve`).

Why not httpx, nor asyncio's StreamReader: on a 2-core machine the client shares the CPU with
the server it measures, and httpx's layers (httpcore, h11, anyio) cost it throughput there
(scripts/benchmarks.md: the same-run A/B that kept this module); a
StreamReader with async generators for de-chunking and line splitting still resumes three
coroutines per event. Here an asyncio.Protocol parses the head, the chunked framing and the lines
inside the event loop's read callback, and calls `on_line` synchronously: one callback per
arrival of data, no coroutine in between. One connection per request (`Connection: close`), no
TLS: https URLs stay with httpx.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_HEADER_LINES = 100

# A body line; return True to stop reading (the rest of the response is not read).
LineHandler = Callable[[bytes], bool | None]


class LineSplitter:
    """The lines of a byte stream fed in pieces, without their endings (LF or CRLF)."""

    def __init__(self) -> None:
        self.partial = b""  # the start of a line whose end has not come

    def feed(self, data: bytes) -> list[bytes]:
        if b"\n" not in data:
            self.partial += data
            return []
        *lines, self.partial = (self.partial + data).split(b"\n")
        return [line.removesuffix(b"\r") for line in lines]

    def rest(self) -> bytes:
        """What is left after the stream ended: an unterminated last line, or b""."""
        line, self.partial = self.partial.removesuffix(b"\r"), b""
        return line


class ProtocolError(Exception):
    """The server's answer is not HTTP/1.x as this reader understands it."""


@dataclass
class Head:
    status: int
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value


def _parse_head(raw: bytes) -> Head:
    lines = raw.split(b"\n")
    fields = lines[0].split(None, 2)
    if len(fields) < 2 or not fields[0].startswith(b"HTTP/1.") or not fields[1].isdigit():
        raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    if len(lines) > MAX_HEADER_LINES + 1:
        raise ProtocolError("too many header lines")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.decode("latin-1").partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return Head(int(fields[1]), headers)


def _head_end(buf: bytes) -> tuple[int, int]:
    """(end of the head, start of the body) at the first empty line (CRLF or LF), or (-1, -1)."""
    at = 0
    while (eol := buf.find(b"\n", at)) >= 0:
        nxt = buf.find(b"\n", eol + 1)
        if nxt < 0:
            return -1, -1
        if buf[eol + 1:nxt] in (b"", b"\r"):
            return eol, nxt + 1
        at = eol + 1
    return -1, -1


class _Exchange(asyncio.Protocol):
    """One request and its response, parsed as the bytes come: head, body framing, lines."""

    def __init__(self, request: bytes, on_line: LineHandler, on_head: Callable[[Head], None] | None,
                 limit: int, done: asyncio.Future[Head]) -> None:
        self.request, self.on_line, self.on_head, self.limit, self.done = request, on_line, on_head, limit, done
        self.transport: asyncio.Transport | None = None
        self.head: Head | None = None
        self.raw = b""  # received, not yet parsed: the head, or chunk framing
        self.lines = LineSplitter()  # the body's lines
        self.mode = ""  # body framing: "chunked", "length" or "close"
        self.state = "size"  # chunked: reading a "size" line, chunk "data", or its "crlf"
        self.remaining = 0  # bytes of the chunk (chunked) or of the body (length) still to come

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.write(self.request)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        try:
            if self.head is None:
                self.raw += data
                end, body = _head_end(self.raw)
                if end < 0:
                    if len(self.raw) > self.limit:
                        raise ProtocolError(f"a response head over the reader's limit ({self.limit} bytes)")
                    return
                head, data, self.raw = self.raw[:end], self.raw[body:], b""
                self._start_body(_parse_head(head.rstrip(b"\r")))
            if self.mode == "chunked":
                self._dechunk(data)
            elif self.mode == "length":
                take = data[:self.remaining]
                self.remaining -= len(take)
                if not self._feed(take) and self.remaining == 0:
                    self._finish()
            else:
                self._feed(data)
        except Exception as exc:  # a bad head or framing, or the handler's own error
            self._fail(exc)

    def _start_body(self, head: Head) -> None:
        self.head = head
        if self.on_head is not None:
            self.on_head(head)
        if "chunked" in head.headers.get("transfer-encoding", "").lower():
            self.mode = "chunked"
        elif "content-length" in head.headers:
            self.mode, self.remaining = "length", int(head.headers["content-length"])
            if self.remaining == 0:
                self._finish()
        else:  # delimited by the server closing the connection
            self.mode = "close"

    def _dechunk(self, data: bytes) -> None:
        buf, at = self.raw + data, 0
        while not self.done.done():
            if self.state == "size":
                eol = buf.find(b"\n", at)
                if eol < 0:
                    break
                try:
                    self.remaining = int(buf[at:eol].split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size line {buf[at:eol][:40]!r}") from None
                at = eol + 1
                if self.remaining == 0:  # the last chunk; trailers, if any, are not read
                    self._finish()
                    return
                self.state = "data"
            elif self.state == "data":
                take = buf[at:at + self.remaining]
                if not take:
                    break
                at += len(take)
                self.remaining -= len(take)
                if self._feed(take):
                    return
                if self.remaining == 0:
                    self.state = "crlf"
            else:  # the CRLF that ends a chunk's data
                eol = buf.find(b"\n", at)
                if eol < 0:
                    at = len(buf)  # a lone CR: the LF comes with the next data
                    break
                at = eol + 1
                self.state = "size"
        self.raw = buf[at:]
        if len(self.raw) > self.limit:  # a size line that never ends
            raise ProtocolError(f"a chunk size line over the reader's limit ({self.limit} bytes)")

    def _feed(self, payload: bytes) -> bool:
        """Body bytes: complete lines go to the handler; True once it asked to stop."""
        for line in self.lines.feed(payload):
            if self.on_line(line):
                self._finish(flush=False)
                return True
        return False

    def _finish(self, flush: bool = True) -> None:
        if self.done.done():
            return
        if flush and (line := self.lines.rest()):
            self.on_line(line)
        assert self.head is not None
        self.done.set_result(self.head)
        if self.transport is not None:
            self.transport.close()

    def _fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done.done():
            return
        if exc is None and self.head is not None and self.mode == "close":
            try:
                self._finish()
            except Exception as err:  # noqa: BLE001 - the handler's error on the last line
                self._fail(err)
            return
        self._fail(exc or asyncio.IncompleteReadError(self.lines.partial, None))


async def stream_lines(url: str, body: bytes, on_line: LineHandler, headers: dict[str, str] | None = None,
                       on_head: Callable[[Head], None] | None = None, limit: int = 1 << 20) -> Head:
    """POST `body` to `url` and call `on_line` with each line of the response body, without its
    ending (LF or CRLF), until the body ends or `on_line` returns True; `on_head` first, with
    the status and headers. Returns the head. The callbacks run inside the event loop's read
    callback: they must not block. Raises ProtocolError for a reply that is not HTTP/1.x,
    asyncio.IncompleteReadError for a body cut short, and whatever a callback raises."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"stream_lines speaks plain http only, not {url!r}")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.netloc.rpartition("@")[2]  # as written in the URL: brackets of an IPv6 literal kept
    head = [f"POST {target} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Accept: text/event-stream", "Connection: close"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Head] = loop.create_future()
    transport, _ = await loop.create_connection(lambda: _Exchange(request, on_line, on_head, limit, done),
                                                parts.hostname, parts.port or 80)
    try:
        return await done
    finally:
        transport.close()
