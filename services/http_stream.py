"""POST a JSON body over plain HTTP/1.1 and read the response line by line: the load generator's
streaming client (`rill bench serve`).

Why not httpx: on a 2-core machine the client shares the CPU with the server it measures, and
httpx's layers (httpcore, h11, anyio) cost ~170 µs per streamed chunk, a few percent of the
machine at 16 streams. This reads the chunked body with asyncio's StreamReader directly. One
connection per request (`Connection: close`), no TLS: https URLs stay with httpx.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_HEADER_LINES = 100


class ProtocolError(Exception):
    """The server's answer is not HTTP/1.x as this reader understands it."""


@dataclass
class StreamedResponse:
    status: int
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    lines: AsyncIterator[bytes]  # body lines without their line ending
    body: AsyncIterator[bytes]  # the raw body, de-chunked (use this or `lines`, not both)


async def post_stream(url: str, body: bytes, headers: dict[str, str] | None = None,
                      limit: int = 1 << 20) -> tuple[StreamedResponse, asyncio.StreamWriter]:
    """Send the request and read the head. The caller closes the returned writer."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"post_stream speaks plain http only, not {url!r}")
    port = parts.port or 80
    reader, writer = await asyncio.open_connection(parts.hostname, port, limit=limit)
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.netloc.rpartition("@")[2]  # as written in the URL: brackets of an IPv6 literal kept
        head = [f"POST {target} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
                f"Content-Length: {len(body)}", "Accept: text/event-stream", "Connection: close"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        status_line = await reader.readline()
        fields = status_line.split(None, 2)
        if len(fields) < 2 or not fields[0].startswith(b"HTTP/1.") or not fields[1].isdigit():
            raise ProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        got: dict[str, str] = {}
        for _ in range(MAX_HEADER_LINES):
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, sep, value = line.decode("latin-1").partition(":")
            if sep:
                got[name.strip().lower()] = value.strip()
        else:
            raise ProtocolError("too many header lines")
    except BaseException:
        writer.close()
        raise
    body_iter = _body(reader, got, limit)
    return StreamedResponse(int(fields[1]), got, split_lines(body_iter), body_iter), writer


async def _body(reader: asyncio.StreamReader, headers: dict[str, str], limit: int) -> AsyncIterator[bytes]:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        async for data in _dechunk(reader, limit):
            yield data
    elif "content-length" in headers:
        remaining = int(headers["content-length"])
        while remaining > 0:
            data = await reader.read(min(remaining, 1 << 16))
            if not data:
                raise asyncio.IncompleteReadError(b"", remaining)
            remaining -= len(data)
            yield data
    else:  # delimited by the server closing the connection
        while data := await reader.read(1 << 16):
            yield data


async def _dechunk(reader: asyncio.StreamReader, limit: int) -> AsyncIterator[bytes]:
    """A chunked body, de-chunked: one read and one piece per arrival of data, however many
    chunks it holds (a server streaming one event per chunk sends each in one segment, so
    awaiting a size line and then its chunk would cost two wake-ups per event)."""
    buf = b""
    while True:
        pieces: list[bytes] = []
        at = 0
        while True:
            eol = buf.find(b"\n", at)
            if eol < 0:
                break
            try:
                size = int(buf[at:eol].split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size line {buf[at:eol][:40]!r}") from None
            if size == 0:  # trailers, if any, are not read: the connection closes
                if pieces:
                    yield b"".join(pieces)
                return
            end = eol + 1 + size + 2  # the chunk and its CRLF
            if len(buf) < end:
                break
            pieces.append(buf[eol + 1:end - 2])
            at = end
        buf = buf[at:]
        if pieces:
            yield b"".join(pieces)
        if len(buf) > limit and b"\n" not in buf:  # a size line never ends
            raise ProtocolError(f"a chunk size line over the reader's limit ({limit} bytes)")
        data = await reader.read(1 << 16)
        if not data:
            raise asyncio.IncompleteReadError(buf, None)
        buf += data


async def split_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The lines of a byte stream, without their endings (LF or CRLF)."""
    pending = b""
    async for data in chunks:
        pending += data
        if b"\n" not in data:
            continue
        *complete, pending = pending.split(b"\n")
        for line in complete:
            yield line.removesuffix(b"\r")
    if pending:
        yield pending.removesuffix(b"\r")
