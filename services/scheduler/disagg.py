"""Prefill/decode disaggregation, scheduler side: handing requests and their KV between engines.

Roles (`--role`, EngineArgs.role, published as EngineStats.role):

- "both" (the default): colocated, every request runs start to finish here.
- "prefill": tokenizers route new requests here. A request's prompt runs here and its first token
  is sampled here (so TTFT is the prefill engine's), then the Scheduler parks it (out of the batch,
  blocks kept) and this module hands it over:
  1. the next step's plan asks the worker to export the request's blocks (KVExport);
  2. with the manifest the step's result brings back, it picks the least loaded live decode engine
     *now* and sends that engine a KVHandoff on its input stream;
  3. the decode engine answers with a KVTransferAck: "ok" frees the blocks here (full ones stay in
     the prefix cache); a retryable "failed" exports again (MAX_ATTEMPTS in all); anything else
     fails the request with an error reply to its gateway.
  A hand-off not acknowledged within TRANSFER_TIMEOUT_S, or whose decode engine's scheduler stops
  beating, fails the request with a clear error and frees the blocks. With no live decode engine
  at all, the prefill engine simply decodes the request itself.
- "decode": takes KVHandoffs. Blocks are allocated (Scheduler.adopt, FIFO, as memory allows), the
  next plan asks the worker to import the KV into them (KVImport); once the result says it is in,
  the request joins the batch as if it had been prefilled here and the prefill engine is acked.
  It never runs a prompt, except to recompute a request it had to preempt.

A request parks only at its first token: one that a prefill engine decodes itself (no decode
engine, or its KV was lost with a restarted worker before the export and it was recomputed) stays
there to the end.

Aborts: gateways send theirs to every engine. The detokenizer sends a stop-string abort to the
engine that produced the token, which for the first token is the prefill engine; that engine
forwards aborts of requests it already handed off to their decode engine, and a hand-off still in
flight is cancelled on both sides. After an ack the prefill engine also remembers (bounded) where
each request went, so when a decode engine dies its requests fail with a clear error instead of
leaving their clients waiting.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from rill.services.scheduler.kv_cache_manager import blocks_for
from rill.services.scheduler.scheduler import Request, Scheduler
from rill.shared import envs
from rill.shared.bus import Bus
from rill.shared.config import detok_context_len
from rill.shared.heartbeat import Absence, engine_beat_keys, engine_ids, engines_alive
from rill.shared.schema import (
    AbortRequest,
    ErrorReply,
    KVExport,
    KVHandoff,
    KVImport,
    KVImportResult,
    KVManifest,
    KVTransferAck,
    StepPlan,
    StepResult,
    WorkerReady,
    stats_decoder,
)
from rill.shared.streams import MAXLEN

if TYPE_CHECKING:
    from rill.services.scheduler.service import SchedulerService

log = logging.getLogger("rill.scheduler.disagg")

ROLES = ("both", "prefill", "decode")
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


def request_from_handoff(msg: KVHandoff) -> Request:
    return Request(request_id=msg.request_id, reply_to=msg.reply_to, prompt_token_ids=list(msg.prompt_token_ids),
                   params=msg.params, eos_token_ids=frozenset(msg.eos_token_ids), arrival_time=msg.arrival_time,
                   max_tokens=msg.max_tokens, priority=msg.priority, group_id=msg.group_id,
                   output_token_ids=list(msg.output_token_ids), detok_context=detok_context_len(msg.params.stop))


@dataclass
class EngineView:
    engine_id: int
    role: str
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
    """Prefill side: one parked request on its way out."""

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
    """Prefill side: where an acknowledged request went."""

    engine: int
    reply_to: str
    group_id: str
    at: float


@dataclass(eq=False)
class Incoming:
    """Decode side: one hand-off being taken in."""

    msg: KVHandoff
    req: Request
    state: str = "queued"  # "queued" (no blocks yet) -> "import" (next plan) -> "importing" (in the plan)


@dataclass
class TransferCounters:
    sent: int = 0
    received: int = 0
    failures: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    transfer_seconds: float = 0.0
    export_seconds: float = 0.0
    import_seconds: float = 0.0
    handoff_seconds: float = 0.0


class Disaggregation:
    """The hand-off state machine of one engine, driven by SchedulerService's loop (hooks:
    configure, tick, on_message, on_abort, prepare, decorate, after_step, on_worker_reset)."""

    def __init__(self, service: SchedulerService) -> None:
        if service.args.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {service.args.role!r}")
        self.service = service
        self.bus = service.bus
        self.e = service.e
        self.role = service.args.role
        self.directory = EngineDirectory(self.bus)
        self.outgoing: dict[str, Outgoing] = {}  # transfer id -> (prefill side)
        self.handed: OrderedDict[str, HandedOff] = OrderedDict()  # request id -> (prefill side)
        self.handed_per_engine: Counter[int] = Counter()  # so watching engines need not scan records
        self.incoming: dict[str, Incoming] = {}  # transfer id -> (decode side), in arrival order
        self.engine_gone: dict[int, Absence] = {}
        self.counters = TransferCounters()
        self.worker_dtype = ""
        self._next_liveness = 0.0
        self._warned_local = 0.0

    @property
    def sched(self) -> Scheduler:
        sched = self.service.sched
        assert sched is not None
        return sched

    @property
    def wants_step(self) -> bool:
        """A transfer waits for the next plan (even one that runs no tokens)."""
        return (any(o.state == "export" for o in self.outgoing.values())
                or any(i.state == "import" for i in self.incoming.values()))

    @property
    def exports_pending(self) -> bool:
        """Prompt KV waits to leave: worth a step of its own (milliseconds) rather than riding
        along with a prompt chunk, after whose forward pass the result would come back."""
        return any(o.state == "export" for o in self.outgoing.values())

    def configure(self, ready: WorkerReady) -> None:
        self.worker_dtype = ready.dtype

    def stats(self) -> dict[str, int | float | str]:
        c = self.counters
        return dict(role=self.role, kv_transfers_sent=c.sent, kv_transfers_received=c.received,
                    kv_transfer_failures=c.failures, kv_bytes_sent=c.bytes_sent, kv_bytes_received=c.bytes_received,
                    kv_transfer_seconds_sum=round(c.transfer_seconds, 6),
                    kv_export_seconds_sum=round(c.export_seconds, 6), kv_import_seconds_sum=round(c.import_seconds, 6),
                    kv_handoff_seconds_sum=round(c.handoff_seconds, 6))

    # -------------------------------------------------------------------------- loop hooks

    def tick(self) -> None:
        """Once per loop iteration: cancel what was aborted elsewhere, time out, watch engines."""
        if self.service.sched is None:
            return
        now = time.monotonic()
        self.reconcile()
        for out in [o for o in self.outgoing.values() if o.state == "sent" and now >= o.deadline]:
            self._fail(out, f"the KV transfer to decode engine {out.engine} was not acknowledged within "
                            f"{TRANSFER_TIMEOUT_S:.0f} s; the request was not completed, please retry")
        if now >= self._next_liveness:
            self._next_liveness = now + LIVENESS_CHECK_S
            self._watch_decode_engines(now)
        while self.handed and (len(self.handed) > RECORDS_MAX
                               or now - next(iter(self.handed.values())).at > RECORD_MAX_AGE_S):
            self._drop_record(self.handed.popitem(last=False)[1])

    def on_message(self, msg: KVHandoff | KVTransferAck) -> None:
        if isinstance(msg, KVHandoff):
            self._receive(msg)
        else:
            self._on_ack(msg)

    def on_abort(self, msg: AbortRequest) -> None:
        """After the scheduler dropped the ids: forward to the decode engines that hold them, and
        drop hand-offs not yet taken in."""
        forward: dict[int, list[str]] = {}
        for rid in msg.request_ids:
            record = self.handed.get(rid)
            if record is not None:
                forward.setdefault(record.engine, []).append(rid)
            for inc in [i for i in self.incoming.values() if i.state == "queued"
                        and rid in (i.req.request_id, i.req.group_id)]:
                del self.incoming[inc.msg.manifest.transfer_id]
                self._ack(inc, "aborted")
        if forward:
            self.bus.send_many([(self.bus.streams.engine_in(e), AbortRequest(request_ids=ids, reason=msg.reason),
                                 MAXLEN["engine_in"]) for e, ids in forward.items()])
        self.reconcile()

    def prepare(self) -> None:
        """Decode side, before scheduling: give queued hand-offs blocks, first come first served."""
        sched = self.sched
        for inc in self.incoming.values():
            if inc.state != "queued":
                continue
            if len(sched.running) + len(sched.parked) >= sched.config.max_num_seqs:
                break
            if not sched.adopt(inc.req, inc.msg.num_computed_tokens):
                break  # memory is short: wait for requests to finish
            inc.state = "import"

    def decorate(self, plan: StepPlan) -> None:
        """Put the pending exports and imports into the plan about to be sent."""
        sched = self.sched
        exports: list[KVExport] = []
        for out in self.outgoing.values():
            if out.state == "export":
                n = out.req.num_computed_tokens
                blocks = sched.kv.block_ids(out.req.request_id)[:blocks_for(n, sched.kv.block_size)]
                exports.append(KVExport(transfer_id=out.transfer_id, block_ids=list(blocks), num_tokens=n))
                out.state = "exporting"
        imports: list[KVImport] = []
        for inc in self.incoming.values():
            if inc.state == "import":
                imports.append(KVImport(manifest=inc.msg.manifest,
                                        block_ids=list(sched.kv.block_ids(inc.req.request_id))))
                inc.state = "importing"
        plan.kv_exports = exports
        plan.kv_imports = imports

    def after_step(self, result: StepResult, parked: list[Request]) -> None:
        for manifest in result.kv_exports:
            self._exported(manifest)
        for outcome in result.kv_imports:
            self._imported(outcome)
        for req in parked:
            self._start(req)

    def on_worker_reset(self) -> None:
        """The worker restarted with an empty cache: KV not yet exported is gone (those requests
        compute again); imports in flight are fetched again."""
        for out in list(self.outgoing.values()):
            if out.state != "sent":
                self._forget_outgoing(out)
                self.sched.requeue_parked(out.req.request_id)
        for inc in self.incoming.values():
            if inc.state == "importing":
                inc.state = "import"

    def reconcile(self) -> None:
        """Drop transfers whose request left the scheduler some other way (abort, dead gateway,
        lost worker): their chunks are discarded and the other engine is told."""
        parked = self.service.sched.parked if self.service.sched is not None else {}
        for out in list(self.outgoing.values()):
            if parked.get(out.req.request_id) is not out.req:
                self._forget_outgoing(out)
                if out.state == "sent" and out.engine is not None:
                    self.bus.send(self.bus.streams.engine_in(out.engine),
                                  AbortRequest(request_ids=[out.req.request_id]), MAXLEN["engine_in"])
        for inc in list(self.incoming.values()):
            if inc.state != "queued" and parked.get(inc.req.request_id) is not inc.req:
                del self.incoming[inc.msg.manifest.transfer_id]
                self._ack(inc, "aborted")

    # ----------------------------------------------------------------------- prefill side

    def _start(self, req: Request) -> None:
        if not self.directory.decode_engines(exclude=self.e):
            self._decode_here(req)
            return
        out = Outgoing(req=req, transfer_id=self._transfer_id(), parked_at=time.monotonic(), parked_wall=time.time())
        self.outgoing[out.transfer_id] = out

    def _transfer_id(self) -> str:
        return f"{self.e}-{uuid.uuid4().hex}"

    def _decode_here(self, req: Request) -> None:
        """No decode engine is live: the KV is here, so this engine decodes the request itself."""
        self.sched.unpark(req.request_id)
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

    def _exported(self, manifest: KVManifest) -> None:
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
            priority=req.priority, attempt=out.attempt, first_token_at=out.parked_wall), MAXLEN["engine_in"])
        out.state, out.engine = "sent", target
        out.deadline = time.monotonic() + TRANSFER_TIMEOUT_S

    def _on_ack(self, ack: KVTransferAck) -> None:
        out = self.outgoing.get(ack.transfer_id)
        if out is None or out.state != "sent":
            return  # timed out or cancelled already
        rid = out.req.request_id
        if ack.status == "ok":
            self._forget_outgoing(out, discard=False)  # the importer deleted the chunks
            self.sched.release(rid)
            c = self.counters
            c.sent += 1
            c.bytes_sent += out.manifest.nbytes if out.manifest is not None else 0
            c.transfer_seconds += time.monotonic() - out.parked_at
            if rid in self.handed:
                self._drop_record(self.handed.pop(rid))
            self.handed[rid] = HandedOff(engine=ack.decode_engine, reply_to=out.req.reply_to,
                                         group_id=out.req.group_id or rid, at=time.monotonic())
            self.handed_per_engine[ack.decode_engine] += 1
        elif ack.status == "aborted":  # ended there (cancelled, or failed with its own error reply)
            self._forget_outgoing(out)
            self.sched.abort(rid)
        else:
            self._retry_or_fail(out, ack.error or "the decode engine could not import the KV", ack.retryable)

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
                          AbortRequest(request_ids=[out.req.request_id], reason="error"), MAXLEN["engine_in"])
        self.sched.abort(out.req.request_id)
        self.service.send_error(out.req, message, status)
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
            self.bus.send_many([(h.reply_to, ErrorReply(request_id=h.group_id, status=503, type="server_error",
                                                        message=decode_lost_message(engine, during_transfer=False)),
                                 MAXLEN["reply"]) for _, h in records])
            for rid, h in records:
                del self.handed[rid]
                self._drop_record(h)
        log.warning("decode engine %d lost: failed %d transfers in flight, notified %d handed-off requests",
                    engine, len(lost), len(records))
        self.engine_gone.pop(engine, None)
        self.service.publish_stats()

    def _drop_record(self, record: HandedOff) -> None:
        self.handed_per_engine[record.engine] -= 1
        if self.handed_per_engine[record.engine] <= 0:
            del self.handed_per_engine[record.engine]

    # ------------------------------------------------------------------------ decode side

    def _receive(self, msg: KVHandoff) -> None:
        why = self._refusal(msg)
        if why is not None:
            log.warning("refused hand-off of %s from engine %d: %s", msg.request_id, msg.source_engine, why)
            self.counters.failures += 1
            self._send_ack(msg, "failed", why)
            return
        self.incoming[msg.manifest.transfer_id] = Incoming(msg=msg, req=request_from_handoff(msg))

    def _refusal(self, msg: KVHandoff) -> str | None:
        sched = self.sched
        m = msg.manifest
        if self.role == "prefill":
            return f"engine {self.e} is a prefill engine and takes no hand-offs"
        if m.block_size != sched.kv.block_size:
            return (f"KV block size mismatch: engine {msg.source_engine} uses {m.block_size}-token blocks, "
                    f"engine {self.e} {sched.kv.block_size}; start every engine with the same --block-size")
        if m.dtype != self.worker_dtype:
            return (f"KV dtype mismatch: engine {msg.source_engine} caches {m.dtype}, engine {self.e} "
                    f"{self.worker_dtype}; start every engine with the same --dtype")
        if msg.request_id in sched.requests or any(i.req.request_id == msg.request_id for i in self.incoming.values()):
            return f"duplicate request id {msg.request_id} on engine {self.e}"
        total = len(msg.prompt_token_ids) + msg.max_tokens
        if total > sched.config.max_model_len or not sched.kv.can_ever_fit(total):
            return (f"engine {self.e} cannot hold {total} tokens (max_model_len {sched.config.max_model_len}, "
                    f"{sched.kv.num_blocks * sched.kv.block_size} tokens of KV cache)")
        if msg.num_computed_tokens < 1 or msg.num_computed_tokens >= len(msg.prompt_token_ids) + len(msg.output_token_ids):
            return f"hand-off of {msg.request_id} has num_computed_tokens {msg.num_computed_tokens} out of range"
        return None

    def _imported(self, outcome: KVImportResult) -> None:
        inc = self.incoming.get(outcome.transfer_id)
        if inc is None or inc.state != "importing":
            return
        del self.incoming[outcome.transfer_id]
        sched = self.sched
        rid = inc.req.request_id
        if sched.parked.get(rid) is not inc.req:  # aborted while its KV came in
            self._ack(inc, "aborted")
            return
        if outcome.error is not None:
            sched.release(rid)
            self.counters.failures += 1
            self._ack(inc, "failed", outcome.error, outcome.retryable)
            return
        req = sched.unpark(rid)
        assert req is not None
        n = req.num_computed_tokens
        if sched.kv.enable_prefix_caching:  # a preempted request can then resume from them
            sched.kv.register_full_blocks(rid, req.hashes(sched.kv.block_size, n), n)
        c = self.counters
        c.received += 1
        c.bytes_received += outcome.nbytes
        c.import_seconds += outcome.import_ms / 1e3
        if inc.msg.first_token_at > 0:
            c.handoff_seconds += max(0.0, time.time() - inc.msg.first_token_at)
        self._ack(inc, "ok")

    def _ack(self, inc: Incoming, status: str, error: str = "", retryable: bool = False) -> None:
        self._send_ack(inc.msg, status, error, retryable)

    def _send_ack(self, msg: KVHandoff, status: str, error: str = "", retryable: bool = False) -> None:
        self.bus.send(self.bus.streams.engine_in(msg.source_engine),
                      KVTransferAck(transfer_id=msg.manifest.transfer_id, request_id=msg.request_id,
                                    decode_engine=self.e, status=status, error=error, retryable=retryable),
                      MAXLEN["engine_in"])
