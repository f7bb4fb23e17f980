"""Detokenizer replicas: DetokBatch in, one ReplyBatch per gateway (and stop aborts) out.

Replicas are stateless and share the detok stream through one consumer group; every row
carries its own decode context (see incremental.py), so consecutive steps of a request may be
decoded by different replicas. Entries are acked only after their replies were sent, so a
killed replica's entries are redone: by itself on restart (its pending list), or by a live
replica that claims entries idle for longer than `claim_idle_ms`. Redoing is harmless: the
gateway applies each offset once and aborts are idempotent. Broker errors never end the loop:
it backs off, reconnects (re-creating the group if the broker lost it) and redoes its own
unacked entries. Consumed entries are trimmed away (Bus.trim_consumed), never unread ones.
"""

from __future__ import annotations

import logging
import time

import redis
from msgspec import Struct

from rill.services.detokenizer.incremental import Detokenizer
from rill.shared.bus import CLAIM_IDLE_MS, DETOKENIZER_GROUP, MAXLEN, Backoff, Bus, Entry
from rill.shared.lifecycle import POLL_MS, StopFlag
from rill.shared.schema import AbortRequest, ReplyBatch, TextDelta, detok_decoder

log = logging.getLogger("rill.detokenizer")

READ_COUNT = 64  # entries (steps) per read: one ReplyBatch per gateway covers all of them
CLAIM_EVERY_S = 1.0  # how often a replica looks for a dead replica's entries
TRIM_EVERY_S = 2.0  # trimming entries every detokenizer has read and acked
REAP_EVERY_S = 30.0  # forgetting the consumer names of dead replicas


def handle_entries(bus: Bus, detok: Detokenizer, entries: list[Entry]) -> None:
    """Decode every entry, send all replies and aborts in one round trip, then ack."""
    replies: dict[str, list[TextDelta]] = {}
    aborts: dict[tuple[int, str], list[str]] = {}  # (engine, reason) -> request ids
    for entry_id, payload in entries:
        try:
            batch = detok_decoder.decode(payload)
        except Exception as exc:  # malformed: nobody can use it, so drop it (it is acked below)
            log.warning("dropping malformed detok entry id=%s error=%r", entry_id, exc)
            continue
        try:
            out = detok.detokenize_batch(batch)
        except Exception:  # a bug, not bad input: keep serving the other entries
            log.exception("detok entry id=%s failed", entry_id)
            continue
        for stream, deltas in out.replies.items():
            replies.setdefault(stream, []).extend(deltas)
        if out.stopped:
            aborts.setdefault((batch.engine_id, "stop"), []).extend(out.stopped)
        if out.failed:
            aborts.setdefault((batch.engine_id, "error"), []).extend(out.failed)
        if out.errors:
            log.warning("detok rows failed engine=%s step=%s: %s", batch.engine_id, batch.step_id,
                        "; ".join(out.errors)[:2000])
    sends: list[tuple[str, Struct, int]] = [
        (stream, ReplyBatch(deltas=deltas), MAXLEN["reply"]) for stream, deltas in replies.items()]
    sends += [(bus.streams.engine_in(engine), AbortRequest(request_ids=ids, reason=reason), MAXLEN["engine_in"])
              for (engine, reason), ids in aborts.items()]
    if sends:
        bus.send_many(sends)
    bus.ack(bus.streams.detok, DETOKENIZER_GROUP, [entry_id for entry_id, _ in entries])


def _drain_pending(bus: Bus, detok: Detokenizer, consumer: str, stop: StopFlag) -> None:
    """Finish the entries this consumer read but did not ack (before a restart or an error)."""
    while not stop:
        entries = bus.read_group(bus.streams.detok, DETOKENIZER_GROUP, consumer, block_ms=None,
                                 count=READ_COUNT, pending=True)
        if not entries:
            return
        handle_entries(bus, detok, entries)


def _claim_abandoned(bus: Bus, detok: Detokenizer, consumer: str, idle_ms: int) -> None:
    """Take over entries another replica read and left unacked for `idle_ms` (it died)."""
    for batch in bus.claim(bus.streams.detok, DETOKENIZER_GROUP, consumer, idle_ms, count=READ_COUNT):
        log.info("claimed %d abandoned detok entries", len(batch))
        handle_entries(bus, detok, batch)


def load_detokenizer(model_dir: str) -> Detokenizer:
    from transformers import AutoTokenizer

    return Detokenizer(AutoTokenizer.from_pretrained(model_dir))


def run(redis_url: str, prefix: str, model_dir: str, consumer: str, stop: StopFlag | None = None,
        claim_idle_ms: int | None = CLAIM_IDLE_MS, detok: Detokenizer | None = None) -> None:
    """Serve until `stop` is set (SIGTERM/SIGINT by default). `claim_idle_ms`: take over other
    replicas' entries idle that long (None: never); `detok`: reuse an already loaded tokenizer."""
    stop = stop if stop is not None else StopFlag()
    detok = detok or load_detokenizer(model_dir)
    bus = Bus(redis_url, prefix, name=consumer)
    stream = bus.streams.detok
    backoff = Backoff()
    log.info("detokenizer consumer=%s stream=%s byte_level=%s", consumer, stream, detok.byte_level)
    recover = True  # first finish what this consumer had pending
    next_claim = next_trim = next_reap = time.monotonic()  # at start too: this replica may replace one that died
    try:
        while not stop:
            try:
                if recover:
                    bus.ensure_group(stream, DETOKENIZER_GROUP)
                    _drain_pending(bus, detok, consumer, stop)
                    recover = False
                entries = bus.read_group(stream, DETOKENIZER_GROUP, consumer, block_ms=POLL_MS,
                                         count=READ_COUNT)
                if entries:
                    handle_entries(bus, detok, entries)
                now = time.monotonic()
                if claim_idle_ms is not None and now >= next_claim:
                    _claim_abandoned(bus, detok, consumer, claim_idle_ms)
                    next_claim = now + CLAIM_EVERY_S
                if now >= next_trim:
                    bus.trim_consumed(stream)
                    next_trim = now + TRIM_EVERY_S
                if now >= next_reap:
                    bus.reap_consumers(stream, DETOKENIZER_GROUP)
                    next_reap = now + REAP_EVERY_S
                backoff.reset()
            except redis.RedisError as exc:  # broker gone or group deleted: retry, redo unacked work
                if not backoff.failures:  # once per outage; the retries that follow are quiet
                    log.warning("broker error, reconnecting with backoff: %r", exc)
                delay = backoff.next()
                recover = True
                stop.wait(delay)
    finally:
        bus.close()
        log.info("detokenizer consumer=%s stopped", consumer)
