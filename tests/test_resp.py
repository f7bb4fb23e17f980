"""The bare RESP connection of the step loop's hot path, against a real broker."""

from __future__ import annotations

import subprocess
import time

import pytest
import redis

from rill.shared.broker import EmbeddedBroker, free_port
from rill.shared.bus import Bus
from rill.shared.resp import RespConnection
from rill.shared.schema import DetokBatch, detok_decoder, encode
from rill.shared.streams import DETOKENIZER_GROUP


def batch(step: int) -> DetokBatch:
    return DetokBatch(engine_id=0, step_id=step, request_ids=[f"r{step}"], reply_to=["g"], offsets=[0],
                      new_token_ids=[[step]], context_ids=[[]], finish_reasons=[None], prompt_tokens=[3],
                      stop=[[]], skip_special_tokens=[True], include_stop_str=[False])


def test_exchange_runs_sends_then_reads_in_order(redis_url: str, prefix: str) -> None:
    bus = Bus(redis_url, prefix, name="resp-test")
    stream = bus.streams.detok(0)
    try:
        replies = bus.exchange([bus.xadd(stream, batch(i)) for i in range(3)] + [Bus.xread(stream, b"0-0", None)])
        ids, read = replies[:3], replies[3]
        got = Bus.entries(read)
        assert [eid for eid, _ in got] == ids  # the read saw the three sends of the same round trip
        assert [detok_decoder.decode(p).step_id for _, p in got] == [0, 1, 2]
        # The single-command helpers agree with redis-py's view of the stream.
        eid = bus.send(stream, batch(3))
        assert bus.r.xlen(stream) == 4 and bus.r.xrange(stream, eid, eid)[0][1][b"m"] == encode(batch(3))
        assert bus.read(stream, eid, block_ms=None) == []
        assert [e for e, _ in bus.read(stream, ids[1], block_ms=None)] == [ids[2], eid]
    finally:
        bus.close()


def test_a_posted_blocking_read_is_answered_while_the_caller_works(redis_url: str, prefix: str) -> None:
    """post() returns at once; the broker answers a blocking read when the entry comes, and
    take() then finds the reply waiting (the worker's plan read). Errors of posted commands
    raise on take(); pipeline() takes what was posted first, so replies never go astray."""
    reader, writer = RespConnection(redis_url), Bus(redis_url, prefix)
    stream = writer.streams.detok(0)
    try:
        t0 = time.monotonic()
        reader.post([Bus.xread(stream, b"0-0", 5000, count=1)])
        assert reader.posted == 1 and time.monotonic() - t0 < 0.5
        eid = writer.send(stream, batch(7))  # arrives while the reader "runs a step"
        time.sleep(0.05)
        t1 = time.monotonic()
        (reply,) = reader.take()
        assert time.monotonic() - t1 < 0.05  # already in the socket
        assert [(e, detok_decoder.decode(p).step_id) for e, p in Bus.entries(reply)] == [(eid, 7)]
        assert reader.posted == 0 and reader.take() == []

        reader.post([("SET", f"{prefix}:k", "v"), ("XADD", f"{prefix}:k", "*", "m", "x")])
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            reader.take()
        reader.post([("INCR", f"{prefix}:n")])
        assert reader.pipeline([("GET", f"{prefix}:n")]) == [b"1"]  # the INCR's reply was taken first
        reader.post([("INCR", f"{prefix}:n")])
        assert reader.take() == [2]
    finally:
        reader.close()
        writer.close()


def test_blocking_read_times_out_to_no_entries(redis_url: str, prefix: str) -> None:
    bus = Bus(redis_url, prefix)
    try:
        t0 = time.monotonic()
        assert bus.read(f"{prefix}:empty", b"0-0", block_ms=150) == []
        assert time.monotonic() - t0 >= 0.1
    finally:
        bus.close()


def test_error_reply_raises_after_the_whole_batch_and_keeps_the_connection_in_step(redis_url: str,
                                                                                  prefix: str) -> None:
    conn = RespConnection(redis_url)
    key = f"{prefix}:k"
    try:
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            conn.pipeline([("SET", key, "v"), ("XADD", key, "*", "m", "x"), ("SET", f"{key}2", "w")])
        # The commands around the failing one ran, and no reply was left behind for the next call.
        assert conn.pipeline([("GET", key), ("GET", f"{key}2")]) == [b"v", b"w"]
        assert conn.execute("PING") == b"PONG"
    finally:
        conn.close()


def test_group_reads_and_acks(redis_url: str, prefix: str) -> None:
    bus = Bus(redis_url, prefix)
    stream = bus.streams.detok(0)
    try:
        bus.ensure_group(stream, DETOKENIZER_GROUP)
        sent = [bus.send(stream, batch(i)) for i in range(2)]
        got = bus.read_group(stream, DETOKENIZER_GROUP, "c1", block_ms=None)
        assert [e for e, _ in got] == sent
        assert [e for e, _ in bus.read_group(stream, DETOKENIZER_GROUP, "c1", None, pending=True)] == sent
        bus.exchange([Bus.xack(stream, DETOKENIZER_GROUP, sent)])
        assert bus.read_group(stream, DETOKENIZER_GROUP, "c1", None, pending=True) == []
        # A group lost with a restarted broker is re-created on the spot.
        bus.r.xgroup_destroy(stream, DETOKENIZER_GROUP)
        later = bus.send(stream, batch(2))
        assert later in [e for e, _ in bus.read_group(stream, DETOKENIZER_GROUP, "c1", None)]
    finally:
        bus.close()


def test_reconnects_after_a_broker_restart_and_fails_clearly_while_it_is_down() -> None:
    port = free_port()
    broker = EmbeddedBroker(port).start()
    conn = RespConnection(broker.url, name="resp-restart")
    try:
        assert conn.execute("SET", "k", "1") == b"OK"
        names = [c["name"] for c in redis.Redis.from_url(broker.url).client_list()]
        assert "resp-restart" in names
        broker.stop()
        with pytest.raises(redis.ConnectionError):
            conn.execute("GET", "k")
        broker = EmbeddedBroker(port).start()
        # A fresh server on the same address: the next command reconnects (it lost the key).
        assert conn.execute("GET", "k") is None
    finally:
        conn.close()
        broker.stop()


def test_password_and_database_from_the_url() -> None:
    with EmbeddedBroker() as broker:
        admin = redis.Redis.from_url(broker.url)
        admin.config_set("requirepass", "s3cret")
        base = broker.url.rsplit("/", 1)[0].replace("redis://", "redis://:s3cret@")
        conn = RespConnection(f"{base}/3")
        try:
            conn.execute("SET", "where", "db3")
            authed = redis.Redis.from_url(f"{base}/3")
            assert authed.get("where") == b"db3"
            assert redis.Redis.from_url(f"{base}/0").get("where") is None
        finally:
            conn.close()
        wrong = RespConnection(broker.url.replace("redis://", "redis://:nope@"))
        with pytest.raises(redis.ResponseError):
            wrong.execute("PING")


async def test_every_client_takes_a_unix_socket_url(tmp_path) -> None:
    """--redis-url unix:///path: the sync and asyncio clients (redis-py's unix connections take
    no TCP keepalive option) and the bare RESP connection all reach a broker on a socket file."""
    from rill.shared.broker import valkey_binary
    from rill.shared.bus import aconnect, connect

    sock = tmp_path / "broker.sock"
    proc = subprocess.Popen([str(valkey_binary()), "--port", "0", "--unixsocket", str(sock), "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"unix://{sock}?db=2"
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        client = connect(url, name="sync client")
        client.set("k", b"sync")
        aclient = aconnect(url, name="async client")
        assert await aclient.get("k") == b"sync"
        await aclient.aclose()
        conn = RespConnection(url)
        assert conn.execute("GET", "k") == b"sync"
        conn.close()
        assert redis.Redis(unix_socket_path=str(sock), db=0).get("k") is None  # the URL's db, not 0
    finally:
        proc.terminate()
        proc.wait(5)


# ------------------------------------------------------------------------- the gateway's reads


async def test_async_blocking_read_waits_for_the_entry(redis_url: str, prefix: str) -> None:
    """The gateway's reply read (AsyncBus.read, redis-py's asyncio client): a blocking XREAD
    answered when the entry is added from another connection; a timed-out block reads as none."""
    import asyncio

    from rill.shared.bus import AsyncBus

    bus, writer = AsyncBus(redis_url, prefix, name="aresp-test"), Bus(redis_url, prefix)
    stream = writer.streams.detok(0)
    try:
        read = asyncio.ensure_future(bus.read(stream, b"0-0", 5000))
        await asyncio.sleep(0.05)
        assert not read.done()
        eid = writer.send(stream, batch(4))
        got = await asyncio.wait_for(read, 2)
        assert [(e, detok_decoder.decode(p).step_id) for e, p in got] == [(eid, 4)]
        t0 = time.monotonic()
        assert await bus.read(stream, eid, 150) == []
        assert time.monotonic() - t0 >= 0.1
        assert "aresp-test" in [c["name"] for c in writer.r.client_list()]
    finally:
        await bus.close()
        writer.close()


async def test_async_cancelled_read_does_not_answer_the_next_command(redis_url: str, prefix: str) -> None:
    """A task stopped mid-XREAD BLOCK: the blocked read's late reply must not be taken as the
    next command's."""
    import asyncio

    from rill.shared.bus import AsyncBus

    bus, writer = AsyncBus(redis_url, prefix), Bus(redis_url, prefix)
    stream = writer.streams.detok(0)
    try:
        read = asyncio.ensure_future(bus.read(stream, b"$", 5000))
        await asyncio.sleep(0.05)
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        writer.send(stream, batch(1))  # would have answered the cancelled read
        assert await bus.r.ping() is True
        assert await bus.get(f"{prefix}:absent") is None
    finally:
        await bus.close()
        writer.close()


async def test_async_reads_fail_clearly_while_the_broker_is_down_and_recover() -> None:
    from rill.shared.bus import AsyncBus

    port = free_port()
    broker = EmbeddedBroker(port).start()
    bus = AsyncBus(broker.url, "rill")
    stream = bus.streams.detok(0)
    try:
        assert await bus.read(stream, b"0-0", None) == []
        broker.stop()
        with pytest.raises(redis.ConnectionError):
            await bus.read(stream, b"0-0", None)
        broker = EmbeddedBroker(port).start()
        assert await bus.read(stream, b"0-0", None) == []  # a fresh server: reconnected
    finally:
        await bus.close()
        broker.stop()
