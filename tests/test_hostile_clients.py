"""Slow and many clients against a gateway served the deployed way (server.py's uvicorn settings),
the test playing the downstream services: read deadlines, the connection cap, the WebSocket frame
limit and idle timeout, the admission cap (429 + Retry-After) and the progress deadline (504)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
import uvicorn
import websockets
from test_gateway import REDIS_URL, Downstream, _free_port, make_deltas

from rill.services.gateway.app import create_app
from rill.services.gateway.server import ServerLimits, server_config
from rill.shared.broker import EmbeddedBroker
from rill.shared.schema import TextDelta


class Served:
    def __init__(self, prefix: str, port: int, app: Any) -> None:
        self.prefix, self.port, self.app = prefix, port, app

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws"


@contextlib.contextmanager
def served(limits: ServerLimits | None = None, ws_max_size: int = 16 << 20, redis_url: str = REDIS_URL,
           **options: Any) -> Iterator[Served]:
    """create_app under the deployed uvicorn settings, in a thread, on a fresh prefix."""
    prefix = f"test-hc-{uuid.uuid4().hex[:10]}"
    port = _free_port()
    app = create_app(redis_url, prefix, "test-model", 2048, bind_host="127.0.0.1", **options)
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, limits or ServerLimits(), ws_max_size))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "gateway did not start"
        time.sleep(0.01)
    try:
        yield Served(prefix, port, app)
    finally:
        server.should_exit = True
        thread.join(10)
        r = redis.Redis.from_url(redis_url)
        keys = list(r.scan_iter(match=f"{prefix}:*"))
        if keys:
            r.delete(*keys)
        r.close()


async def _timed_health(url: str) -> tuple[int, float]:
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=5) as client:  # a new connection
        status = (await client.get(f"{url}/health")).status_code
    return status, time.monotonic() - start


# ---------------------------------------------------------------------------------------------
# Slow clients


def test_slowloris_headers_are_cut_and_health_still_answers() -> None:
    with served(ServerLimits(header_timeout_s=1.0, body_timeout_s=1.0)) as srv:

        async def attack() -> tuple[list[tuple[int, float]], list[bool], bool]:
            conns = [await asyncio.open_connection("127.0.0.1", srv.port) for _ in range(64)]
            for _, w in conns:
                w.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")

            async def trickle() -> None:  # one header line every 0.2 s: never a complete request
                with contextlib.suppress(ConnectionError):
                    for i in range(15):
                        for _, w in conns:
                            if not w.is_closing():
                                w.write(b"X-Slow-%d: x\r\n" % i)
                        await asyncio.sleep(0.2)

            trickler = asyncio.create_task(trickle())
            await asyncio.sleep(0.3)
            timings = [await _timed_health(srv.url) for _ in range(3)]
            cut = await asyncio.gather(*(_eof(r, 3.0) for r, _ in conns))
            trickler.cancel()
            # A body that stalls after its headers is cut too.
            r, w = await asyncio.open_connection("127.0.0.1", srv.port)
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{\"prompt\":")
            body_cut = await _eof(r, 3.0)
            for _, w in conns:
                w.close()
            return timings, cut, body_cut

        timings, cut, body_cut = asyncio.run(attack())
        assert all(status == 200 and took < 2.0 for status, took in timings), timings
        assert all(cut), f"{cut.count(False)} of 64 slowloris connections were still open after 3 s"
        assert body_cut


async def _eof(reader: asyncio.StreamReader, within: float) -> bool:
    """True once the server closed the connection (EOF or reset) within `within` seconds."""
    try:
        async with asyncio.timeout(within):
            while True:
                data = await reader.read(4096)
                if not data:
                    return True
    except ConnectionError:
        return True
    except TimeoutError:
        return False


async def _response(reader: asyncio.StreamReader) -> bytes:
    """One HTTP response's status line (its body read past, by Content-Length)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length"))
    await reader.readexactly(length)
    return head.split(b"\r\n")[0]


def test_kept_alive_connection_idles_past_the_header_deadline() -> None:
    """Idle between requests is the keep-alive timer's, not the header deadline's: a client whose
    pool keeps a connection as long as the server does loses requests sent as it closes."""
    with served(ServerLimits(header_timeout_s=0.5, keep_alive_s=2.5)) as srv:
        get = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"

        async def client() -> tuple[bytes, bytes, bool, float]:
            r, w = await asyncio.open_connection("127.0.0.1", srv.port)
            w.write(get)
            first = await _response(r)
            await asyncio.sleep(1.2)  # idle past the header deadline
            w.write(get)
            second = await _response(r)
            w.write(b"GET /health HTTP/1.1\r\n")  # then a trickle: the deadline runs from its first byte
            trickle_cut = await _eof(r, 1.5)
            w.close()
            r, w = await asyncio.open_connection("127.0.0.1", srv.port)
            w.write(get)
            await _response(r)
            start = time.monotonic()
            await _eof(r, 6.0)
            w.close()
            return first, second, trickle_cut, time.monotonic() - start

        first, second, trickle_cut, idle_closed_after = asyncio.run(client())
        assert first.startswith(b"HTTP/1.1 ") and second.split()[1] == first.split()[1], (first, second)
        assert trickle_cut
        assert 2.0 < idle_closed_after < 4.5, idle_closed_after


def test_connection_cap_answers_503_then_frees() -> None:
    with served(ServerLimits(header_timeout_s=30.0, max_connections=8)) as srv:

        async def flood() -> tuple[int, str, int]:
            idle = [await asyncio.open_connection("127.0.0.1", srv.port) for _ in range(8)]
            await asyncio.sleep(0.1)
            status, _ = await _timed_health(srv.url)
            async with httpx.AsyncClient(timeout=5) as client:
                resp = await client.get(f"{srv.url}/health")
            for _, w in idle:
                w.close()
            await asyncio.sleep(0.3)
            after, _ = await _timed_health(srv.url)
            return status, resp.text, after

        status, body, after = asyncio.run(flood())
        assert status == 503 and "connections" in json.loads(body)["error"]["message"]
        assert after == 200


def test_websocket_frame_limit_is_the_body_limit() -> None:
    with served(ws_max_size=64 << 10, max_request_body_bytes=64 << 10) as srv:

        async def frames() -> tuple[str, int]:
            async with websockets.connect(srv.ws, max_size=None) as ws:
                await ws.send(json.dumps({"type": "nonsense", "id": 1, "pad": "x" * 1000}))
                small = json.loads(await ws.recv())["type"]  # under the limit: an error frame, socket open
                await ws.send(json.dumps({"type": "chat", "id": 2, "pad": "x" * (100 << 10)}))
                with pytest.raises(websockets.exceptions.ConnectionClosedError) as closed:
                    await ws.recv()
                return small, closed.value.rcvd.code

        small, code = asyncio.run(frames())
        assert small == "error" and code == 1009  # 1009: message too big


def test_idle_websocket_is_closed_busy_one_is_not() -> None:
    with served(ws_idle_timeout_s=1.0) as srv:
        down = Downstream(srv.prefix)

        async def sockets() -> tuple[float, int | None, str]:
            start = time.monotonic()
            async with websockets.connect(srv.ws) as idle, websockets.connect(srv.ws) as busy:
                await busy.send(json.dumps({"type": "completion", "id": 1, "prompt": "hi", "max_tokens": 4}))
                req = await down.next_request()
                with pytest.raises(websockets.exceptions.ConnectionClosedOK):
                    await asyncio.wait_for(idle.recv(), 5)
                idle_after = time.monotonic() - start
                await asyncio.sleep(1.5)  # the busy socket outlives the idle timeout
                await down.reply(req.reply_to, make_deltas(req.request_id, ["a", "b"]))
                frames = [json.loads(await busy.recv()) for _ in range(2)]
            await down.close()
            return idle_after, idle.close_code, frames[-1]["type"]

        idle_after, code, last = asyncio.run(sockets())
        assert idle_after < 3.0 and code == 1000
        assert last == "done"


# ---------------------------------------------------------------------------------------------
# Admission cap and progress deadline


def test_admission_cap_answers_429_then_recovers() -> None:
    with served(max_waiting_requests=2) as srv:
        down = Downstream(srv.prefix)
        client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=10)

        async def burst() -> None:
            waiting = [asyncio.create_task(client.completions.create(model="test-model", prompt="p", max_tokens=2))
                       for _ in range(2)]
            reqs = [await down.next_request() for _ in range(2)]
            # Over the cap: 429 with Retry-After, over HTTP ...
            async with httpx.AsyncClient(timeout=5) as http:
                resp = await http.post(f"{srv.url}/v1/completions", json={"prompt": "p", "max_tokens": 2})
            assert resp.status_code == 429 and resp.headers["retry-after"] == "1", resp.text
            assert resp.json()["error"]["code"] == "rate_limit_exceeded"
            with pytest.raises(openai.RateLimitError):
                await client.completions.create(model="test-model", prompt="p", max_tokens=2)
            # ... and as an error frame on the WebSocket, which stays open.
            async with websockets.connect(srv.ws) as ws:
                await ws.send(json.dumps({"type": "completion", "id": "a", "prompt": "p", "max_tokens": 2}))
                frame = json.loads(await ws.recv())
                assert frame["type"] == "error" and frame["error"]["code"] == "rate_limit_exceeded", frame
                # One request starts running (its first token): room for one more.
                first = make_deltas(reqs[0].request_id, ["x", "y"])
                await down.reply(reqs[0].reply_to, first[:1])
                await asyncio.sleep(0.1)
                await ws.send(json.dumps({"type": "completion", "id": "b", "prompt": "p", "max_tokens": 2}))
                third = await down.next_request()
                await down.reply(reqs[0].reply_to, first[1:])
                for req in (reqs[1], third):
                    await down.reply(req.reply_to, make_deltas(req.request_id, ["x", "y"]))
                frames = [json.loads(await ws.recv()) for _ in range(2)]
                assert frames[-1]["type"] == "done", frames
            assert [c.choices[0].text for c in await asyncio.gather(*waiting)] == ["xy", "xy"]
            # Load gone: requests are admitted again.
            again = asyncio.create_task(client.completions.create(model="test-model", prompt="p", max_tokens=2))
            req = await down.next_request()
            await down.reply(req.reply_to, make_deltas(req.request_id, ["ok"]))
            assert (await again).choices[0].text == "ok"
            await down.close()

        asyncio.run(burst())


def test_request_without_progress_gets_504_and_is_aborted() -> None:
    with served(progress_timeout_s=1.0) as srv:
        down = Downstream(srv.prefix)

        async def stall() -> None:
            async with httpx.AsyncClient(base_url=srv.url, timeout=10) as http:
                start = time.monotonic()
                task = asyncio.create_task(http.post("/v1/completions", json={"prompt": "p", "max_tokens": 9}))
                req = await down.next_request()
                # Offset 0 lost (trimmed before anyone read it): the later delta waits for a gap
                # that never fills, which must not count as progress.
                await down.reply(req.reply_to, [TextDelta(req.request_id, 1, 1, "late")])
                resp = await task
                took = time.monotonic() - start
                assert resp.status_code == 504 and resp.json()["error"]["type"] == "timeout", resp.text
                assert 1.0 <= took < 3.0, took
                assert req.request_id in await down.aborted_ids()
                # A request that keeps making progress is not touched.
                task = asyncio.create_task(http.post("/v1/completions", json={"prompt": "p", "max_tokens": 9}))
                req = await down.next_request()
                deltas = make_deltas(req.request_id, ["a"] * 5)
                for d in deltas:
                    await down.reply(req.reply_to, [d])
                    await asyncio.sleep(0.5)
                resp = await task
                assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "aaaaa"
            # On the WebSocket: an error frame for the stalled request, the other one completes.
            async with websockets.connect(srv.ws) as ws:
                for cid in ("stalled", "fine"):
                    await ws.send(json.dumps({"type": "completion", "id": cid, "prompt": "p", "max_tokens": 9}))
                stalled_req, fine_req = [await down.next_request() for _ in range(2)]
                for d in make_deltas(fine_req.request_id, ["b"] * 3):
                    await down.reply(fine_req.reply_to, [d])
                    await asyncio.sleep(0.5)
                frames = [json.loads(await asyncio.wait_for(ws.recv(), 5)) for _ in range(5)]
                ends = {f["id"]: f for f in frames if f["type"] in ("done", "error")}
                assert ends["stalled"]["type"] == "error" and ends["stalled"]["error"]["code"] == 504, frames
                assert ends["fine"]["type"] == "done", frames
            await down.close()

        asyncio.run(stall())


def test_full_broker_gives_new_requests_503_and_recovers() -> None:
    with EmbeddedBroker(maxmemory=4 << 20) as broker, served(redis_url=broker.url) as srv:
        r = redis.Redis.from_url(broker.url)
        assert r.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        for size in (4096, 64):  # to the brim: a write is refused only while memory is over the limit
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                for i in range(4096):
                    r.set(f"fill:{size}:{i}", b"x" * size)
        # Used memory drifts (client buffers come and go), and a dip under the limit would let the
        # request in: hold the limit well under what is used until the fill is deleted.
        used = int(r.info("memory")["used_memory"])
        r.config_set("maxmemory", used - (1 << 20))
        body = {"prompt": "p", "max_tokens": 2}
        resp = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=10)
        assert resp.status_code == 503 and "full" in resp.json()["error"]["message"], resp.text
        r.delete(*r.keys("fill:*"))  # room again: the same gateway takes requests
        r.config_set("maxmemory", 4 << 20)
        down = Downstream(srv.prefix, broker.url)

        async def served_again() -> str:
            async with httpx.AsyncClient(base_url=srv.url, timeout=10) as http:
                task = asyncio.create_task(http.post("/v1/completions", json=body))
                req = await down.next_request()
                await down.reply(req.reply_to, make_deltas(req.request_id, ["ok"]))
                text = (await task).json()["choices"][0]["text"]
            await down.close()
            return text

        assert asyncio.run(served_again()) == "ok"
