"""Liveness in Redis: a key with a TTL, refreshed by a background thread while its process lives.

Scheduler and worker beat `{prefix}:hb:scheduler:{engine}` / `{prefix}:hb:worker:{engine}`;
a gateway beats `{prefix}:hb:gateway:{its reply stream}`, a tokenizer or detokenizer replica
`{prefix}:hb:{role}:{consumer}` (see Streams.heartbeat). A thread
beats rather than the service loop, so a long model step or a slow request does not look like
death, while a killed process stops beating and its key expires after TTL_S.

Readers declare a process lost only once its key has stayed missing for GRACE_S as well
(`Absence`): a broker restart empties every key for an instant, and that is not a death.
Worst case from a kill to "lost": TTL_S + GRACE_S + one check interval, about 6 s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence

import redis

from rill.shared.bus import Bus, connect
from rill.shared.streams import Streams

log = logging.getLogger("rill.heartbeat")

INTERVAL_S = 1.0
TTL_S = 4
GRACE_S = 1.5
# A gateway's reply stream expires this long after its last beat (the gateway refreshes it),
# so the stream of a gateway that died without cleaning up does not stay behind.
REPLY_TTL_S = 60


class Heartbeat:
    """SET key EX ttl every interval from a daemon thread; also re-adds set memberships, refreshes
    TTLs of other keys and keeps published keys each beat, so all of it comes back after a broker
    restart."""

    def __init__(self, url: str, key: str, *, members: Sequence[tuple[str, str | int]] = (),
                 expire: Sequence[tuple[str, int]] = (), published: Sequence[tuple[str, bytes]] = (),
                 interval_s: float = INTERVAL_S, ttl_s: int = TTL_S) -> None:
        self.key = key
        self.members = list(members)  # (set key, member) pairs, removed again on stop
        self.expire = list(expire)  # (key, seconds): keys that live only while we beat
        # (key, value): held while we (or a peer publishing the same) beat; the value is written
        # again only when the key is gone, so a large one does not cross the wire every beat.
        self.published = list(published)
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        # Its own connection with a read timeout: a beat must never wait behind a blocking read.
        self.r = connect(url, socket_timeout=5.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat:{key}", daemon=True)
        self._failing = False

    def beat(self) -> bool:
        try:
            pipe = self.r.pipeline(transaction=False)
            pipe.set(self.key, b"1", ex=self.ttl_s)
            for set_key, member in self.members:
                pipe.sadd(set_key, member)
            for key, seconds in self.expire:
                pipe.expire(key, seconds)
            for key, _ in self.published:
                pipe.expire(key, self.ttl_s)
            done = pipe.execute()
            refreshed = done[len(done) - len(self.published):]
            gone = [(key, value) for (key, value), ok in zip(self.published, refreshed, strict=True) if not ok]
            if gone:  # the first beat, or the broker lost them (a restart, a failover)
                pipe = self.r.pipeline(transaction=False)
                for key, value in gone:
                    pipe.set(key, value, ex=self.ttl_s)
                pipe.execute()
        except redis.RedisError as exc:  # broker away: keep trying, log once per outage
            if not self._failing:
                log.warning("heartbeat %s failed, retrying: %r", self.key, exc)
            self._failing = True
            return False
        self._failing = False
        return True

    def start(self) -> Heartbeat:
        """First beat now (so the key exists before we announce ourselves), then in the background."""
        self.beat()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def stop(self, remove: bool = True) -> None:
        """Stop beating; with remove, delete the key and memberships (a clean exit is no death)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        if remove:
            try:
                pipe = self.r.pipeline(transaction=False)
                pipe.delete(self.key)
                for set_key, member in self.members:
                    pipe.srem(set_key, member)
                pipe.execute()
            except redis.RedisError:
                pass  # the key expires by itself
        self.r.close()


def replica_heartbeat(url: str, prefix: str, role: str, consumer: str,
                      published: Sequence[tuple[str, bytes]] = ()) -> Heartbeat:
    """The started heartbeat of one stateless replica (tokenizer, detokenizer), listed in the
    role's replica set so gateways can tell whether any replica of the role is alive, and keeping
    the `published` keys (a tokenizer's: what /tokenizer_info serves)."""
    s = Streams(prefix)
    return Heartbeat(url, s.heartbeat(role, consumer), members=[(s.replicas_key(role), consumer)],
                     published=published).start()


ENGINE_ROLES = ("scheduler", "worker")  # an engine lives while both of its processes beat


def engine_ids(members: Iterable[str]) -> list[int]:
    """The engine ids in the members of the engines set (Streams.engines_key), sorted: the one
    reading of the engine directory every service shares."""
    return sorted({int(m) for m in members if m.isdigit()})


def engine_detok_streams(bus: Bus) -> list[str]:
    """The detok stream of every listed engine (a dead one's last steps are still delivered)."""
    return [bus.streams.detok(e) for e in engine_ids(bus.r.smembers(bus.streams.engines_key()))]


def gateway_request_streams(bus: Bus) -> list[str]:
    """The requests streams of the gateways that are listed and beating (a killed gateway's
    requests have nobody to answer; a gateway that beats again is read again, from where its
    consumer group stopped)."""
    s = bus.streams
    replies = sorted(m.decode() if isinstance(m, bytes) else m for m in bus.r.smembers(s.gateways_key()))
    beats = bus.mget([s.heartbeat("gateway", reply) for reply in replies])
    return [s.requests_for(reply) for reply, beat in zip(replies, beats, strict=True) if beat is not None]


def engine_beat_keys(streams: Streams, engines: Sequence[int]) -> list[str]:
    """The heartbeat keys of each engine's scheduler and worker, two per engine, in order."""
    return [streams.heartbeat(role, e) for e in engines for role in ENGINE_ROLES]


def engines_alive(beats: Sequence[object], count: int) -> list[bool]:
    """Per engine, from the values read for its engine_beat_keys (first in `beats`): both beat."""
    return [beats[2 * i] is not None and beats[2 * i + 1] is not None for i in range(count)]


class Absence:
    """Turns periodic "is it there?" observations into "gone for at least grace_s"."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.since: float | None = None

    def observe(self, present: bool, now: float | None = None) -> bool:
        """Record one observation; True when the thing has been missing for grace_s or more."""
        now = time.monotonic() if now is None else now
        if present:
            self.since = None
            return False
        if self.since is None:
            self.since = now
        return now - self.since >= self.grace_s

    @property
    def lost(self) -> bool:
        return self.since is not None and time.monotonic() - self.since >= self.grace_s
