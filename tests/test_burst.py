"""A burst of 1,024 concurrent streaming clients (HTTP and WebSocket) against one gateway: each
completes, or beyond the admission cap gets 429 with Retry-After; none gets a 503 while the
engine is up, and the gateway's broker connections stay within a small bound."""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets
from service_stack import ServiceStack, fresh_stack

HTTP_CLIENTS = 768
WS_CLIENTS = 256
BROKER_CONNECTIONS_BOUND = 16  # the gateway's pooled and reader connections, whatever the load


@pytest.fixture(scope="module")
def stack(redis_url: str, smollm2_dir: str) -> Iterator[ServiceStack]:
    with fresh_stack(redis_url, smollm2_dir, "burst", ["--max-num-seqs", "256"]) as s:
        yield s


def broker_connections(pid: int, broker_port: int) -> int:
    """TCP sockets of process `pid` connected to the broker's port (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if int(cols[2].rsplit(":", 1)[1], 16) == broker_port and cols[9] in inodes:
                count += 1
    return count


def test_a_thousand_concurrent_streams(stack: ServiceStack, redis_url: str) -> None:
    gateway_pid = stack.procs["gateway"].pid
    broker_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])

    async def http_one(client: httpx.AsyncClient, i: int) -> str:
        async with client.stream("POST", "/v1/completions", json={
                "prompt": f"Count to {i % 9 + 2}:", "max_tokens": 4, "temperature": 0, "stream": True}) as r:
            if r.status_code != 200:
                await r.aread()
                assert r.status_code != 429 or r.headers.get("retry-after"), r.headers
                return str(r.status_code)
            finish = None
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    finish = chunk["choices"][0]["finish_reason"] if chunk.get("choices") else finish
            return f"done:{finish}"

    async def ws_one(i: int) -> str:
        async with websockets.connect(stack.ws_url, open_timeout=120) as ws:
            await ws.send(json.dumps({"type": "completion", "id": i, "prompt": f"Say {i}:", "max_tokens": 4,
                                      "temperature": 0}))
            while True:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 300))
                if frame["type"] == "done":
                    return f"done:{frame['finish_reason']}"
                if frame["type"] == "error":
                    return f"ws-error:{frame['error'].get('type')}:{frame['error']['message'][:60]}"

    async def run() -> tuple[Counter[str], int]:
        peak = 0
        limits = httpx.Limits(max_connections=HTTP_CLIENTS, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=300, limits=limits) as client:
            tasks = [asyncio.create_task(http_one(client, i)) for i in range(HTTP_CLIENTS)]
            tasks += [asyncio.create_task(ws_one(i)) for i in range(WS_CLIENTS)]
            while not all(t.done() for t in tasks):
                peak = max(peak, broker_connections(gateway_pid, broker_port))
                await asyncio.wait(tasks, timeout=0.5)
            return Counter(t.result() for t in tasks), peak

    outcomes, peak = asyncio.run(run())
    assert set(outcomes) <= {"done:length", "done:stop", "429"}, outcomes
    assert outcomes["done:length"] + outcomes["done:stop"] >= HTTP_CLIENTS // 2, outcomes
    assert 0 < peak <= BROKER_CONNECTIONS_BOUND, peak
    st = stack.wait_idle()
    assert st.num_running == 0 and st.num_free_blocks == st.num_blocks
