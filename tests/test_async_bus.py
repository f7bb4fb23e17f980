"""The gateway's sends: a burst shares pipelined round trips on one connection."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis

from rill.shared.bus import AsyncBus, Bus
from rill.shared.schema import AbortRequest
from rill.shared.streams import KINDS, Streams, WrongStream


def test_a_burst_of_sends_shares_one_connection(redis_url: str, prefix: str) -> None:
    name = f"burst-{uuid.uuid4().hex[:8]}"
    stream = Streams(prefix).engine_in(0)
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
            return await asyncio.gather(*(bus.send(bus.streams.engine_in(0), AbortRequest(request_ids=["r"]))
                                          for _ in range(20)), return_exceptions=True)
        finally:
            await bus.close()

    results = asyncio.run(to_nowhere())
    assert len(results) == 20 and all(isinstance(r, redis.ConnectionError) for r in results), results


def test_a_send_takes_its_cap_from_the_stream_and_refuses_what_the_stream_does_not_carry(
        redis_url: str, prefix: str) -> None:
    """streams.KINDS is the one place that says what goes where, and with which cap."""
    bus = Bus(redis_url, prefix)
    s = bus.streams
    try:
        abort = AbortRequest(request_ids=["r"])
        assert bus.xadd(s.engine_in(3), abort)[:5] == ("XADD", s.engine_in(3), "MAXLEN", "~", KINDS["engine_in"].cap)
        assert s.cap(s.plan(0)) == KINDS["plan"].cap and s.cap(s.reply("g")) == KINDS["reply"].cap
        with pytest.raises(WrongStream, match="AbortRequest may not be sent on"):
            bus.send(s.plan(0), abort)
        with pytest.raises(WrongStream, match="not one of the streams"):
            bus.send(f"{prefix}:elsewhere", abort)
        with pytest.raises(WrongStream):
            bus.send_many([(s.engine_in(0), abort), (s.detok(0), abort)])
        with pytest.raises(WrongStream):
            bus.ack_and_send_many(s.requests("g"), "g", [(b"1-0", [(s.reply("g"), abort)])])
        assert not bus.r.exists(s.engine_in(0), s.detok(0), s.reply("g"))  # a refused batch sends nothing

        async def refused() -> None:
            abus = AsyncBus(redis_url, prefix)
            try:
                with pytest.raises(WrongStream):
                    await abus.send(s.requests("g"), abort)
            finally:
                await abus.close()

        asyncio.run(refused())
    finally:
        bus.close()
