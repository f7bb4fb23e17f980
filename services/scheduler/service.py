"""The scheduler's bus loop: requests and aborts in, one plan per step out, results back.

Async scheduling (the default on a colocated engine): plan N+1 is built and sent while the
worker runs step N, so the worker finds its next plan waiting instead of idling through the
broker round trip, the scheduling and the result handling of every step. Then the loop waits
for result N, applies it, sends the step's tokens to the detokenizers and publishes stats.
Without it (`--no-async-scheduling`, and always on prefill/decode engines, whose hand-offs
need each step's outcome first) the loop is synchronous: send N, wait for N, apply, schedule
N+1. New requests and aborts are drained between plans.

Broker round trips: every process on a 2-core CPU server takes its CPU from the worker's
compute threads, so the loop batches a step's commands. What it sends (plans, the step's
detok batch, stats, acks) waits in an outbox for the next read, which goes with it in one
exchange: reading the inputs and looking for the result also go together. A step in steady
decode costs three round trips (the detok batch and the inputs; the inputs and the result when
the next plan is due; that plan and the wait for the result) instead of seven.

Faults (guard.py): a lost worker fails every request with a clear error, requests of dead
gateways are aborted, and a broker error or restart fails what was in flight and starts the
loop over (new handshake) once the broker answers again.
"""

from __future__ import annotations

import logging
import os
import time
import uuid

import msgspec
import redis

from rill.services.scheduler.disagg import Disaggregation
from rill.services.scheduler.guard import WORKER_LOST, EngineGuard
from rill.services.scheduler.held_requests import HeldRequests
from rill.services.scheduler.kv_cache_manager import KVCacheManager
from rill.services.scheduler.plan_timing import PlanTimer
from rill.services.scheduler.prefix_summary import PrefixSummary
from rill.services.scheduler.scheduler import Request, Scheduler, SchedulerConfig
from rill.services.scheduler.speculation import Speculator
from rill.shared.bus import Backoff, Bus, Entry
from rill.shared.config import EngineArgs, SpeculativeConfig, StepCost
from rill.shared.lifecycle import POLL_MS, StopFlag
from rill.shared.resp import Command
from rill.shared.schema import (
    AbortRequest,
    EngineStats,
    ErrorReply,
    Hello,
    KVHandoff,
    KVTransferAck,
    StepPlan,
    StepResult,
    TokenizedRequest,
    WorkerOutput,
    WorkerReady,
    encode,
    engine_input_decoder,
    worker_output_decoder,
)
from rill.shared.streams import SCHEDULER_GROUP

log = logging.getLogger("rill.scheduler")
HELLO_AGAIN_S = 5.0  # the handshake repeats its hello this often until the worker answers



def decode_worker_output(data: bytes) -> WorkerOutput | None:
    """A result-stream entry, or None (logged) when it does not decode: the broker is not
    trusted, and one bad entry must not take the engine down."""
    try:
        return worker_output_decoder.decode(data)
    except msgspec.DecodeError as exc:
        log.warning("dropping malformed worker output: %s", exc)
        return None

class SchedulerService:
    def __init__(self, bus: Bus, args: EngineArgs, stop: StopFlag) -> None:
        self.bus = bus
        self.args = args
        self.stop = stop
        self.e = args.engine_id
        s = bus.streams
        self.in_stream, self.plan_stream, self.result_stream = s.engine_in(self.e), s.plan(self.e), s.result(self.e)
        self.consumer = f"engine-{self.e}"
        # Plans in flight at once: 2 keeps the worker's next plan queued behind the running one.
        self.depth = 2 if args.async_scheduling and args.role == "both" else 1
        self.timer = PlanTimer()  # when a plan built ahead is due (as late as the worker allows)
        self.result_cursor = b"0-0"
        self.outbox: list[Command] = []  # sends that go with the next read (see the module doc)
        self.stats_due = False  # the stats changed: they go with the next exchange, once
        self.inputs_fresh = False  # the inputs were read just now, with the result
        self.summary = PrefixSummary(s.prefix_stream(self.e))  # cached blocks, for cache-aware routers
        self.held = HeldRequests(s.held_key(self.e))  # answered by the next scheduler if this one dies
        self.sched: Scheduler | None = None
        # Heartbeat, lost worker, dead gateways, broker restarts; and the prefill/decode hand-offs.
        self.guard = EngineGuard(bus, self.e, lambda: self.sched, self.send_errors, self.publish_stats)
        self.disagg = Disaggregation(bus, self.e, args.role, lambda: self.sched, self.send_errors,
                                     self.publish_stats)

    # ------------------------------------------------------------------------ start-up

    def handshake(self) -> WorkerReady | None:
        """Say hello to the worker and wait for its WorkerReady (whichever started first). The
        hello is repeated now and then: a worker whose answer was lost (its broker connection
        failed as it sent it) answers again."""
        self.result_cursor = self.bus.last_id(self.result_stream)
        next_hello = 0.0
        while not self.stop:
            if time.monotonic() >= next_hello:
                self.bus.send(self.plan_stream, Hello(scheduler_id=uuid.uuid4().hex))
                next_hello = time.monotonic() + HELLO_AGAIN_S
            for entry_id, data in self.bus.read(self.result_stream, self.result_cursor, POLL_MS):
                self.result_cursor = entry_id
                msg = decode_worker_output(data)
                if isinstance(msg, WorkerReady):
                    return msg
        return None

    def configure(self, ready: WorkerReady) -> None:
        max_model_len = min(self.args.max_model_len or ready.max_model_len, ready.max_model_len)
        budget = self.args.step_token_budget(ready.device, ready.max_num_batched_tokens)
        self.sched = Scheduler(
            SchedulerConfig(max_num_seqs=self.args.max_num_seqs,
                            max_num_batched_tokens=budget,
                            max_model_len=max_model_len,
                            long_prefill_token_threshold=self.args.long_prefill_token_threshold,
                            step_cost=StepCost.of(ready.step_cost),
                            policy=self.args.scheduling_policy, engine_id=self.e, role=self.args.role,
                            verifies_drafts=self.args.tensor_parallel_size == 1, agreeing_rows=ready.agreeing_rows),
            KVCacheManager(ready.num_blocks, ready.block_size, self.args.enable_prefix_caching,
                           sliding_window=ready.sliding_window or None),
            Speculator(SpeculativeConfig.parse(self.args.speculative_config)) if self.args.speculative_config else None)
        self.disagg.configure(ready)
        log.info("engine %d (%s) ready: %d KV blocks x %d tokens = %d tokens, max_model_len=%d, "
                 "max_num_seqs=%d, max_num_batched_tokens=%d, worker %s on %s (%s, quantization %s, %d tensor-parallel "
                 "ranks)", self.e, self.args.role,
                 ready.num_blocks, ready.block_size, ready.num_blocks * ready.block_size, max_model_len,
                 self.args.max_num_seqs, budget, ready.worker_id,
                 ready.device, ready.dtype, ready.quantization, self.args.tensor_parallel_size)
        if self.sched.speculator is not None:
            log.info("speculative decoding: %s", self.sched.speculator.config)

    # ------------------------------------------------------------------------- main loop

    def run(self) -> None:
        # What an earlier scheduler published (its load, its cached prefixes) must not draw requests
        # here before this one is ready: with no stats, routers pass over this engine until then.
        # Deleted before its requests are answered, since the gateways send some of them again.
        s = self.bus.streams
        self.bus.r.delete(s.stats_key(self.e), s.prefix_stream(self.e))
        self.held.answer_left_over(self.bus)  # before the worker answers: it may be loading for minutes
        ready = self.handshake()
        if ready is None:
            return
        self.configure(ready)
        self.bus.ensure_group(self.in_stream, SCHEDULER_GROUP)
        self.bus.r.sadd(self.bus.streams.engines_key(), self.e)
        self.summary.reset()
        self.publish_stats()
        # Entries this consumer read before a restart but never acked come first.
        self.drain_inputs(pending=True)
        try:
            while not self.stop:
                self.guard.tick()
                self.disagg.tick()
                sched = self.sched
                assert sched is not None
                busy = (sched.has_work or sched.has_pending_forget or self.disagg.wants_step
                        or sched.num_in_flight > 0)
                if not self.inputs_fresh:
                    self.drain_inputs(block_ms=None if busy else POLL_MS)
                self.inputs_fresh = False
                plan: StepPlan | None = None
                tried = sched.may_plan_ahead(self.depth) and self.timer.plan_due(sched.oldest_in_flight)
                if tried:
                    self.disagg.prepare()
                    if self.disagg.exports_pending:
                        plan = sched.transfer_step()
                    else:
                        plan = sched.schedule(force=self.disagg.wants_step)
                    if plan is not None:
                        self.disagg.decorate(plan)
                        self.outbox.append(self.bus.xadd(self.plan_stream, plan))
                        self.timer.sent(plan.step_id, plan.num_scheduled_tokens)
                        if sched.may_plan_ahead(self.depth):
                            self.flush()  # the worker may be idle: this plan goes now
                            continue  # room for one more plan before waiting
                step_id = sched.oldest_in_flight
                if step_id is None:
                    continue
                # Wait for the result, or until a plan ahead is due (then loop back to build it).
                ahead = sched.may_plan_ahead(self.depth) and not tried
                until = self.timer.plan_due_at(step_id) if ahead else None
                result = self.wait_result(step_id, until)
                if result is None:
                    continue
                self.timer.received(step_id, result.forward_ms / 1e3)
                self.apply(result)
                self.publish_stats()
            self.flush()  # stopping: the last step's tokens and stats still go out
        finally:
            self.bus.r.srem(self.bus.streams.engines_key(), self.e)
            self.bus.r.delete(self.summary.key)

    def flush(self) -> None:
        """Send the outbox now, without a read."""
        self.exchange([])

    def exchange(self, reads: list[Command]) -> list:
        """Send the outbox, then run `reads`, in one round trip; the reads' replies. The outbox
        is taken first: after a broker error its sends are not repeated (the loop starts over)."""
        sends, self.outbox = self.outbox, []
        if self.stats_due and self.sched is not None:
            # Built now, after everything queued: one SET however often they changed since.
            stats = EngineStats(engine_id=self.e, updated_at=time.time(), **self.sched.stats(), **self.disagg.stats())
            sends.append(("SET", self.bus.streams.stats_key(self.e), encode(stats)))
            # The held requests change only where the stats do (admit, finish, abort, fail).
            held, gone = self.held.commands(self.sched.requests, self.sched.parked)
            sends = held + sends + gone
        self.stats_due = False
        summary = self.summary.command(self.sched.kv) if self.sched is not None else None
        if summary is not None:
            sends.append(summary)
        return self.bus.exchange(sends + reads)[len(sends):]

    def read_inputs_command(self, block_ms: int | None = None, pending: bool = False) -> Command:
        return Bus.xreadgroup(self.in_stream, SCHEDULER_GROUP, self.consumer, block_ms, count=256, pending=pending)

    def drain_inputs(self, block_ms: int | None = None, pending: bool = False) -> None:
        (reply,) = self.exchange([self.read_inputs_command(block_ms, pending)])
        self.handle_inputs(Bus.entries(reply))

    def handle_inputs(self, entries: list[Entry]) -> None:
        if not entries:
            return
        for _, data in entries:
            try:
                msg = engine_input_decoder.decode(data)
            except msgspec.DecodeError as exc:
                log.warning("dropping malformed engine input: %s", exc)
                continue
            if isinstance(msg, TokenizedRequest):
                self.admit(msg)
            elif isinstance(msg, AbortRequest):
                for rid in msg.request_ids:
                    self.sched.abort(rid)  # type: ignore[union-attr]
                self.disagg.on_abort(msg)
            elif isinstance(msg, KVHandoff | KVTransferAck):
                self.disagg.on_message(msg)
        self.outbox.append(Bus.xack(self.in_stream, SCHEDULER_GROUP, [eid for eid, _ in entries]))
        self.publish_stats()

    def admit(self, msg: TokenizedRequest) -> None:
        sched = self.sched
        assert sched is not None
        why = sched.check_admissible(msg)
        if why is not None:
            self.bus.send(msg.reply_to, ErrorReply(request_id=msg.request_id, message=why.message, status=400,
                                                   param=why.param))
            return
        sched.add(msg)

    def wait_result(self, step_id: int, until: float | None = None) -> StepResult | None:
        """The result of `step_id`; None if the worker was lost or restarted, or, given `until`
        (a time on the timer's clock), when it has not come by then. The outbox goes first,
        and the inputs are read in the same round trip."""
        if until is not None:
            if self.outbox:
                self.flush()  # what the last step sent must not wait for the sleep
            # Sleep, then look once: a blocked XREAD cannot time out this finely (the broker
            # checks blocked clients' timeouts every 100 ms at its default hz of 10).
            time.sleep(max(0.0, until - self.timer.clock()))
        while not self.stop:
            if self.guard.worker_lost():
                self.guard.fail_all(WORKER_LOST)
                return None
            block_ms = None if until is not None else POLL_MS
            inputs, results = self.exchange([
                self.read_inputs_command(),
                Bus.xread(self.result_stream, self.result_cursor, block_ms, count=16)])
            self.handle_inputs(Bus.entries(inputs))
            # Read after the sleep, the inputs are as fresh as a read at the top of the loop;
            # before a blocking wait, they are not.
            self.inputs_fresh = until is not None
            for entry_id, data in Bus.entries(results):
                self.result_cursor = entry_id
                msg = decode_worker_output(data)
                if msg is None:
                    # Whichever step it carried is lost: make the worker start over (it answers
                    # with WorkerReady, below) and recompute, as after a worker restart.
                    self.bus.send(self.plan_stream, Hello(scheduler_id=uuid.uuid4().hex))
                    continue
                if isinstance(msg, WorkerReady):
                    # The worker restarted mid-step and forgot everything: recompute.
                    log.warning("worker %s restarted; recomputing %d running requests",
                                msg.worker_id, len(self.sched.running))  # type: ignore[union-attr]
                    self.configure_after_restart(msg)
                    return None
                if msg.step_id == step_id:
                    return msg
            if until is not None:
                return None
        return None

    def configure_after_restart(self, ready: WorkerReady) -> None:
        sched = self.sched
        assert sched is not None
        if ready.num_blocks != sched.kv.num_blocks or ready.block_size != sched.kv.block_size:
            # Different cache geometry: nothing in flight can be kept.
            reqs = list(sched.requests.values())
            for req in reqs:
                sched.abort(req.request_id)
            self.send_errors(reqs, "the engine restarted with a different KV cache", 503)
            self.configure(ready)
            return
        sched.reset_worker()
        self.timer.reset()
        self.disagg.on_worker_reset()

    def apply(self, result: StepResult) -> None:
        sched = self.sched
        assert sched is not None
        if result.error is not None:
            log.error("step %d failed on the worker: %s", result.step_id, result.error)
            self.send_errors(sched.fail_in_flight(result.step_id), f"the engine failed to run this request: {result.error}",
                             500)
            self.disagg.after_step(result, [])
            return
        outcome = sched.update(result)
        for req, why in outcome.failed:
            self.send_errors([req], why, 400)
        if outcome.detok is not None:
            self.outbox.append(self.bus.xadd(self.bus.streams.detok(self.e), outcome.detok))
        self.disagg.after_step(result, outcome.parked)

    def send_errors(self, reqs: list[Request], message: str, status: int) -> None:
        """An error reply to each request's gateway, all in one round trip. The gateway knows the
        client's id: a failing sample of an n > 1 request fails the request (once)."""
        clients = {req.group_id or req.request_id: req.reply_to for req in reqs}
        self.bus.send_many([(to, ErrorReply.of(cid, message, status)) for cid, to in clients.items()])

    def publish_stats(self) -> None:
        """The engine's stats changed; the next exchange publishes them."""
        self.stats_due = True


def run(redis_url: str, prefix: str, args: EngineArgs, stop: StopFlag | None = None) -> None:
    stop = stop if stop is not None else StopFlag()
    bus = Bus(redis_url, prefix, name=f"scheduler-{args.engine_id}-{os.getpid()}")
    service = SchedulerService(bus, args, stop)
    backoff = Backoff()
    service.guard.start()
    try:
        while not stop:
            try:
                service.run()
            except redis.RedisError as exc:
                # Whatever was in flight may be lost (plans, results, replies): fail it all once the
                # broker answers, then start over with a new handshake.
                log.warning("broker error: %r; failing in-flight requests and starting over", exc)
                if not bus.wait_for_broker(stop, backoff, key=service.in_stream):
                    break
                try:
                    service.guard.resync_broker()
                    service.guard.fail_all("the message broker failed while this request was in flight; "
                                           "the request was not completed, please retry")
                except redis.RedisError:
                    continue
                backoff.reset()
    finally:
        service.guard.stop()
        bus.close()
