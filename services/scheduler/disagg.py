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
     the prefix cache); a retryable "failed" exports again (disagg_prefill.MAX_ATTEMPTS in all); anything else
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

This module routes the scheduler loop's hooks to the two sides: disagg_prefill.py hands requests
out, disagg_decode.py takes them in.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rill.services.scheduler.disagg_decode import DecodeSide
from rill.services.scheduler.disagg_prefill import PrefillSide
from rill.services.scheduler.request import Request
from rill.services.scheduler.scheduler import Scheduler
from rill.shared.bus import Bus
from rill.shared.kinds import ENGINE_ROLES, EngineRole
from rill.shared.schema import AbortRequest, KVHandoff, KVTransferAck, StepPlan, StepResult, WorkerReady


class Disaggregation:
    """The hand-off state machine of one engine, driven by SchedulerService's loop (hooks:
    configure, tick, on_message, on_abort, prepare, decorate, after_step, on_worker_reset)."""

    def __init__(self, bus: Bus, engine_id: int, role: EngineRole, sched: Callable[[], Scheduler | None],
                 send_errors: Callable[[list[Request], str, int], None], publish_stats: Callable[[], None]) -> None:
        if role not in ENGINE_ROLES:
            raise ValueError(f"role must be one of {', '.join(ENGINE_ROLES)}, got {role!r}")
        self.bus = bus
        self.role = role
        self._sched = sched  # None until the worker is configured
        self.prefill = PrefillSide(bus, engine_id, lambda: self.sched, send_errors, publish_stats)
        self.decode = DecodeSide(bus, engine_id, role, lambda: self.sched)

    @property
    def sched(self) -> Scheduler:
        sched = self._sched()
        assert sched is not None
        return sched

    @property
    def wants_step(self) -> bool:
        """A transfer waits for the next plan (even one that runs no tokens)."""
        return self.prefill.exports_pending or self.decode.imports_pending

    @property
    def exports_pending(self) -> bool:
        """Prompt KV waits to leave: worth a step of its own (milliseconds) rather than riding
        along with a prompt chunk, after whose forward pass the result would come back."""
        return self.prefill.exports_pending

    def configure(self, ready: WorkerReady) -> None:
        self.decode.worker_dtype = ready.dtype

    def stats(self) -> dict[str, int | float | str]:
        out, inc = self.prefill.counters, self.decode.counters
        return dict(role=self.role, kv_transfers_sent=out.sent, kv_transfers_received=inc.received,
                    kv_transfer_failures=out.failures + inc.failures, kv_bytes_sent=out.bytes_sent,
                    kv_bytes_received=inc.bytes_received, kv_transfer_seconds_sum=round(out.transfer_seconds, 6),
                    kv_export_seconds_sum=round(out.export_seconds, 6),
                    kv_import_seconds_sum=round(inc.import_seconds, 6),
                    kv_handoff_seconds_sum=round(inc.handoff_seconds, 6))

    # -------------------------------------------------------------------------- loop hooks

    def tick(self) -> None:
        """Once per loop iteration: cancel what was aborted elsewhere, time out, watch engines."""
        if self._sched() is None:
            return
        now = time.monotonic()
        self.reconcile()
        self.prefill.tick(now)

    def on_message(self, msg: KVHandoff | KVTransferAck) -> None:
        if isinstance(msg, KVHandoff):
            self.decode.receive(msg)
        else:
            self.prefill.on_ack(msg)

    def on_abort(self, msg: AbortRequest) -> None:
        """After the scheduler dropped the ids: forward to the decode engines that hold them, and
        drop hand-offs not yet taken in."""
        forward: dict[int, list[str]] = {}
        for rid in msg.request_ids:
            record = self.prefill.handed.get(rid)
            if record is not None:
                forward.setdefault(record.engine, []).append(rid)
            self.decode.drop_queued(rid)
        if forward:
            self.bus.send_many([(self.bus.streams.engine_in(e), AbortRequest(request_ids=ids, reason=msg.reason))
                                for e, ids in forward.items()])
        self.reconcile()

    def prepare(self) -> None:
        """Decode side, before scheduling: give queued hand-offs blocks, first come first served."""
        self.decode.prepare()

    def decorate(self, plan: StepPlan) -> None:
        """Put the pending exports and imports into the plan about to be sent."""
        plan.kv_exports = self.prefill.exports()
        plan.kv_imports = self.decode.imports()

    def after_step(self, result: StepResult, parked: list[Request]) -> None:
        for manifest in result.kv_exports:
            self.prefill.exported(manifest)
        for outcome in result.kv_imports:
            self.decode.imported(outcome)
        for req in parked:
            self.prefill.start(req)

    def on_worker_reset(self) -> None:
        """The worker restarted with an empty cache: KV not yet exported is gone (those requests
        compute again); imports in flight are fetched again."""
        self.prefill.on_worker_reset()
        self.decode.on_worker_reset()

    def reconcile(self) -> None:
        """Drop transfers whose request left the scheduler some other way (abort, dead gateway,
        lost worker): their chunks are discarded and the other engine is told."""
        sched = self._sched()
        parked = sched.parked if sched is not None else {}
        self.prefill.reconcile(parked)
        self.decode.reconcile(parked)
