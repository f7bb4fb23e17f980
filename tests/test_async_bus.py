"""The gateway's sends: a burst shares pipelined round trips on one connection."""

from __future__ import annotations

import asyncio
import uuid

import redis

from rill.shared.bus import AsyncBus
from rill.shared.schema import AbortRequest


def test_a_burst_of_sends_shares_one_connection(redis_url: str, prefix: str) -> None:
    name = f"burst-{uuid.uuid4().hex[:8]}"
    stream = f"{prefix}:burst"
    sync = redis.Redis.from_url(redis_url)

    async def burst() -> tuple[list[bytes], int]:
        bus = AsyncBus(redis_url, prefix, name=name)
        try:
            ids = await asyncio.gather(*(bus.send(stream, AbortRequest(request_ids=[f"r{i}"]))
                                         for i in range(1500)))
            clients = [c for c in sync.client_list() if c.get("name", "").startswith(name)]
            return ids, len(clients)
        finally:
            await bus.close()

    try:
        ids, connections = asyncio.run(burst())
        # 1500 concurrent senders: the redis-py pool alone (100 connections) refused most of them.
        assert len(set(ids)) == 1500 and sync.xlen(stream) == 1500
        assert connections <= 3, connections
        order = [e[1][b"m"] for e in sync.xrange(stream)]
        assert len(order) == 1500
    finally:
        sync.delete(stream)
        sync.close()


def test_a_dead_broker_fails_every_waiting_sender(prefix: str) -> None:
    async def to_nowhere() -> list[object]:
        bus = AsyncBus("redis://127.0.0.1:1/0", prefix)  # nothing listens on port 1
        try:
            return await asyncio.gather(*(bus.send(f"{prefix}:x", AbortRequest(request_ids=["r"]))
                                          for _ in range(20)), return_exceptions=True)
        finally:
            await bus.close()

    results = asyncio.run(to_nowhere())
    assert len(results) == 20 and all(isinstance(r, redis.ConnectionError) for r in results), results
