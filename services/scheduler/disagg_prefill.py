"""Disaggregation, prefill side: handing parked requests and their KV to decode engines.

A request parks at its first token; the next plan exports its blocks, the step's result brings
the manifest back, the least loaded live decode engine *now* gets a KVHandoff, and its ack frees
the blocks here (or asks for another export, or fails the request). After an ack this side
remembers (bounded) where each request went, to forward aborts and to fail those requests
clearly when their decode engine dies. disagg.py has the whole protocol.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from rill.services.scheduler.kv_cache_manager import blocks_for
from rill.services.scheduler.request import Request
from rill.services.scheduler.scheduler import Scheduler
from rill.shared import envs
from rill.shared.bus import Bus
from rill.shared.heartbeat import Absence, engine_beat_keys, engine_ids, engines_alive
from rill.shared.kinds import EngineRole
from rill.shared.schema import (
    AbortRequest,
    ErrorReply,
    KVExport,
    KVHandoff,
    KVManifest,
    KVTransferAck,
    stats_decoder,
)

log = logging.getLogger("rill.scheduler.disagg")

MAX_ATTEMPTS = 3  # exports of one request before its transfer counts as failed
TRANSFER_TIMEOUT_S = envs.RILL_KV_TRANSFER_TIMEOUT_S
DIRECTORY_TTL_S = 0.5  # how stale the engines' roles and loads may be when picking one
LIVENESS_CHECK_S = 1.0
RECORDS_MAX = 100_000  # hand-offs remembered for abort forwarding and engine-loss errors
RECORD_MAX_AGE_S = 6 * 3600.0


def decode_lost_message(engine: int, during_transfer: bool) -> str:
    where = "during KV transfer" if during_transfer else "while this request was decoding there"
    return (f"the decode engine {engine} was lost {where} (no heartbeat); "
            "the request was not completed, please retry")


@dataclass
class EngineView:
    engine_id: int
    role: EngineRole
    load: int  # requests running, waiting or in transfer
    alive: bool  # scheduler and worker both beat


class EngineDirectory:
    """Every engine's role, load and liveness, read from Redis (engines set, stats keys,
    heartbeats) at most every `ttl_s`."""

    def __init__(self, bus: Bus, ttl_s: float = DIRECTORY_TTL_S) -> None:
        self.bus = bus
        self.ttl_s = ttl_s
        self._views: dict[int, EngineView] = {}
        self._read_at = float("-inf")

    def views(self) -> dict[int, EngineView]:
        now = time.monotonic()
        if now - self._read_at >= self.ttl_s:
            self._views = self._read()
            self._read_at = now
        return self._views

    def _read(self) -> dict[int, EngineView]:
        s = self.bus.streams
        members = self.bus.r.smembers(s.engines_key())
        ids = engine_ids(members)
        if not ids:
            return {}
        pipe = self.bus.r.pipeline(transaction=False)
        pipe.mget([s.stats_key(e) for e in ids])
        pipe.mget(engine_beat_keys(s, ids))
        raw_stats, beats = pipe.execute()
        out: dict[int, EngineView] = {}
        for e, raw, alive in zip(ids, raw_stats, engines_alive(beats, len(ids)), strict=True):
            if raw is None:
                continue  # not configured yet: its role is unknown
            try:
                st = stats_decoder.decode(raw)
            except msgspec.DecodeError:
                continue
            out[e] = EngineView(e, st.role, st.num_running + st.num_waiting + st.num_transferring, alive)
        return out

    def decode_engines(self, exclude: int) -> list[EngineView]:
        return [v for v in self.views().values() if v.role == "decode" and v.alive and v.engine_id != exclude]


@dataclass(eq=False)
class Outgoing:
    """One parked request on its way out."""

    req: Request
    transfer_id: str
    parked_at: float  # monotonic: when its prompt was done
    parked_wall: float  # the same instant by the wall clock, for the decode engine
    attempt: int = 1
    state: str = "export"  # "export" (next plan) -> "exporting" (in the plan) -> "sent" (waits for the ack)
    engine: int | None = None  # the decode engine, once sent
    manifest: KVManifest | None = None
    deadline: float = 0.0


@dataclass
class HandedOff:
    """Where an acknowledged request went."""

    engine: int
    reply_to: str
    group_id: str
    at: float


@dataclass
class ExportCounters:
    sent: int = 0
    failures: int = 0
    bytes_sent: int = 0
    transfer_seconds: float = 0.0
    export_seconds: float = 0.0


class PrefillSide:
    """The prefill engine's hand-offs: those on their way out and where finished ones went."""

    def __init__(self, bus: Bus, engine_id: int, sched: Callable[[], Scheduler],
                 send_errors: Callable[[list[Request], str, int], None], publish_stats: Callable[[], None]) -> None:
        self.bus = bus
        self.e = engine_id
        self._sched = sched
        self._send_errors = send_errors
        self._publish_stats = publish_stats
        self.directory = EngineDirectory(bus)
        self.outgoing: dict[str, Outgoing] = {}  # transfer id ->
        self.handed: OrderedDict[str, HandedOff] = OrderedDict()  # request id ->
        self.handed_per_engine: Counter[int] = Counter()  # so watching engines need not scan records
        self.engine_gone: dict[int, Absence] = {}
        self.counters = ExportCounters()
        self._next_liveness = 0.0
        self._warned_local = 0.0

    @property
    def exports_pending(self) -> bool:
        return any(o.state == "export" for o in self.outgoing.values())

    def tick(self, now: float) -> None:
        """Time out unacknowledged hand-offs, watch decode engines, forget old records."""
        for out in [o for o in self.outgoing.values() if o.state == "sent" and now >= o.deadline]:
            self._fail(out, f"the KV transfer to decode engine {out.engine} was not acknowledged within "
                            f"{TRANSFER_TIMEOUT_S:.0f} s; the request was not completed, please retry")
        if now >= self._next_liveness:
            self._next_liveness = now + LIVENESS_CHECK_S
            self._watch_decode_engines(now)
        while self.handed and (len(self.handed) > RECORDS_MAX
                               or now - next(iter(self.handed.values())).at > RECORD_MAX_AGE_S):
            self._drop_record(self.handed.popitem(last=False)[1])

    def exports(self) -> list[KVExport]:
        """The exports the plan about to be sent carries."""
        sched = self._sched()
        exports: list[KVExport] = []
        for out in self.outgoing.values():
            if out.state == "export":
                n = out.req.num_computed_tokens
                blocks = sched.kv.block_ids(out.req.request_id)[:blocks_for(n, sched.kv.block_size)]
                exports.append(KVExport(transfer_id=out.transfer_id, block_ids=list(blocks), num_tokens=n))
                out.state = "exporting"
        return exports

    def on_worker_reset(self) -> None:
        """KV not yet exported is gone: those requests compute again."""
        for out in list(self.outgoing.values()):
            if out.state != "sent":
                self._forget_outgoing(out)
                self._sched().requeue_parked(out.req.request_id)

    def reconcile(self, parked: dict[str, Request]) -> None:
        """Drop hand-offs whose request is no longer parked here; a decode engine that has it is told."""
        for out in list(self.outgoing.values()):
            if parked.get(out.req.request_id) is not out.req:
                self._forget_outgoing(out)
                if out.state == "sent" and out.engine is not None:
                    self.bus.send(self.bus.streams.engine_in(out.engine),
                                  AbortRequest(request_ids=[out.req.request_id]))

    def start(self, req: Request) -> None:
        """A request parked at its first token: export it at the next plan."""
        if not self.directory.decode_engines(exclude=self.e):
            self._decode_here(req)
            return
        out = Outgoing(req=req, transfer_id=self._transfer_id(), parked_at=time.monotonic(), parked_wall=time.time())
        self.outgoing[out.transfer_id] = out

    def _transfer_id(self) -> str:
        return f"{self.e}-{uuid.uuid4().hex}"

    def _decode_here(self, req: Request) -> None:
        """No decode engine is live: the KV is here, so this engine decodes the request itself."""
        self._sched().unpark(req.request_id)
        now = time.monotonic()
        if now - self._warned_local > 30.0:
            self._warned_local = now
            log.warning("engine %d: no live decode engine; decoding requests here", self.e)

    def _pick_decode(self) -> int | None:
        views = self.directory.decode_engines(exclude=self.e)
        if not views:
            return None
        in_flight: dict[int, int] = {}
        for o in self.outgoing.values():
            if o.state == "sent" and o.engine is not None:
                in_flight[o.engine] = in_flight.get(o.engine, 0) + 1
        return min(views, key=lambda v: (v.load + in_flight.get(v.engine_id, 0), v.engine_id)).engine_id

    def exported(self, manifest: KVManifest) -> None:
        """The worker exported a request's KV: hand it to a decode engine."""
        out = self.outgoing.get(manifest.transfer_id)
        if out is None or out.state != "exporting":
            self._discard(manifest)  # cancelled while the worker exported it
            return
        if manifest.error is not None:
            self._retry_or_fail(out, manifest.error, retryable=True)
            return
        out.manifest = manifest
        self.counters.export_seconds += manifest.export_ms / 1e3
        target = self._pick_decode()
        if target is None:  # every decode engine went away meanwhile; the KV is still here
            self._forget_outgoing(out)
            self._decode_here(out.req)
            return
        req = out.req
        self.bus.send(self.bus.streams.engine_in(target), KVHandoff(
            request_id=req.request_id, group_id=req.group_id or req.request_id, reply_to=req.reply_to,
            prompt_token_ids=req.prompt_token_ids, output_token_ids=req.output_token_ids, params=req.params,
            eos_token_ids=sorted(req.eos_token_ids), max_tokens=req.max_tokens, arrival_time=req.arrival_time,
            num_computed_tokens=req.num_computed_tokens, source_engine=self.e, manifest=manifest,
            priority=req.priority, attempt=out.attempt, first_token_at=out.parked_wall))
        out.state, out.engine = "sent", target
        out.deadline = time.monotonic() + TRANSFER_TIMEOUT_S

    def on_ack(self, ack: KVTransferAck) -> None:
        out = self.outgoing.get(ack.transfer_id)
        if out is None or out.state != "sent":
            return  # timed out or cancelled already
        rid = out.req.request_id
        if ack.status == "ok":
            self._forget_outgoing(out, discard=False)  # the importer deleted the chunks
            self._sched().release(rid)
            self._record(out, ack.decode_engine)
        elif ack.status == "aborted":  # ended there (cancelled, or failed with its own error reply)
            self._forget_outgoing(out)
            self._sched().abort(rid)
        else:
            self._retry_or_fail(out, ack.error or "the decode engine could not import the KV", ack.retryable)

    def _record(self, out: Outgoing, engine: int) -> None:
        """A hand-off acknowledged: count it, and remember where the request went."""
        rid = out.req.request_id
        c = self.counters
        c.sent += 1
        c.bytes_sent += out.manifest.nbytes if out.manifest is not None else 0
        c.transfer_seconds += time.monotonic() - out.parked_at
        if rid in self.handed:
            self._drop_record(self.handed.pop(rid))
        self.handed[rid] = HandedOff(engine=engine, reply_to=out.req.reply_to,
                                     group_id=out.req.group_id or rid, at=time.monotonic())
        self.handed_per_engine[engine] += 1

    def _retry_or_fail(self, out: Outgoing, error: str, retryable: bool) -> None:
        self.counters.failures += 1
        if not retryable or out.attempt >= MAX_ATTEMPTS:
            self._fail(out, f"the KV transfer to a decode engine failed after {out.attempt} attempt(s): {error}",
                       status=500 if not retryable else 503)
            return
        log.warning("KV transfer %s of %s failed (attempt %d of %d), exporting again: %s", out.transfer_id,
                    out.req.request_id, out.attempt, MAX_ATTEMPTS, error)
        self._forget_outgoing(out)
        out.transfer_id = self._transfer_id()
        out.attempt += 1
        out.state, out.engine, out.manifest = "export", None, None
        self.outgoing[out.transfer_id] = out

    def _fail(self, out: Outgoing, message: str, status: int = 503) -> None:
        """End the request with an error to its gateway and free its blocks here; the decode
        engine, if it has it, drops it too."""
        self._forget_outgoing(out)
        if out.state == "sent" and out.engine is not None:
            self.bus.send(self.bus.streams.engine_in(out.engine),
                          AbortRequest(request_ids=[out.req.request_id], reason="error"))
        self._sched().abort(out.req.request_id)
        self._send_errors([out.req], message, status)
        log.warning("request %s failed: %s", out.req.request_id, message)

    def _forget_outgoing(self, out: Outgoing, discard: bool = True) -> None:
        self.outgoing.pop(out.transfer_id, None)
        if discard and out.manifest is not None:
            self._discard(out.manifest)

    def _discard(self, manifest: KVManifest) -> None:
        keys = [self.bus.streams.kv_chunk(manifest.transfer_id, i) for i in range(len(manifest.chunk_bytes))]
        if keys:
            self.bus.r.unlink(*keys)

    def _watch_decode_engines(self, now: float) -> None:
        """A decode engine whose scheduler stopped beating lost every request it held or was
        receiving: fail them (its worker's loss is handled by its own scheduler)."""
        engines = {o.engine for o in self.outgoing.values() if o.state == "sent" and o.engine is not None}
        engines |= set(self.handed_per_engine)
        for gone in set(self.engine_gone) - engines:
            del self.engine_gone[gone]
        if not engines:
            return
        ordered = sorted(engines)
        pipe = self.bus.r.pipeline(transaction=False)
        for e in ordered:
            pipe.exists(self.bus.streams.heartbeat("scheduler", e))
        for e, beating in zip(ordered, pipe.execute(), strict=True):
            if self.engine_gone.setdefault(e, Absence()).observe(bool(beating), now):
                self._decode_engine_lost(e)

    def _decode_engine_lost(self, engine: int) -> None:
        lost = [o for o in self.outgoing.values() if o.state == "sent" and o.engine == engine]
        for out in lost:
            out.engine = None  # nobody to tell
            self._fail(out, decode_lost_message(engine, during_transfer=True))
        records = [(rid, h) for rid, h in self.handed.items() if h.engine == engine]
        if records:
            # Requests that finished there long ago are unknown to their gateway, which ignores these.
            message = decode_lost_message(engine, during_transfer=False)
            self.bus.send_many([(h.reply_to, ErrorReply.of(h.group_id, message, 503)) for _, h in records])
            for rid, h in records:
                del self.handed[rid]
                self._drop_record(h)
        log.warning("decode engine %d lost: failed %d transfers in flight, notified %d handed-off requests",
                    engine, len(lost), len(records))
        self.engine_gone.pop(engine, None)
        self._publish_stats()

    def _drop_record(self, record: HandedOff) -> None:
        self.handed_per_engine[record.engine] -= 1
        if self.handed_per_engine[record.engine] <= 0:
            del self.handed_per_engine[record.engine]
