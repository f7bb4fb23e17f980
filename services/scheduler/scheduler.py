"""Continuous batching at step granularity. Plain data in, plain data out: no I/O.

Each step: running requests first (decodes and unfinished prefill chunks), then waiting
requests in FCFS order fill what is left of the token budget; a prompt that does not fit the
remaining budget is chunked across steps. When a running request needs a block and none is
free, the most recently admitted request is preempted (blocks freed, recomputed later).
The worker hears about a request once (NewRequestData) and afterwards only diffs.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from rill.services.scheduler.kv_cache_manager import KVCacheManager
from rill.shared.config import detok_context_len
from rill.shared.schema import (
    DetokBatch,
    NewRequestData,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenizedRequest,
)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    reply_to: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    known_to_worker: bool = False
    num_blocks_sent: int = 0
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @classmethod
    def from_message(cls, msg: TokenizedRequest) -> Request:
        stop_ids = set(msg.params.stop_token_ids)
        eos = set() if msg.params.ignore_eos else set(msg.eos_token_ids)
        return cls(request_id=msg.request_id, reply_to=msg.reply_to,
                   prompt_token_ids=list(msg.prompt_token_ids), params=msg.params,
                   eos_token_ids=frozenset(eos | stop_ids), arrival_time=msg.arrival_time,
                   max_tokens=msg.params.max_tokens or 16)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    engine_id: int = 0


@dataclass
class StepCounters:
    steps: int = 0
    mixed_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    max_step_tokens: int = 0
    last_step_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    preemptions: int = 0


@dataclass
class StepOutcome:
    """What one step's result turned into: text work for detokenizers, freed requests."""

    detok: DetokBatch | None
    finished: list[Request]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.counters = StepCounters()
        self._step_id = 0
        self._forget: list[str] = []  # ids the worker must drop at the next plan
        self._in_flight: StepPlan | None = None

    # ----------------------------------------------------------------- admission and abort

    def check_admissible(self, msg: TokenizedRequest) -> str | None:
        """Why this request can never run here, or None. Checked before it is queued."""
        total = len(msg.prompt_token_ids) + (msg.params.max_tokens or 0)
        if msg.request_id in self.requests:
            return f"duplicate request id {msg.request_id}"
        if not msg.prompt_token_ids:
            return "the prompt is empty"
        if total > self.config.max_model_len:
            return (f"This model's maximum context length is {self.config.max_model_len} tokens. "
                    f"However, you requested {total} tokens ({len(msg.prompt_token_ids)} in the "
                    f"prompt, {msg.params.max_tokens} for the completion).")
        if not self.kv.can_ever_fit(total):
            return (f"the request needs {total} tokens of KV cache but the whole cache holds "
                    f"{self.kv.num_blocks * self.kv.block_size}")
        return None

    def add(self, msg: TokenizedRequest) -> Request:
        req = Request.from_message(msg)
        self.requests[req.request_id] = req
        self.waiting.append(req)
        return req

    def abort(self, request_id: str) -> Request | None:
        """Drop a request in any state; frees its blocks exactly once. Idempotent."""
        req = self.requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return None
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        self._finish(req)
        self.counters.aborted_requests += 1
        return req

    def _finish(self, req: Request) -> None:
        req.status = Status.FINISHED
        self.kv.free(req.request_id)
        del self.requests[req.request_id]
        if req.known_to_worker:
            self._forget.append(req.request_id)
            req.known_to_worker = False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_pending_forget(self) -> bool:
        return bool(self._forget)

    # ------------------------------------------------------------------------- scheduling

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.status = Status.WAITING
        victim.num_computed_tokens = 0
        victim.num_blocks_sent = 0
        victim.num_preemptions += 1
        if victim.known_to_worker:
            self._forget.append(victim.request_id)
            victim.known_to_worker = False
        self.waiting.appendleft(victim)
        self.counters.preemptions += 1

    def schedule(self) -> StepPlan | None:
        """Decide the next step. Returns None when there is nothing to run."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False

        # 1. Running requests, oldest first: decodes and the rest of chunked prompts.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while self.kv.allocate(req.request_id, req.num_computed_tokens + n) is None:
                victim = self.running[-1]  # most recently admitted gives way
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break  # it preempted itself; everything after it is gone too
            scheduled.append((req, n))
            budget -= n
            i += 1

        # 2. Waiting requests in arrival order, while budget, sequence slots and blocks last.
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self.kv.allocate(req.request_id, req.num_computed_tokens + n) is None:
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n

        if not scheduled and not self._forget:
            return None
        return self._build_plan(scheduled)

    def _build_plan(self, scheduled: list[tuple[Request, int]]) -> StepPlan:
        self._step_id += 1
        new_reqs: list[NewRequestData] = []
        cached_ids: list[str] = []
        cached_blocks: list[list[int]] = []
        for req, _ in scheduled:
            blocks = self.kv.block_ids(req.request_id)
            if not req.known_to_worker:
                new_reqs.append(NewRequestData(
                    request_id=req.request_id, token_ids=req.all_token_ids, params=req.params,
                    block_ids=list(blocks), num_computed_tokens=req.num_computed_tokens,
                    num_output_tokens=len(req.output_token_ids)))
                req.known_to_worker = True
            else:
                cached_ids.append(req.request_id)
                cached_blocks.append(blocks[req.num_blocks_sent:])
            req.num_blocks_sent = len(blocks)
        plan = StepPlan(
            step_id=self._step_id, new_requests=new_reqs, cached_request_ids=cached_ids,
            cached_new_block_ids=cached_blocks,
            scheduled_request_ids=[r.request_id for r, _ in scheduled],
            num_scheduled_tokens=[n for _, n in scheduled],
            finished_request_ids=self._forget)
        self._forget = []
        self._count(scheduled)
        self._in_flight = plan
        return plan

    def _count(self, scheduled: list[tuple[Request, int]]) -> None:
        c = self.counters
        # A decode row runs exactly the last sampled token; anything else is (re)computing a prompt.
        decode = sum(n for r, n in scheduled
                     if r.output_token_ids and r.num_computed_tokens == r.num_tokens - 1)
        prefill = sum(n for _, n in scheduled) - decode
        c.steps += 1
        c.prefill_tokens += prefill
        c.decode_tokens += decode
        c.mixed_steps += int(prefill > 0 and decode > 0)
        c.last_step_tokens = prefill + decode
        c.max_step_tokens = max(c.max_step_tokens, prefill + decode)

    # ------------------------------------------------------------------------ step result

    def update(self, result: StepResult) -> StepOutcome:
        """Apply a step's sampled tokens: advance, check stops, free finished requests."""
        plan = self._in_flight
        if plan is None or plan.step_id != result.step_id:
            return StepOutcome(detok=None, finished=[])
        self._in_flight = None
        for rid, n in zip(plan.scheduled_request_ids, plan.num_scheduled_tokens, strict=True):
            req = self.requests.get(rid)
            if req is not None and req.status is Status.RUNNING:
                req.num_computed_tokens += n

        rows = _DetokRows()
        finished: list[Request] = []
        for rid, token in zip(result.request_ids, result.token_ids, strict=True):
            req = self.requests.get(rid)
            if req is None or req.status is not Status.RUNNING:
                continue  # aborted while the step ran
            offset = len(req.output_token_ids)
            req.output_token_ids.append(token)
            reason = self._stop_reason(req, token)
            rows.add(req, offset, [token], reason)
            if reason is not None:
                self.running.remove(req)
                self._finish(req)
                self.counters.finished_requests += 1
                finished.append(req)
        detok = rows.batch(self.config.engine_id, result.step_id) if rows else None
        return StepOutcome(detok=detok, finished=finished)

    def fail_in_flight(self) -> list[Request]:
        """The step failed on the worker: its requests end with an error."""
        plan, self._in_flight = self._in_flight, None
        failed: list[Request] = []
        for rid in plan.scheduled_request_ids if plan else []:
            req = self.requests.get(rid)
            if req is not None and req.status is Status.RUNNING:
                self.running.remove(req)
                self._finish(req)
                failed.append(req)
        return failed

    def reset_worker(self) -> None:
        """The worker restarted and lost every request: recompute them all (like preemption)."""
        self._in_flight = None
        self._forget = []
        for req in reversed(list(self.running)):
            req.known_to_worker = False
            self._preempt(req)
        for req in self.waiting:
            req.known_to_worker = False

    def _stop_reason(self, req: Request, token: int) -> str | None:
        num_out = len(req.output_token_ids)
        if token in req.eos_token_ids and num_out >= req.params.min_tokens:
            return "stop"
        if num_out >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def stats(self) -> dict[str, int]:
        c = self.counters
        return dict(num_running=len(self.running), num_waiting=len(self.waiting),
                    num_blocks=self.kv.num_blocks, num_free_blocks=self.kv.num_free_blocks,
                    block_size=self.kv.block_size, steps=c.steps, mixed_steps=c.mixed_steps,
                    prefill_tokens=c.prefill_tokens, decode_tokens=c.decode_tokens,
                    max_step_tokens=c.max_step_tokens, last_step_tokens=c.last_step_tokens,
                    finished_requests=c.finished_requests, aborted_requests=c.aborted_requests)


class _DetokRows:
    """Columnar builder for one step's DetokBatch."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.reply_to: list[str] = []
        self.offsets: list[int] = []
        self.new: list[list[int]] = []
        self.context: list[list[int]] = []
        self.reasons: list[str | None] = []
        self.prompt_tokens: list[int] = []
        self.stop: list[list[str]] = []
        self.skip_special: list[bool] = []
        self.include_stop: list[bool] = []

    def __bool__(self) -> bool:
        return bool(self.ids)

    def add(self, req: Request, offset: int, new: list[int], reason: str | None) -> None:
        p = req.params
        ctx = detok_context_len(p.stop)
        self.ids.append(req.request_id)
        self.reply_to.append(req.reply_to)
        self.offsets.append(offset)
        self.new.append(new)
        self.context.append(req.output_token_ids[max(0, offset - ctx):offset])
        self.reasons.append(reason)
        self.prompt_tokens.append(len(req.prompt_token_ids))
        self.stop.append(p.stop)
        self.skip_special.append(p.skip_special_tokens)
        self.include_stop.append(p.include_stop_str_in_output)

    def batch(self, engine_id: int, step_id: int) -> DetokBatch:
        return DetokBatch(engine_id=engine_id, step_id=step_id, request_ids=self.ids,
                          reply_to=self.reply_to, offsets=self.offsets, new_token_ids=self.new,
                          context_ids=self.context, finish_reasons=self.reasons,
                          prompt_tokens=self.prompt_tokens, stop=self.stop,
                          skip_special_tokens=self.skip_special, include_stop_str=self.include_stop)
