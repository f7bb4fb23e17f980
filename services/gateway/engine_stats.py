"""What the gateway reads of the engines in the broker: which are registered, and the latest
stats each scheduler wrote (for /stats, /metrics and the engines an abort goes to)."""

from __future__ import annotations

import asyncio

import msgspec

from rill.shared.bus import AsyncBus
from rill.shared.heartbeat import engine_ids
from rill.shared.schema import EngineStats, stats_decoder


async def read_engine_ids(bus: AsyncBus) -> list[int]:
    """The registered engines (engine 0 while none is: a single engine may still be starting)."""
    return engine_ids(await bus.r.smembers(bus.streams.engines_key())) or [0]


class RegisteredEngines:
    """read_engine_ids for aborts: the callers waiting at one moment share one read. A restarted
    scheduler answers hundreds of requests at once, each then aborted; a read each ran the
    broker client out of connections."""

    def __init__(self) -> None:
        self._read: asyncio.Future[list[int]] | None = None

    async def read(self, bus: AsyncBus) -> list[int]:
        read = self._read
        if read is None:
            read = self._read = asyncio.ensure_future(read_engine_ids(bus))
            read.add_done_callback(self._done)
        return await asyncio.shield(read)  # one caller cancelled does not cancel the others' read

    def _done(self, read: asyncio.Future[list[int]]) -> None:
        if self._read is read:
            self._read = None
        if not read.cancelled():
            read.exception()  # retrieved: the callers got it


async def read_engine_stats(bus: AsyncBus | None) -> list[EngineStats]:
    """Every registered engine's latest EngineStats; engines that published none, or an
    undecodable one, are skipped (no broker: none)."""
    if bus is None:
        return []
    out: list[EngineStats] = []
    for payload in await bus.mget([bus.streams.stats_key(e) for e in await read_engine_ids(bus)]):
        if payload is None:
            continue
        try:
            out.append(stats_decoder.decode(payload))
        except msgspec.DecodeError:
            continue
    return out
