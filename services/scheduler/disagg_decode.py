"""Disaggregation, decode side: taking in hand-offs from prefill engines.

A KVHandoff is checked, then waits for blocks (Scheduler.adopt, first come first served, as
memory allows); the next plan imports its KV into them, and once the result says it is in the
request joins the batch as if it had been prefilled here and the prefill engine is acked.
disagg.py has the whole protocol.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from rill.services.scheduler.request import Request
from rill.services.scheduler.scheduler import Scheduler
from rill.shared.bus import Bus
from rill.shared.config import detok_context_len
from rill.shared.kinds import EngineRole, HandoffStatus
from rill.shared.schema import KVHandoff, KVImport, KVImportResult, KVTransferAck

log = logging.getLogger("rill.scheduler.disagg")


def request_from_handoff(msg: KVHandoff) -> Request:
    return Request(request_id=msg.request_id, reply_to=msg.reply_to, prompt_token_ids=list(msg.prompt_token_ids),
                   params=msg.params, eos_token_ids=frozenset(msg.eos_token_ids), arrival_time=msg.arrival_time,
                   max_tokens=msg.max_tokens, priority=msg.priority, group_id=msg.group_id,
                   output_token_ids=list(msg.output_token_ids), detok_context=detok_context_len(msg.params.stop))


@dataclass(eq=False)
class Incoming:
    """One hand-off being taken in."""

    msg: KVHandoff
    req: Request
    state: str = "queued"  # "queued" (no blocks yet) -> "import" (next plan) -> "importing" (in the plan)


@dataclass
class ImportCounters:
    received: int = 0
    failures: int = 0
    bytes_received: int = 0
    import_seconds: float = 0.0
    handoff_seconds: float = 0.0


class DecodeSide:
    """The decode engine's hand-offs being taken in, in arrival order."""

    def __init__(self, bus: Bus, engine_id: int, role: EngineRole, sched: Callable[[], Scheduler]) -> None:
        self.bus = bus
        self.e = engine_id
        self.role = role
        self._sched = sched
        self.incoming: dict[str, Incoming] = {}  # transfer id ->, in arrival order
        self.counters = ImportCounters()
        self.worker_dtype = ""

    @property
    def imports_pending(self) -> bool:
        return any(i.state == "import" for i in self.incoming.values())

    def receive(self, msg: KVHandoff) -> None:
        why = self._refusal(msg)
        if why is not None:
            log.warning("refused hand-off of %s from engine %d: %s", msg.request_id, msg.source_engine, why)
            self.counters.failures += 1
            self._send_ack(msg, "failed", why)
            return
        self.incoming[msg.manifest.transfer_id] = Incoming(msg=msg, req=request_from_handoff(msg))

    def _refusal(self, msg: KVHandoff) -> str | None:
        sched = self._sched()
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

    def drop_queued(self, rid: str) -> None:
        """An abort of a request (or sample) still waiting for blocks."""
        for inc in [i for i in self.incoming.values() if i.state == "queued"
                    and rid in (i.req.request_id, i.req.group_id)]:
            del self.incoming[inc.msg.manifest.transfer_id]
            self._ack(inc, "aborted")

    def prepare(self) -> None:
        """Before scheduling: give queued hand-offs blocks, first come first served."""
        sched = self._sched()
        for inc in self.incoming.values():
            if inc.state != "queued":
                continue
            if len(sched.running) + len(sched.parked) >= sched.config.max_num_seqs:
                break
            if not sched.adopt(inc.req, inc.msg.num_computed_tokens):
                break  # memory is short: wait for requests to finish
            inc.state = "import"

    def imports(self) -> list[KVImport]:
        """The imports the plan about to be sent carries."""
        sched = self._sched()
        imports: list[KVImport] = []
        for inc in self.incoming.values():
            if inc.state == "import":
                imports.append(KVImport(manifest=inc.msg.manifest,
                                        block_ids=list(sched.kv.block_ids(inc.req.request_id))))
                inc.state = "importing"
        return imports

    def on_worker_reset(self) -> None:
        """Imports in flight are fetched again."""
        for inc in self.incoming.values():
            if inc.state == "importing":
                inc.state = "import"

    def reconcile(self, parked: dict[str, Request]) -> None:
        """Drop hand-offs whose request is no longer parked here, and tell the prefill engine."""
        for inc in list(self.incoming.values()):
            if inc.state != "queued" and parked.get(inc.req.request_id) is not inc.req:
                del self.incoming[inc.msg.manifest.transfer_id]
                self._ack(inc, "aborted")

    def imported(self, outcome: KVImportResult) -> None:
        inc = self.incoming.get(outcome.transfer_id)
        if inc is None or inc.state != "importing":
            return
        del self.incoming[outcome.transfer_id]
        sched = self._sched()
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

    def _ack(self, inc: Incoming, status: HandoffStatus, error: str = "", retryable: bool = False) -> None:
        self._send_ack(inc.msg, status, error, retryable)

    def _send_ack(self, msg: KVHandoff, status: HandoffStatus, error: str = "", retryable: bool = False) -> None:
        self.bus.send(self.bus.streams.engine_in(msg.source_engine),
                      KVTransferAck(transfer_id=msg.manifest.transfer_id, request_id=msg.request_id,
                                    decode_engine=self.e, status=status, error=error, retryable=retryable))
