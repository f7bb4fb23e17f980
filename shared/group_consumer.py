"""The consumer loop of a replicated stateless stage (tokenizer, detokenizer): read through the
group, handle, ack with the replies, take over a dead replica's entries, trim, survive outages;
and the same over a changing set of streams (one per gateway, one per engine)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from rill.shared.bus import CLAIM_IDLE_MS, Backoff, Bus, Entry
from rill.shared.lifecycle import POLL_MS, StopFlag
from rill.shared.resp import Command

CLAIM_EVERY_S = 1.0  # how often a replica looks for a dead replica's entries
TRIM_EVERY_S = 2.0  # trimming entries every replica has read and acked
REAP_EVERY_S = 30.0  # forgetting the consumer names of dead replicas
DISCOVER_EVERY_S = 0.5  # how soon a new gateway's or engine's stream is read

Handler = Callable[[Bus, str, list[Entry]], list[Command] | None]


def serve_group(bus: Bus, stream: str, group: str, consumer: str,
                handle: Callable[[list[Entry]], list[Command] | None], stop: StopFlag,
                claim_idle_ms: int | None = CLAIM_IDLE_MS, count: int = 64,
                log: logging.Logger | None = None) -> None:
    """The loop of a replicated stateless stage, until `stop`: `handle` each batch of entries.
    `handle` either acks them itself or returns the commands that do (its sends, then the ack),
    which go out ahead of the next blocking read in the same round trip: a stage that runs once a
    step (the detokenizer) then costs the broker one round trip a step, not two.
    First, and after every broker error, it redoes this consumer's own unacked entries;
    it takes over entries other replicas left unacked for `claim_idle_ms` (they died), trims what
    every replica has consumed, forgets dead consumers, and rides out broker outages with backoff."""
    log = log or logging.getLogger("rill.bus")
    handle = _isolating(handle, stream, group, log)
    backoff, recover = Backoff(), True  # recover: first, redo this consumer's own unacked entries
    outbox: list[Command] = []  # what the last handled batch still has to send, its ack last
    next_claim = next_trim = next_reap = time.monotonic()  # at start too: this replica may replace a dead one
    while not stop:
        try:
            if recover:
                outbox = []  # sent or not, its entries are unacked and get redone below
                bus.ensure_group(stream, group)
                while not stop:
                    mine = bus.read_group(stream, group, consumer, block_ms=None, count=count, pending=True,
                                          before=outbox)
                    outbox = []
                    if not mine:
                        break
                    outbox = handle(mine) or []
                recover = False
            entries = bus.read_group(stream, group, consumer, block_ms=POLL_MS, count=count, before=outbox)
            outbox = []
            if entries:
                outbox = handle(entries) or []
            now = time.monotonic()
            upkeep = now >= next_trim or now >= next_reap or (claim_idle_ms is not None and now >= next_claim)
            if upkeep and outbox:  # the replies first: upkeep must not delay them
                bus.exchange(outbox)
                outbox = []
            if claim_idle_ms is not None and now >= next_claim:
                for batch in bus.claim(stream, group, consumer, claim_idle_ms, count=count):
                    log.info("claimed %d entries of %s abandoned by another replica", len(batch), stream)
                    outbox += handle(batch) or []
                next_claim = now + CLAIM_EVERY_S
            if now >= next_trim:
                bus.trim_consumed(stream)
                next_trim = now + TRIM_EVERY_S
            if now >= next_reap:
                bus.reap_consumers(stream, group)
                next_reap = now + REAP_EVERY_S
            backoff.reset()
        except redis.RedisError as exc:  # broker gone or group deleted: retry, then redo unacked work
            if not backoff.failures:  # once per outage; the retries that follow are quiet
                log.warning("broker error, reconnecting with backoff: %r", exc)
            recover = True
            stop.wait(backoff.next())
    if outbox:  # stopping: the last batch's replies and ack still go out
        try:
            bus.exchange(outbox)
        except redis.RedisError as exc:
            log.warning("could not send the last replies while stopping (they are redone): %r", exc)


def _isolating(handle: Callable[[list[Entry]], list[Command] | None], stream: str, group: str,
               log: logging.Logger) -> Callable[[list[Entry]], list[Command] | None]:
    """`handle`, except that a batch it fails on (a bug: handlers answer bad input themselves) is
    handled again one entry at a time, and an entry it fails on alone is logged and acked: one
    poisoned entry must not end the loop or, redone forever, stall every entry behind it. Redoing
    is harmless, as after a replica's death."""
    def guarded(entries: list[Entry]) -> list[Command] | None:
        try:
            return handle(entries)
        except redis.RedisError:
            raise
        except Exception:
            if len(entries) == 1:
                log.exception("dropping entry %s of %s: handling it failed", entries[0][0], stream)
                return [Bus.xack(stream, group, [entries[0][0]])]
            log.exception("handling %d entries of %s failed: handling them one at a time", len(entries), stream)
            return [cmd for entry in entries for cmd in guarded([entry]) or []]
    return guarded


def serve_streams(url: str, prefix: str, group: str, consumer: str, streams_now: Callable[[Bus], list[str]],
                  handle: Handler, stop: StopFlag, claim_idle_ms: int | None = CLAIM_IDLE_MS, count: int = 64,
                  log: logging.Logger | None = None) -> None:
    """serve_group over every stream `streams_now` lists, until `stop`: the list is read again
    every DISCOVER_EVERY_S; each stream gets a thread with its own connection (a cluster puts the
    streams on different masters, and one blocking read cannot wait on two), and a stream that
    leaves the list is let go once its thread's last read is handled. `handle(bus, stream,
    entries)` runs in one thread at a time, so it may share state unguarded."""
    log = log or logging.getLogger("rill.bus")
    directory = Bus(url, prefix, name=consumer)
    one_at_a_time = threading.Lock()
    readers: dict[str, tuple[threading.Thread, StopFlag]] = {}
    backoff = Backoff()

    def serve(stream: str, own_stop: StopFlag) -> None:
        bus = Bus(url, prefix, name=consumer)

        def handle_one(entries: list[Entry]) -> list[Command] | None:
            with one_at_a_time:
                return handle(bus, stream, entries)
        try:
            serve_group(bus, stream, group, consumer, handle_one, own_stop, claim_idle_ms, count, log)
        finally:
            bus.close()

    try:
        while not stop:
            try:
                wanted = set(streams_now(directory))
                backoff.reset()
            except redis.RedisError as exc:  # the readers ride out the outage themselves
                if not backoff.failures:
                    log.warning("broker error listing streams, retrying: %r", exc)
                stop.wait(backoff.next())
                continue
            for stream, (thread, own_stop) in list(readers.items()):
                if stream not in wanted:
                    own_stop.set()
                if not thread.is_alive():
                    del readers[stream]
            for stream in sorted(wanted - set(readers)):
                own_stop = StopFlag(install=False)
                thread = threading.Thread(target=serve, args=(stream, own_stop), name=f"read:{stream}", daemon=True)
                readers[stream] = (thread, own_stop)
                thread.start()
                log.info("reading %s", stream)
            stop.wait(DISCOVER_EVERY_S)
    finally:
        for _, own_stop in readers.values():
            own_stop.set()
        for thread, _ in readers.values():
            thread.join()
        directory.close()
