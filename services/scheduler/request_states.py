"""Where each request stands (waiting, running, parked) and every move between states.

A move frees what it must exactly once: blocks in the KV cache manager, and the worker's state
for the request, dropped at the next plan (in_flight.py). The waiting queue is kept in the
policy's order: arrival ("fcfs") or priority, then arrival; a preempted request goes back to the
front under fcfs.

Disaggregation (disagg.py drives it): on a prefill engine a request whose prompt is done is
*parked* (out of the batch, blocks kept) while its KV goes to a decode engine; a decode engine
*adopts* a handed-over request as parked, with blocks for the incoming KV, and unparks it into
the batch once the KV is in them.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from rill.services.scheduler.in_flight import PlanLedger
from rill.services.scheduler.kv_cache_manager import KVCacheManager, blocks_for
from rill.services.scheduler.request import Request, Status
from rill.services.scheduler.step_stats import QueueTimeHistogram, StepCounters
from rill.shared.schema import TokenizedRequest

if TYPE_CHECKING:
    from rill.services.scheduler.scheduler import SchedulerConfig


class RequestStates:
    """The scheduler's requests and their moves; Scheduler adds the decisions on top."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []  # kept in scheduling order (see _queue_key)
        self.running: list[Request] = []  # in admission order
        self.parked: dict[str, Request] = {}  # disaggregation: KV in transfer (see the module doc)
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[str]] = {}  # client request id -> sample ids
        self.counters = StepCounters()
        self.queue_time = QueueTimeHistogram()
        self._started_groups: set[str] = set()  # client requests already scheduled once
        self.clock: Callable[[], float] = time.time  # wall clock, as the gateway's arrival_time
        self.plans = PlanLedger(kv, self.counters)  # what the worker knows and has in flight

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_pending_forget(self) -> bool:
        return bool(self.plans.forget_ids)

    @property
    def num_in_flight(self) -> int:
        """Plans sent whose results have not been applied."""
        return len(self.plans.in_flight)

    @property
    def oldest_in_flight(self) -> int | None:
        """Step id of the result to apply next."""
        in_flight = self.plans.in_flight
        return in_flight[0].plan.step_id if in_flight else None

    # ------------------------------------------------------------------------- queue order

    def _queue_key(self, req: Request) -> tuple[int, int]:
        return (req.priority if self.config.policy == "priority" else 0, req.seq)

    def _enqueue(self, req: Request, front: bool = False) -> None:
        if front and self.config.policy == "fcfs":
            self.waiting.insert(0, req)
        else:
            bisect.insort(self.waiting, req, key=self._queue_key)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.seq))
        return self.running[-1]

    # ------------------------------------------------------------------- moves between states

    def add(self, msg: TokenizedRequest) -> list[Request]:
        reqs = Request.from_message(msg, self.config.max_model_len)
        self.groups[msg.request_id] = [r.request_id for r in reqs]
        for req in reqs:
            self.requests[req.request_id] = req
            self._enqueue(req)
        return reqs

    def abort(self, request_id: str) -> list[Request]:
        """Drop a request (every sample) or one sample, in any state; frees blocks exactly once."""
        ids = self.groups.get(request_id, [request_id])
        dropped: list[Request] = []
        for rid in ids:
            req = self.requests.get(rid)
            if req is None or req.status is Status.FINISHED:
                continue
            if req.status is Status.WAITING:
                self.waiting.remove(req)
            elif req.status is Status.PARKED:
                del self.parked[rid]
            else:
                self.running.remove(req)
            self._finish(req)
            self.counters.aborted_requests += 1
            dropped.append(req)
        return dropped

    def _finish(self, req: Request) -> None:
        req.status = Status.FINISHED
        self.kv.free(req.request_id)
        del self.requests[req.request_id]
        group = self.groups.get(req.group_id)
        if group is not None and all(rid not in self.requests for rid in group):
            del self.groups[req.group_id]
            self._started_groups.discard(req.group_id)
        self.plans.forget(req)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.status = Status.WAITING
        victim.num_computed_tokens = 0
        victim.num_inflight_tokens = victim.num_inflight_samples = 0  # its in-flight results are dropped
        victim.num_blocks_sent = 0
        victim.num_preemptions += 1
        self.plans.forget(victim)
        self._enqueue(victim, front=True)
        self.counters.preemptions += 1

    def _observe_queue_time(self, req: Request) -> None:
        """The first time any sample of a client request is scheduled: its queue time, once
        (a preempted request coming back, or sample i > 0 of the group, is not counted again)."""
        if req.group_id in self._started_groups:
            return
        self._started_groups.add(req.group_id)
        if req.arrival_time > 0:  # 0: a message built without an arrival time (tests, tools)
            self.queue_time.observe(self.clock() - req.arrival_time)

    def reset_worker(self) -> None:
        """The worker restarted and lost every request and all KV: recompute them all."""
        for req in reversed(list(self.running)):
            req.known_to_worker = False
            self._preempt(req)
        for req in self.waiting:
            req.known_to_worker = False
        self.plans.reset()  # the new worker never knew them, nor has it any plan of ours
        self.kv.reset_prefix_cache()

    # ------------------------------------------------------ disaggregation: parked requests

    def _park(self, req: Request) -> None:
        req.status = Status.PARKED
        self.parked[req.request_id] = req
        self.plans.forget(req)  # the worker needs no state for it; exports name the blocks

    def adopt(self, req: Request, num_computed: int, spare_blocks: int = 1) -> bool:
        """Decode side: take in a request whose first `num_computed` tokens' KV another engine
        computed. Blocks for that KV are allocated now (keeping `spare_blocks` free so the next
        decode steps need not preempt anyone) and it stays parked until `unpark`, once the KV is
        in them. False, changing nothing, when the blocks are not there yet."""
        if self.kv.num_free_blocks < blocks_for(num_computed, self.kv.block_size) + spare_blocks:
            return False
        if self.kv.allocate(req.request_id, num_computed) is None:
            return False
        req.num_computed_tokens = num_computed
        req.known_to_worker = False
        req.num_blocks_sent = 0
        self.requests[req.request_id] = req
        self.groups.setdefault(req.group_id, []).append(req.request_id)
        self._started_groups.add(req.group_id)  # its queue time was observed where it arrived
        self._park(req)
        return True

    def unpark(self, request_id: str) -> Request | None:
        """Into the batch with the KV it has (decode side after an import; a prefill engine
        decoding a request itself when no decode engine can take it)."""
        req = self.parked.pop(request_id, None)
        if req is None:
            return None
        req.status = Status.RUNNING
        req.num_blocks_sent = 0  # the worker hears about it afresh, blocks included
        self.running.append(req)
        return req

    def release(self, request_id: str) -> Request | None:
        """A parked request leaves this engine and frees its blocks (its KV now lives on the decode
        engine, or never arrived here); not counted as finished or aborted."""
        req = self.parked.pop(request_id, None)
        if req is not None:
            self._finish(req)
        return req

    def requeue_parked(self, request_id: str) -> Request | None:
        """A parked request whose KV was lost (the worker restarted before exporting it) computes
        again from the front of the queue, like a preempted one."""
        req = self.parked.pop(request_id, None)
        if req is None:
            return None
        self.kv.free(req.request_id)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_blocks_sent = 0
        self._enqueue(req, front=True)
        return req

    def check_invariants(self) -> None:
        """For tests: scheduler state and block manager agree."""
        self.kv.check_invariants()
        live = set(self.requests)
        running = {r.request_id for r in self.running}
        waiting = {r.request_id for r in self.waiting}
        assert running | waiting | set(self.parked) == live
        assert not (running & waiting) and not (set(self.parked) & (running | waiting))
        assert all(r.status is Status.PARKED for r in self.parked.values())
        assert set(self.kv.tables) <= running | set(self.parked)
        assert len(self.running) <= self.config.max_num_seqs
        for r in self.running:
            assert (len(self.kv.block_ids(r.request_id)) * self.kv.block_size
                    >= r.num_computed_tokens + r.num_inflight_tokens)
            assert r.num_inflight_tokens >= 0 and 0 <= r.num_inflight_samples <= len(self.plans.in_flight)

