"""Browsers and rebound hostnames: the gateway answers its own origin and non-browser clients,
refuses cross-origin WebSockets unless allowed, and on loopback refuses foreign Host names."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
import websockets
from test_gateway import serving


async def _handshake(url: str, **headers: str) -> int:
    """101 when the WebSocket opens, else the HTTP status of the refusal."""
    try:
        async with websockets.connect(url, additional_headers=headers or None, open_timeout=5):
            return 101
    except websockets.exceptions.InvalidStatus as exc:
        return exc.response.status_code


def _raw_handshake(port: int, host: str) -> int:
    """A WebSocket upgrade with a chosen Host header (clients set Host from the URL themselves)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(f"GET /v1/ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
        return int(sock.recv(64).split()[1])


def test_cross_origin_websocket_refused_unless_allowed() -> None:
    with serving(bind_host="127.0.0.1", allowed_origins=frozenset({"https://app.example"})) as srv:
        ws = f"ws://127.0.0.1:{srv.port}/v1/ws"
        own = f"http://127.0.0.1:{srv.port}"

        async def all_of() -> list[int]:
            return list(await asyncio.gather(
                _handshake(ws),  # not a browser (rill chat, websockets, SDKs): no Origin
                _handshake(ws, Origin=own),  # the gateway's own chat page
                _handshake(ws, Origin="http://evil.example"),
                _handshake(ws, Origin="https://app.example"),  # listed in --allowed-origins
                _handshake(ws, Origin="https://app.example.evil.example")))

        codes = asyncio.run(all_of())
        assert codes == [101, 101, 403, 101, 403], codes
    with serving(bind_host="127.0.0.1", allowed_origins=frozenset({"*"})) as srv:
        assert asyncio.run(_handshake(f"ws://127.0.0.1:{srv.port}/v1/ws", Origin="http://evil.example")) == 101


@pytest.mark.parametrize("host,status", [("127.0.0.1:{port}", 200), ("localhost:{port}", 200),
                                         ("[::1]:{port}", 200), ("rebound.evil.example:{port}", 403),
                                         ("10.0.0.5:{port}", 403)])
def test_loopback_gateway_answers_loopback_host_names_only(host: str, status: int) -> None:
    with serving(bind_host="127.0.0.1") as srv:
        r = httpx.get(f"{srv.url}/v1/models", headers={"Host": host.format(port=srv.port)})
        assert r.status_code == status, r.text
        if status == 403:
            assert r.json()["error"]["message"].startswith("Host ")
        assert _raw_handshake(srv.port, host.format(port=srv.port)) == (101 if status == 200 else 403)


def test_a_gateway_on_every_interface_takes_any_host() -> None:
    with serving(bind_host="0.0.0.0") as srv:
        assert httpx.get(f"{srv.url}/v1/models", headers={"Host": "rill.internal:8000"}).status_code == 200
