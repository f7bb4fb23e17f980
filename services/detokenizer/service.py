"""Detokenizer replicas: DetokBatch in, one ReplyBatch per gateway (and stop aborts) out.

Replicas are stateless and share every engine's detok stream through one consumer group; every row
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

from rill.services.detokenizer.incremental import Detokenizer
from rill.shared.bus import CLAIM_IDLE_MS, Bus, Entry
from rill.shared.group_consumer import serve_streams
from rill.shared.heartbeat import engine_detok_streams, replica_heartbeat
from rill.shared.kinds import AbortReason
from rill.shared.lifecycle import StopFlag
from rill.shared.resp import Command
from rill.shared.schema import AbortRequest, ReplyBatch, TextDelta, detok_decoder
from rill.shared.streams import DETOKENIZER_GROUP
from rill.shared.tokenizer_files import load_tokenizer

log = logging.getLogger("rill.detokenizer")

READ_COUNT = 64  # entries (steps) per read: one ReplyBatch per gateway covers all of them


def handle_entries(bus: Bus, stream: str, detok: Detokenizer, entries: list[Entry]) -> list[Command]:
    """Decode every entry; the commands that send all replies and aborts, then ack, in one round
    trip (serve_group sends them ahead of its next read)."""
    replies: dict[str, list[TextDelta]] = {}
    aborts: dict[tuple[int, AbortReason], list[str]] = {}  # (engine, reason) -> request ids
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
        for reply_to, deltas in out.replies.items():
            replies.setdefault(reply_to, []).extend(deltas)
        if out.stopped:
            aborts.setdefault((batch.engine_id, "stop"), []).extend(out.stopped)
        if out.failed:
            aborts.setdefault((batch.engine_id, "error"), []).extend(out.failed)
        if out.errors:
            log.warning("detok rows failed engine=%s step=%s: %s", batch.engine_id, batch.step_id,
                        "; ".join(out.errors)[:2000])
    sends: list[Command] = [bus.xadd(reply_to, ReplyBatch(deltas=deltas))
                            for reply_to, deltas in replies.items()]
    sends += [bus.xadd(bus.streams.engine_in(engine), AbortRequest(request_ids=ids, reason=reason))
              for (engine, reason), ids in aborts.items()]
    # The ack goes last in the same round trip: it runs only after the sends did.
    return [*sends, Bus.xack(stream, DETOKENIZER_GROUP, [entry_id for entry_id, _ in entries])]


def load_detokenizer(model_dir: str) -> Detokenizer:
    # The Rust tokenizer alone (no transformers, no torch): a replica starts in about a second.
    return Detokenizer(load_tokenizer(model_dir).tokenizer)


def run(redis_url: str, prefix: str, model_dir: str, consumer: str, stop: StopFlag | None = None,
        claim_idle_ms: int | None = CLAIM_IDLE_MS, detok: Detokenizer | None = None) -> None:
    """Serve until `stop` is set (SIGTERM/SIGINT by default). `claim_idle_ms`: take over other
    replicas' entries idle that long (None: never); `detok`: reuse an already loaded tokenizer."""
    stop = stop if stop is not None else StopFlag()
    detok = detok or load_detokenizer(model_dir)
    heartbeat = replica_heartbeat(redis_url, prefix, "detokenizer", consumer)
    log.info("detokenizer consumer=%s byte_level=%s", consumer, detok.byte_level)
    try:
        serve_streams(redis_url, prefix, DETOKENIZER_GROUP, consumer, engine_detok_streams,
                      lambda bus, stream, entries: handle_entries(bus, stream, detok, entries),
                      stop, claim_idle_ms, count=READ_COUNT, log=log)
    finally:
        heartbeat.stop()
        log.info("detokenizer consumer=%s stopped", consumer)
