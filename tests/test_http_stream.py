"""The load generator's plain-HTTP streaming reader (an asyncio.Protocol) against a socket server that answers with
each body framing HTTP/1.1 allows: chunked (lines split across chunks, chunk extensions),
Content-Length, and closed-connection delimited; and a reply that is not HTTP."""

from __future__ import annotations

import asyncio

import pytest

from rill.services.clients.http_stream import Head, ProtocolError, stream_lines

LINES = [b"data: {\"a\": 1}", b"", b"data: [DONE]", b""]
BODY = b"\r\n".join(LINES) + b"\r\n"


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out, at = b"", 0
    for i, size in enumerate(sizes):
        piece = body[at:at + size]
        at += size
        ext = b";name=x" if i == 0 else b""  # an extension is allowed after the size
        out += f"{len(piece):x}".encode() + ext + b"\r\n" + piece + b"\r\n"
    assert at >= len(body)
    return out + b"0\r\n\r\n"


async def exchange(reply: bytes, limit: int = 1 << 20) -> tuple[int, dict[str, str], list[bytes], bytes]:
    """Serve `reply` to one POST and read it back: (status, headers, lines, request seen)."""
    seen = bytearray()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        seen.extend(head + await reader.readexactly(length))
        writer.write(reply)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        lines: list[bytes] = []
        heads: list[Head] = []
        head = await stream_lines(f"http://127.0.0.1:{port}/v1/completions?x=1", b'{"p": 1}', lines.append,
                                  {"Authorization": "Bearer k"}, on_head=heads.append, limit=limit)
    assert heads == [head]  # told once, before the lines
    return head.status, head.headers, lines, bytes(seen)


@pytest.mark.parametrize("sizes", [[len(BODY)], [3, 9, 1, 20, 100], [1] * len(BODY)])
def test_chunked_body_lines_survive_any_split(sizes: list[int]) -> None:
    reply = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Rill: yes\r\n\r\n" + chunked(BODY, sizes)
    status, headers, lines, seen = asyncio.run(exchange(reply))
    assert status == 200 and headers["x-rill"] == "yes"
    assert lines == LINES
    assert seen.startswith(b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"Authorization: Bearer k\r\n" in seen and seen.endswith(b'\r\n\r\n{"p": 1}')


def test_content_length_and_close_delimited_bodies() -> None:
    error = b'{"error": {"message": "nope"}}'
    status, _, lines, _ = asyncio.run(exchange(
        b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n" % len(error) + error))
    assert status == 404 and lines == [error]
    status, _, lines, _ = asyncio.run(exchange(b"HTTP/1.0 200 OK\r\n\r\n" + BODY))
    assert status == 200 and lines == LINES


def test_a_reply_that_is_not_http_is_an_error() -> None:
    with pytest.raises(ProtocolError):
        asyncio.run(exchange(b"SSH-2.0-OpenSSH\r\n\r\n"))


def test_a_body_cut_short_is_an_error() -> None:
    with pytest.raises(asyncio.IncompleteReadError):
        asyncio.run(exchange(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nonly five"))


def test_many_chunks_in_one_segment_and_a_runaway_size_line() -> None:
    # Several events in one write come out in order; a chunk larger than the limit is fine.
    big = b"data: " + b"x" * 5000
    body = b"\r\n".join([*LINES[:2], big, b"", *LINES[2:]]) + b"\r\n"
    reply = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(body, [7, 5000, 11, len(body)])
    _, _, lines, _ = asyncio.run(exchange(reply, limit=4096))
    assert lines == [*LINES[:2], big, b"", *LINES[2:]]
    # A size line that never ends is cut off at the limit instead of buffering forever.
    with pytest.raises(ProtocolError):
        asyncio.run(exchange(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"f" * 9000, limit=4096))


def test_the_handler_stops_the_read_and_its_errors_surface() -> None:
    """on_line returning True ends the exchange at that line; an exception it raises (a bad
    event) comes out of stream_lines instead of being lost in the event loop."""
    reply = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(BODY, [len(BODY)])

    async def run(on_line) -> list[bytes]:
        seen: list[bytes] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(reply)  # and the connection stays open: only the handler ends the read
            await writer.drain()
            await asyncio.sleep(5)
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            def record(line: bytes) -> bool | None:
                seen.append(line)
                return on_line(line)
            await asyncio.wait_for(stream_lines(f"http://127.0.0.1:{port}/", b"{}", record), 2)
        return seen

    assert asyncio.run(run(lambda line: line == b"data: [DONE]")) == LINES[:3]

    def bad(line: bytes) -> None:
        if line.startswith(b"data: [DONE]"):
            raise ValueError("undecodable event")

    with pytest.raises(ValueError, match="undecodable"):
        asyncio.run(run(bad))
