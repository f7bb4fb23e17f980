"""A small Redis-streams bus: stream names, consumer groups, acks and trimming in one place.

Each entry holds one msgspec-encoded message under the field ``m``. Single-reader streams
(plan, result, reply) are read with plain XREAD from the last seen id; replicated stateless
stages (tokenizer, detokenizer) read through consumer groups and XACK after handling.
Blocking connections use ``socket_timeout=None``: redis-py's default timeout plus silent
retries turns a long BLOCK into a hang.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
import redis.asyncio as aioredis
from msgspec import Struct

from rill.shared.schema import encode

FIELD = b"m"

# Groups of replicated readers.
TOKENIZER_GROUP = "tokenizers"
DETOKENIZER_GROUP = "detokenizers"
SCHEDULER_GROUP = "scheduler"


@dataclass(frozen=True)
class Streams:
    """Every stream and key name, derived from one prefix so test runs never collide."""

    prefix: str = "rill"

    @property
    def requests(self) -> str:
        return f"{self.prefix}:requests"

    @property
    def detok(self) -> str:
        return f"{self.prefix}:detok"

    def engine_in(self, engine: int) -> str:
        return f"{self.prefix}:engine:{engine}:in"

    def plan(self, engine: int) -> str:
        return f"{self.prefix}:engine:{engine}:plan"

    def result(self, engine: int) -> str:
        return f"{self.prefix}:engine:{engine}:result"

    def stats_key(self, engine: int) -> str:
        return f"{self.prefix}:engine:{engine}:stats"

    def reply(self, gateway_id: str) -> str:
        return f"{self.prefix}:reply:{gateway_id}"

    def engines_key(self) -> str:
        """Set of engine ids that are serving; tokenizers route to them."""
        return f"{self.prefix}:engines"


# Caps (MAXLEN ~): far above any real backlog, since trimming ignores pending entries.
MAXLEN = {"requests": 100_000, "engine_in": 100_000, "plan": 1_000, "result": 1_000,
          "detok": 20_000, "reply": 20_000}

Entry = tuple[bytes, bytes]  # (entry id, payload)


def _entries(resp) -> list[Entry]:
    out: list[Entry] = []
    for _stream, items in resp or []:
        for entry_id, fields in items:
            if fields and FIELD in fields:  # deleted entries come back as (id, None)
                out.append((entry_id, fields[FIELD]))
    return out


def _is_busygroup(exc: Exception) -> bool:
    return "BUSYGROUP" in str(exc)


class Bus:
    """Synchronous bus for the step loop (scheduler, worker) and the CPU-bound stages."""

    def __init__(self, url: str, prefix: str = "rill") -> None:
        self.streams = Streams(prefix)
        self.r = redis.Redis.from_url(url, socket_timeout=None, decode_responses=False)

    def send(self, stream: str, msg: Struct, maxlen: int = 10_000) -> bytes:
        return self.r.xadd(stream, {FIELD: encode(msg)}, maxlen=maxlen, approximate=True)

    def send_many(self, items: list[tuple[str, Struct, int]]) -> None:
        """Fan-out of one step to several streams in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for stream, msg, maxlen in items:
            pipe.xadd(stream, {FIELD: encode(msg)}, maxlen=maxlen, approximate=True)
        pipe.execute()

    def last_id(self, stream: str) -> bytes:
        """Id of the newest entry, or 0-0; read from here to see only what comes next."""
        got = self.r.xrevrange(stream, count=1)
        return got[0][0] if got else b"0-0"

    def read(self, stream: str, last_id: bytes, block_ms: int | None, count: int = 100) -> list[Entry]:
        return _entries(self.r.xread({stream: last_id}, count=count, block=block_ms))

    def ensure_group(self, stream: str, group: str, start: str = "0") -> None:
        try:
            self.r.xgroup_create(stream, group, id=start, mkstream=True)
        except redis.ResponseError as exc:
            if not _is_busygroup(exc):
                raise

    def read_group(self, stream: str, group: str, consumer: str, block_ms: int | None,
                   count: int = 100, pending: bool = False) -> list[Entry]:
        """New entries for this consumer; with pending=True, its own unacked ones (after a restart)."""
        resp = self.r.xreadgroup(group, consumer, {stream: "0" if pending else ">"},
                                 count=count, block=None if pending else block_ms)
        return _entries(resp)

    def ack(self, stream: str, group: str, ids: list[bytes]) -> None:
        if ids:
            self.r.xack(stream, group, *ids)

    def close(self) -> None:
        self.r.close()


class AsyncBus:
    """asyncio bus for the gateway. Blocking reads get their own connection."""

    def __init__(self, url: str, prefix: str = "rill") -> None:
        self.streams = Streams(prefix)
        self.r = aioredis.Redis.from_url(url, socket_timeout=None, decode_responses=False)
        self.reader = aioredis.Redis.from_url(url, socket_timeout=None, decode_responses=False,
                                              single_connection_client=True)

    async def send(self, stream: str, msg: Struct, maxlen: int = 10_000) -> bytes:
        return await self.r.xadd(stream, {FIELD: encode(msg)}, maxlen=maxlen, approximate=True)

    async def last_id(self, stream: str) -> bytes:
        got = await self.r.xrevrange(stream, count=1)
        return got[0][0] if got else b"0-0"

    async def read(self, stream: str, last_id: bytes, block_ms: int | None, count: int = 500) -> list[Entry]:
        return _entries(await self.reader.xread({stream: last_id}, count=count, block=block_ms))

    async def get(self, key: str) -> bytes | None:
        return await self.r.get(key)

    async def close(self) -> None:
        await self.reader.aclose()
        await self.r.aclose()
