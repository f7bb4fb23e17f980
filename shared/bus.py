"""A small Redis-streams bus: connections, sends, reads, consumer groups, acks and trimming.
Stream names, caps and the message types each stream carries are in streams.py: every send
derives its cap from the stream's name there, and refuses a message the stream does not carry
(WrongStream). The replicas' consumer loop is in group_consumer.py.

Each entry holds one msgspec-encoded message under the field ``m``. Single-reader streams
(plan, result, reply) are read with plain XREAD from the last seen id; replicated stateless
stages (tokenizer, detokenizer) read through consumer groups and XACK after handling.
Blocking connections use ``socket_timeout=None``: redis-py's default timeout plus silent
retries turns a long BLOCK into a hang.

The sync Bus sends the per-step commands (XADD, XREAD, XREADGROUP, XACK) over a bare RESP
connection (resp.py: redis-py costs twice the CPU per command, taken from the worker's cores on
a small CPU server), and `exchange` batches a loop's commands into one round trip.

Fault handling lives here too. A failed command is retried once, at once, on a fresh
connection (a pooled connection may predate a broker restart), and no more: an outage reaches
the loops at once, which catch RedisError, back off (`Backoff`) and reconnect. A reconnect can
be silent, so the stateful services also compare `server_id()` (the broker's run_id) to learn
that a restarted broker lost its streams. A missing consumer group (NOGROUP, after a restart)
is re-created on the spot.

Group streams are trimmed only below their oldest unread or unacked entry (`trim_consumed`),
so trimming never drops work; the MAXLEN caps on XADD stay as the hard bound.

A URL that reaches a Redis Cluster gets redis-py's cluster clients and the few rules that differ
there (cluster.py).
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Sequence

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
from msgspec import Struct
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from rill.shared import cluster
from rill.shared.cluster import ClusterHot, Lineage, follow_asks, is_cluster, seed_nodes, seed_urls
from rill.shared.lifecycle import StopFlag
from rill.shared.resp import Command, RespConnection
from rill.shared.schema import encode
from rill.shared.streams import Streams

FIELD = b"m"
SEND_BATCH = 256  # most entries in one pipelined round trip of the gateway's sends

# An entry a replica read but has not acked for this long is taken over by another replica
# (XAUTOCLAIM). Handling an entry takes milliseconds, and redoing one is harmless (tokenizer:
# forwarding is exactly-once, see ack_and_send; detokenizer: the gateway drops repeats).
CLAIM_IDLE_MS = 5_000



Entry = tuple[bytes, bytes]  # (entry id, payload)


def _is_busygroup(exc: Exception) -> bool:
    return "BUSYGROUP" in str(exc)


def is_nogroup(exc: Exception) -> bool:
    """The group (or its stream) is gone: a broker restarted without persistence."""
    # A cluster pipeline's errors start with which command of it failed.
    return isinstance(exc, redis.ResponseError) and "NOGROUP" in str(exc)


class BrokerRestarted(redis.ConnectionError):
    """The broker answers, but it is not the server we were talking to: its streams are gone."""


class Backoff:
    """Exponential backoff with jitter for reconnect loops: first, 2x, 4x ... up to `cap` seconds."""

    def __init__(self, first: float = 0.1, cap: float = 2.0) -> None:
        self.first = first
        self.cap = cap
        self.failures = 0

    def next(self) -> float:
        delay = min(self.cap, self.first * 2 ** self.failures)
        self.failures += 1
        return delay * random.uniform(0.75, 1.0)

    def reset(self) -> None:
        self.failures = 0


def _client_name(name: str | None) -> str | None:
    """CLIENT SETNAME refuses spaces and the like; a bad name must not break connecting."""
    return None if not name else re.sub(r"[^A-Za-z0-9_.:@-]", "_", name)[:64]


def _tcp_options(url: str) -> dict[str, bool]:
    """Keepalive for TCP brokers; a unix:// socket's connection class takes no such option."""
    return {} if url.startswith("unix:") else {"socket_keepalive": True}


def connect(url: str, socket_timeout: float | None = None, name: str | None = None) -> redis.Redis:
    """A client that retries a command once, at once (see module doc); None: no read timeout.
    `name` is shown by CLIENT LIST (which replica holds which connection). A cluster's URL gets
    a cluster client (its commands are the same)."""
    if is_cluster(url):
        client = RedisCluster.from_url(seed_urls(url)[0], socket_timeout=socket_timeout,
                                       socket_connect_timeout=5, decode_responses=False,
                                       startup_nodes=[ClusterNode(h, p) for h, p in seed_nodes(url)],
                                       client_name=_client_name(name), **_tcp_options(url))
        follow_asks(client)
        return client  # type: ignore[return-value]
    return redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=5,
                                retry=Retry(NoBackoff(), 1), decode_responses=False,
                                client_name=_client_name(name), **_tcp_options(url))


def aconnect(url: str, socket_timeout: float | None = None, name: str | None = None) -> aioredis.Redis:
    if is_cluster(url):
        client = aiocluster.RedisCluster.from_url(
            seed_urls(url)[0], socket_timeout=socket_timeout, socket_connect_timeout=5, decode_responses=False,
            startup_nodes=[aiocluster.ClusterNode(h, p) for h, p in seed_nodes(url)],
            client_name=_client_name(name), **_tcp_options(url))
        follow_asks(client)
        return client  # type: ignore[return-value]
    return aioredis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=5,
                                   retry=AsyncRetry(NoBackoff(), 1), decode_responses=False,
                                   client_name=_client_name(name), **_tcp_options(url))


def hot_connection(url: str, name: str | None = None, client: redis.Redis | None = None) -> RespConnection | ClusterHot:
    """The hot path's connection: a bare RESP socket, or over a cluster one per master, routed by
    the slot map of `client` (a cluster client of the same URL; a new one if not given)."""
    if is_cluster(url):
        return ClusterHot(client or connect(url, name=name), url, _client_name(name))  # type: ignore[arg-type]
    return RespConnection(url, name=_client_name(name))


def server_id_of(info: dict) -> str:
    """The broker's run_id from INFO server: it changes whenever the server restarts."""
    run_id = info.get("run_id", "")
    return run_id.decode() if isinstance(run_id, bytes) else str(run_id)


# Ack one entry and forward its outputs, atomically, and only if nobody acked it before: a
# replica that claimed a slow replica's entry and the slow replica itself cannot both forward.
# KEYS[1] source stream, KEYS[2..n] destinations; ARGV[1] group, ARGV[2] entry id, then a
# (maxlen, payload) pair per destination.
_ACK_AND_SEND = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
for i = 2, #KEYS do
  redis.call('XADD', KEYS[i], 'MAXLEN', '~', ARGV[2 * i - 1], '*', 'm', ARGV[2 * i])
end
return 1
"""


class Bus:
    """Synchronous bus for the step loop (scheduler, worker) and the CPU-bound stages.

    The per-step commands (sends, reads, acks) go over a bare RESP connection (resp.py), and a
    loop can batch a step's commands into one round trip with `exchange`; everything else uses
    redis-py (`self.r`)."""

    def __init__(self, url: str, prefix: str = "rill", name: str | None = None) -> None:
        self.url = url
        self.streams = Streams(prefix)
        self.r = connect(url, name=name)
        self.cluster = isinstance(self.r, RedisCluster)
        self.lineage = Lineage()
        self.hot = hot_connection(url, name, self.r)
        self._ack_and_send = self.r.register_script(_ACK_AND_SEND)

    # Commands, to batch with exchange(); the methods below run one at once.

    def xadd(self, stream: str, msg: Struct) -> Command:
        return ("XADD", stream, "MAXLEN", "~", self.streams.admit(stream, msg), "*", FIELD, encode(msg))

    @staticmethod
    def xread(stream: str, last_id: bytes, block_ms: int | None, count: int = 100) -> Command:
        block = () if block_ms is None else ("BLOCK", block_ms)
        return ("XREAD", "COUNT", count, *block, "STREAMS", stream, last_id)

    @staticmethod
    def xreadgroup(stream: str, group: str, consumer: str, block_ms: int | None, count: int = 100,
                   pending: bool = False) -> Command:
        block = () if block_ms is None or pending else ("BLOCK", block_ms)
        return ("XREADGROUP", "GROUP", group, consumer, "COUNT", count, *block, "STREAMS", stream,
                "0" if pending else ">")

    @staticmethod
    def xack(stream: str, group: str, ids: list[bytes]) -> Command:
        return ("XACK", stream, group, *ids)

    def exchange(self, commands: list[Command]) -> list:
        """Run `commands` in order in one round trip; their raw replies (reads: see entries())."""
        return self.hot.pipeline(commands) if commands else []

    @staticmethod
    def entries(reply) -> list[Entry]:
        """The entries of a raw XREAD / XREADGROUP reply (nil when a block timed out)."""
        out: list[Entry] = []
        for _stream, items in reply or ():
            for entry_id, fields in items:
                # Fields are [b"m", payload]. A deleted entry (id, nil) or one without that field
                # comes back with an empty payload, which no decoder accepts: its reader drops it
                # and moves past it (skipping it here would leave a cursor stuck before it).
                if isinstance(fields, dict):  # as redis-py's cluster client parses it
                    out.append((entry_id, fields.get(FIELD, b"")))
                    continue
                ok = fields and len(fields) >= 2 and fields[0] == FIELD
                out.append((entry_id, fields[1] if ok else b""))
        return out

    def send(self, stream: str, msg: Struct) -> bytes:
        return self.hot.execute(*self.xadd(stream, msg))

    def send_many(self, items: list[tuple[str, Struct]]) -> None:
        """Fan-out of one step to several streams in one round trip."""
        self.exchange([self.xadd(stream, msg) for stream, msg in items])

    def last_id(self, stream: str) -> bytes:
        """Id of the newest entry, or 0-0; read from here to see only what comes next."""
        got = self.r.xrevrange(stream, count=1)
        return got[0][0] if got else b"0-0"

    def read(self, stream: str, last_id: bytes, block_ms: int | None, count: int = 100) -> list[Entry]:
        return self.entries(self.hot.execute(*self.xread(stream, last_id, block_ms, count)))

    def ensure_group(self, stream: str, group: str, start: str = "0") -> None:
        try:
            self.r.xgroup_create(stream, group, id=start, mkstream=True)
        except redis.ResponseError as exc:
            if not _is_busygroup(exc):
                raise

    def read_group(self, stream: str, group: str, consumer: str, block_ms: int | None,
                   count: int = 100, pending: bool = False, before: list[Command] | None = None) -> list[Entry]:
        """New entries for this consumer; with pending=True, its own unacked ones (after a restart).
        `before`: commands to run first, in the same round trip.

        A group lost with a restarted broker is re-created (from the stream's start: whatever
        was added since the restart is still unread)."""
        cmd = self.xreadgroup(stream, group, consumer, block_ms, count, pending)
        try:
            resp = self.exchange([*(before or ()), cmd])[-1]
        except redis.ResponseError as exc:
            if not is_nogroup(exc):
                raise
            self.ensure_group(stream, group)
            resp = self.hot.execute(*cmd)
        return self.entries(resp)

    def ack(self, stream: str, group: str, ids: list[bytes]) -> None:
        if ids:
            self.hot.execute(*self.xack(stream, group, ids))

    def ack_and_send_many(self, stream: str, group: str,
                          items: list[tuple[bytes, list[tuple[str, Struct]]]]) -> list[bool]:
        """For each (entry id, sends): ack the entry and do its sends in one atomic step, unless
        the entry was acked already (then nothing is sent). True where this call sent."""
        if not items:
            return []
        admit = self.streams.admit
        if self.cluster:
            return cluster.forward_exactly_once(self.r, stream, group, [  # type: ignore[arg-type]
                (entry_id, [(dest, admit(dest, msg), encode(msg)) for dest, msg in sends]) for entry_id, sends in items])
        pipe = self.r.pipeline(transaction=False)
        for entry_id, sends in items:
            args: list[bytes | str | int] = [group, entry_id]
            for dest, msg in sends:
                args += [admit(dest, msg), encode(msg)]
            self._ack_and_send(keys=[stream, *(dest for dest, _ in sends)], args=args, client=pipe)
        return [bool(n) for n in pipe.execute()]

    def claim(self, stream: str, group: str, consumer: str, idle_ms: int = CLAIM_IDLE_MS,
              count: int = 64, max_batches: int = 100) -> list[list[Entry]]:
        """Take over entries other consumers read and left unacked for `idle_ms` (they died).

        Returns batches of claimed entries; entries deleted or trimmed meanwhile are acked."""
        batches: list[list[Entry]] = []
        cursor: bytes | str = "0-0"
        for _ in range(max_batches):  # each call scans a bounded slice of the pending list
            resp = self.r.xautoclaim(stream, group, consumer, min_idle_time=idle_ms, start_id=cursor, count=count)
            cursor, claimed = resp[0], resp[1]
            entries = [(eid, fields[FIELD]) for eid, fields in claimed if fields and FIELD in fields]
            gone = [eid for eid, fields in claimed if not fields or FIELD not in fields]
            if len(resp) > 2:
                gone += list(resp[2])
            if entries:
                batches.append(entries)
            self.ack(stream, group, gone)
            if cursor in (b"0-0", "0-0"):
                break
        return batches

    def trim_consumed(self, stream: str) -> None:
        """Drop entries every group has read and acked (XTRIM MINID ~ below the oldest pending
        or undelivered one): trimming that can never lose work."""
        try:
            groups = self.r.xinfo_groups(stream)
        except redis.ResponseError:
            return  # no such stream
        if not groups:
            return
        floor: tuple[int, int] | None = None
        for g in groups:
            oldest = g["last-delivered-id"]
            if g["pending"]:
                summary = self.r.xpending(stream, g["name"])
                if summary["min"] is not None:
                    oldest = summary["min"]
            ms, seq = (int(x) for x in (oldest.decode() if isinstance(oldest, bytes) else oldest).split("-"))
            floor = (ms, seq) if floor is None else min(floor, (ms, seq))
        if floor is not None and floor > (0, 0):
            self.r.xtrim(stream, minid=f"{floor[0]}-{floor[1]}", approximate=True)

    def reap_consumers(self, stream: str, group: str, idle_ms: int = 60_000) -> int:
        """Delete consumers (dead replicas' names) idle that long with nothing pending."""
        try:
            consumers = self.r.xinfo_consumers(stream, group)
        except redis.ResponseError:
            return 0
        dead = [c["name"] for c in consumers if not c["pending"] and c["idle"] >= idle_ms]
        for name in dead:
            self.r.xgroup_delconsumer(stream, group, name)
        return len(dead)

    def server_id(self, key: str | None = None) -> str:
        """Changes when the broker lost its streams: a restart, or a cluster's failover (given
        `key`, of the master that holds it; not a reshard, cluster.Lineage)."""
        if self.cluster:
            return self.lineage.id(self.r.cluster_nodes(), key)
        return server_id_of(self.r.info("server"))

    def mget(self, keys: list[str]) -> list[bytes | None]:
        """GET of many keys; a cluster's client asks each slot's master."""
        if not keys:
            return []
        return self.r.mget_nonatomic(keys) if self.cluster else self.r.mget(keys)  # type: ignore[attr-defined]

    def wait_for_broker(self, stop: StopFlag, backoff: Backoff | None = None, key: str | None = None) -> bool:
        """Ping with backoff until the broker answers (True) or `stop` is set (False); on a
        cluster, given `key`, until the master of its slot does."""
        backoff = backoff or Backoff()
        while not stop:
            try:
                if self.cluster and key is not None:
                    self.r.exists(key)
                else:
                    self.r.ping()
                return True
            except redis.RedisError:
                stop.wait(backoff.next())
        return False

    def close(self) -> None:
        self.hot.close()
        self.r.close()


class AsyncBus:
    """asyncio bus for the gateway, on redis-py's asyncio client (`self.r`). Its blocking read of
    the reply stream once a step went through a hand-written asyncio RESP connection until a
    same-run A/B showed no measurable gain (scripts/benchmarks.md)."""

    def __init__(self, url: str, prefix: str = "rill", name: str | None = None) -> None:
        self.streams = Streams(prefix)
        self.r = aconnect(url, name=name)
        self.cluster = isinstance(self.r, aiocluster.RedisCluster)
        self.lineage = Lineage()
        self._outbox: list[tuple[str, bytes, int, asyncio.Future[bytes]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def send(self, stream: str, msg: Struct) -> bytes:
        """XADD, queued with whatever else is waiting to be sent and written in one pipelined
        round trip on one connection: a burst of requests waits a round trip instead of needing
        a pooled connection each (the pool's 100 ran out at ~128 concurrent clients)."""
        maxlen = self.streams.admit(stream, msg)
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._outbox.append((stream, encode(msg), maxlen, fut))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await fut

    async def _flush(self) -> None:
        while self._outbox:
            batch, self._outbox = self._outbox[:SEND_BATCH], self._outbox[SEND_BATCH:]
            try:
                async with self.r.pipeline(transaction=False) as pipe:
                    for stream, payload, maxlen, _ in batch:
                        pipe.xadd(stream, {FIELD: payload}, maxlen=maxlen, approximate=True)
                    results: list[object] = await pipe.execute(raise_on_error=False)
            except Exception as exc:  # the broker is gone: every sender in the batch hears it
                results = [exc] * len(batch)
            for (*_, fut), res in zip(batch, results, strict=True):
                if fut.done():  # its sender was cancelled
                    continue
                if isinstance(res, BaseException):
                    fut.set_exception(res)
                else:
                    fut.set_result(res)  # type: ignore[arg-type]

    async def last_id(self, stream: str) -> bytes:
        got = await self.r.xrevrange(stream, count=1)
        return got[0][0] if got else b"0-0"

    async def read(self, stream: str, last_id: bytes, block_ms: int | None, count: int = 500) -> list[Entry]:
        return Bus.entries(await self.r.execute_command(*Bus.xread(stream, last_id, block_ms, count)))

    async def get(self, key: str) -> bytes | None:
        return await self.r.get(key)

    async def mget(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        return await (self.r.mget_nonatomic(keys) if self.cluster else self.r.mget(keys))  # type: ignore[attr-defined]

    async def server_id(self, keys: Sequence[str] = ()) -> tuple[str, dict[str, str]]:
        """Bus.server_id, for the gateway; on a cluster, beside it, the master of each of `keys`
        (a failover lost writes only in the slots whose master changed)."""
        if self.cluster:
            nodes = await self.r.cluster_nodes()
            return self.lineage.id(nodes), {key: self.lineage.id(nodes, key) for key in keys}
        return server_id_of(await self.r.info("server")), {}

    async def close(self) -> None:
        await self.r.aclose()
