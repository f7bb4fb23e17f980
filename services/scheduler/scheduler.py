"""Continuous batching at step granularity. Plain data in, plain data out: no I/O.

Each step has a token budget (`max_num_batched_tokens`). Running requests go first (decodes and
the next chunk of unfinished prompts), then waiting requests fill what is left; a prompt longer
than the remaining budget is chunked across steps, and `long_prefill_token_threshold` caps one
request's chunk so short requests behind a long one still get in. When a running request needs
a block and none is free, a victim (the most recently admitted, or the lowest priority) gives up
its blocks and is recomputed later. A waiting request first reuses whatever prefix of its tokens
the KV cache already holds; the samples of an `n > 1` request share their prompt's blocks.
The worker hears about a request once (NewRequestData) and afterwards only diffs.

Async scheduling: the bus loop may build step N+1 while step N runs. A request's tokens in
plans whose results are not back yet count as in flight (`num_inflight_tokens`), and a token the
worker will sample in such a plan as a placeholder (`num_inflight_samples`): the next plan can
already run it, because the worker keeps its own sampled tokens. Results apply in step order;
one that belongs to a request since finished, aborted or preempted is dropped (a request that
stops on EOS computes one token in vain). With nothing in flight this is the synchronous case.

Disaggregation (disagg.py drives it): on a prefill engine a request whose prompt is done is
*parked* — out of the batch, blocks kept — while its KV goes to a decode engine; a decode engine
*adopts* a handed-over request as parked, with blocks for the incoming KV, and unparks it into
the batch once the KV is in them.

Speculative decoding (speculation.py proposes): a decode row may run drafts after its last token;
the result then brings back several tokens, and only the accepted ones count as computed.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rill.services.scheduler.detok_rows import DetokRows
from rill.services.scheduler.kv_cache_manager import KVCacheManager, blocks_for
from rill.services.scheduler.request import Refusal, Request, Status
from rill.services.scheduler.speculation import Speculator
from rill.services.scheduler.step_stats import QueueTimeHistogram, StepCounters
from rill.shared.schema import (
    DetokBatch,
    NewRequestData,
    StepPlan,
    StepResult,
    TokenizedRequest,
    TokenLogprobs,
)

__all__ = ["Refusal", "Request", "Scheduler", "SchedulerConfig", "Status", "StepOutcome"]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0  # 0: a prompt chunk may take the whole budget
    policy: str = "fcfs"  # "fcfs" | "priority"
    engine_id: int = 0
    role: str = "both"  # "prefill": park each request at its first token, for a decode engine (disagg.py)


@dataclass(slots=True)
class _InFlight:
    """A plan sent to the worker whose result is not back: what it will do to each request."""

    plan: StepPlan
    reqs: list[Request]
    incarnations: list[int]  # num_preemptions at scheduling time: a preempted request restarts
    samples: list[bool]  # the step samples a token for this request

    def current_rows(self, requests: dict[str, Request]) -> Iterator[tuple[Request, int, bool, int]]:
        """(request, tokens, samples, drafts) of the rows whose request is still the one
        scheduled: not finished, aborted or preempted since."""
        for req, incarnation, sampling, n, drafts in zip(self.reqs, self.incarnations, self.samples,
                                                         self.plan.num_scheduled_tokens, self.plan.num_drafts(),
                                                         strict=True):
            if (requests.get(req.request_id) is req and req.status is Status.RUNNING
                    and req.num_preemptions == incarnation):
                yield req, n, sampling, drafts


@dataclass
class StepOutcome:
    """What one step's result turned into: text work for detokenizers, freed requests."""

    detok: DetokBatch | None
    finished: list[Request]
    parked: list[Request] = field(default_factory=list)  # prefill role: prompts done this step
    failed: list[tuple[Request, str]] = field(default_factory=list)  # failed alone on the worker, why


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, speculator: Speculator | None = None) -> None:
        if config.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {config.policy!r}")
        self.config = config
        self.kv = kv
        self.speculator = speculator
        self.waiting: list[Request] = []  # kept in scheduling order (see _queue_key)
        self.running: list[Request] = []  # in admission order
        self.parked: dict[str, Request] = {}  # disaggregation: KV in transfer (see the module doc)
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[str]] = {}  # client request id -> sample ids
        self.counters = StepCounters()
        self.queue_time = QueueTimeHistogram()
        self._started_groups: set[str] = set()  # client requests already scheduled once
        self.clock: Callable[[], float] = time.time  # wall clock, as the gateway's arrival_time
        self._step_id = 0
        self._forget: list[str] = []  # ids the worker must drop at the next plan
        self._in_flight: deque[_InFlight] = deque()  # in step order

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

    # ----------------------------------------------------------------- admission and abort

    def check_admissible(self, msg: TokenizedRequest) -> Refusal | None:
        """Why this request can never run here (and which request field to blame), or None.
        Checked before it is queued."""
        p = msg.params
        total = len(msg.prompt_token_ids) + (p.max_tokens or 0)
        if msg.request_id in self.groups or msg.request_id in self.requests:
            return Refusal(f"duplicate request id {msg.request_id}", None)
        if not msg.prompt_token_ids:
            return Refusal("the prompt is empty", "prompt")
        if p.n < 1:
            return Refusal("n must be at least 1", "n")
        if total > self.config.max_model_len:
            return Refusal(f"This model's maximum context length is {self.config.max_model_len} tokens. "
                           f"However, you requested {total} tokens ({len(msg.prompt_token_ids)} in the "
                           f"prompt, {p.max_tokens} for the completion).", "max_tokens")
        if p.n > self.config.max_num_seqs:
            return Refusal(f"n={p.n} is more than this engine runs at once "
                           f"(max_num_seqs={self.config.max_num_seqs})", "n")
        if not self.kv.can_ever_fit(total):
            return Refusal(f"the request needs {total} tokens of KV cache but the whole cache holds "
                           f"{self.kv.num_blocks * self.kv.block_size}", "max_tokens")
        return None

    def add(self, msg: TokenizedRequest) -> list[Request]:
        reqs = Request.from_message(msg)
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
        if req.known_to_worker:
            self._forget.append(req.request_id)
            req.known_to_worker = False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_pending_forget(self) -> bool:
        return bool(self._forget)

    @property
    def num_in_flight(self) -> int:
        """Plans sent whose results have not been applied."""
        return len(self._in_flight)

    @property
    def oldest_in_flight(self) -> int | None:
        """Step id of the result to apply next."""
        return self._in_flight[0].plan.step_id if self._in_flight else None

    def may_plan_ahead(self, depth: int) -> bool:
        """Whether another plan may be built now, with at most `depth` in flight.

        Only behind a decode-only step: there the round trip hidden is a real share of the
        step. A step running prompt tokens is long (on a CPU each one costs about a decode
        row), and a plan fixed while it runs would hold every request arriving meanwhile back
        by one more whole step: waiting for its result lets them join the next plan instead.
        With speculative decoding, not behind a step of a request that may speculate either.
        """
        if len(self._in_flight) >= depth:
            return False
        if not self._in_flight:
            return True
        last = self._in_flight[-1]
        if self.speculator is not None and any(self.speculator.may_speculate(r) for r in last.reqs):
            return False  # its next drafts come from the tokens this step samples
        return all(n == 1 for n in last.plan.num_scheduled_tokens)

    # ------------------------------------------------------------------------- scheduling

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.status = Status.WAITING
        victim.num_computed_tokens = 0
        victim.num_inflight_tokens = victim.num_inflight_samples = 0  # its in-flight results are dropped
        victim.num_blocks_sent = 0
        victim.num_preemptions += 1
        if victim.known_to_worker:
            self._forget.append(victim.request_id)
            victim.known_to_worker = False
        self._enqueue(victim, front=True)
        self.counters.preemptions += 1

    def _chunk(self, req: Request, budget: int) -> int:
        if req.num_inflight_samples and self._ends_on_placeholder(req):
            return 0
        n = min(req.num_known_tokens - req.num_planned_tokens, budget)
        cap = self.config.long_prefill_token_threshold
        return min(n, cap) if cap > 0 and n > 1 else n

    def _ends_on_placeholder(self, req: Request) -> bool:
        """A token already in flight is certainly this request's last (length limits): scheduling
        past it would only compute a token that is thrown away."""
        pending = req.num_inflight_samples
        return (len(req.output_token_ids) + pending >= req.max_tokens
                or req.num_tokens + pending >= self.config.max_model_len)

    def schedule(self, force: bool = False) -> StepPlan | None:
        """Decide the next step. Returns None when there is nothing to run, unless `force` (the
        step carries KV transfers only)."""
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}  # request id -> tokens, in batch order
        drafts: dict[str, list[int]] = {}  # request id -> draft tokens among them
        preempted = False

        # 1. Running requests in admission order: decodes and the rest of chunked prompts.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            if n <= 0:
                i += 1
                continue
            # Blocks behind a sliding window are read by no query from here on: give them back
            # first. Counted from the computed tokens, not the planned ones, so a block is
            # released only after its prefix-cache hash is published.
            self.kv.release_behind_window(req.request_id, req.num_computed_tokens)
            draft = self._draft(req, n, budget)
            n += len(draft)
            while self.kv.allocate(req.request_id, req.num_planned_tokens + n) is None:
                victim = self._pick_victim()
                index = self.running.index(victim)
                self._preempt(victim)
                preempted = True
                budget += scheduled.pop(victim.request_id, 0)
                drafts.pop(victim.request_id, None)
                if victim is req:
                    break
                if index < i:
                    i -= 1
            if req.status is not Status.RUNNING:
                continue  # it gave way itself; running[i] is now the next one
            scheduled[req.request_id] = n
            if draft:
                drafts[req.request_id] = draft
            budget -= n
            i += 1

        # 2. Waiting requests in queue order while budget, sequence slots and blocks last.
        # After a preemption nothing new is admitted: memory is short this step.
        j = 0
        while (not preempted and j < len(self.waiting) and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[j]
            shared = self._reusable_prefix(req)
            if shared is None:  # a sample waiting for its prompt's KV from sample 0
                j += 1
                continue
            computed = len(shared) * self.kv.block_size
            n = min(req.num_tokens - computed, budget)
            cap = self.config.long_prefill_token_threshold
            if cap > 0:
                n = min(n, cap)
            if self.kv.allocate(req.request_id, computed + n, prefix_blocks=shared) is None:
                break
            self.kv.record_query(req.num_tokens, computed)
            del self.waiting[j]
            req.num_computed_tokens = computed
            req.status = Status.RUNNING
            self.running.append(req)
            self._observe_queue_time(req)
            scheduled[req.request_id] = n
            budget -= n

        if not scheduled and not self._forget and not force:
            return None
        return self._build_plan(scheduled, drafts)

    def _draft(self, req: Request, n: int, budget: int) -> list[int]:
        """Speculative drafts for a decode row, if blocks for them are free: drafts never
        preempt anyone."""
        if self.speculator is None or n != 1:
            return []
        draft = self.speculator.drafts(req, budget, self.config.max_model_len)
        if draft and self.kv.allocate(req.request_id, req.num_planned_tokens + 1 + len(draft)) is None:
            return []
        return draft

    def transfer_step(self) -> StepPlan:
        """A step that runs no tokens: it carries the forget list and, added by the caller, KV
        exports, so a prefill engine hands a request over without waiting for a prompt chunk."""
        return self._build_plan({})

    def _observe_queue_time(self, req: Request) -> None:
        """The first time any sample of a client request is scheduled: its queue time, once
        (a preempted request coming back, or sample i > 0 of the group, is not counted again)."""
        if req.group_id in self._started_groups:
            return
        self._started_groups.add(req.group_id)
        if req.arrival_time > 0:  # 0: a message built without an arrival time (tests, tools)
            self.queue_time.observe(self.clock() - req.arrival_time)

    def _reusable_prefix(self, req: Request) -> list[int] | None:
        """Blocks the request can start from: its group's prompt blocks or prefix-cache hits.

        None means "not yet": sample 0 of its group is still computing the shared prompt.
        """
        if req.share_prompt_with is not None:
            first = self.requests.get(req.share_prompt_with)
            if first is not None and not req.output_token_ids:
                if (first.status not in (Status.RUNNING, Status.PARKED)
                        or first.num_computed_tokens < len(first.prompt_token_ids)):
                    return None
                full = (len(req.prompt_token_ids) - 1) // self.kv.block_size
                return self.kv.shareable_prefix(first.request_id, full)
            req.share_prompt_with = None  # sample 0 is gone: fall back to the prefix cache
        # Prompt logprobs need every prompt position computed here: no cached prefix (as vLLM).
        use_cache = self.kv.enable_prefix_caching and req.params.prompt_logprobs is None
        hashes = req.hashes(self.kv.block_size, req.num_tokens) if use_cache else []
        return self.kv.lookup(hashes, req.num_tokens)

    def _build_plan(self, scheduled: dict[str, int], drafts: dict[str, list[int]] | None = None) -> StepPlan:
        self._step_id += 1
        new_reqs: list[NewRequestData] = []
        cached_ids: list[str] = []
        cached_blocks: list[list[int]] = []
        reqs = [self.requests[rid] for rid in scheduled]
        self._count(reqs, list(scheduled.values()))
        for req in reqs:
            blocks = self.kv.block_ids(req.request_id)
            if not req.known_to_worker:
                new_reqs.append(NewRequestData(
                    request_id=req.request_id, token_ids=req.all_token_ids, params=req.worker_params,
                    block_ids=list(blocks), num_computed_tokens=req.num_computed_tokens,
                    num_output_tokens=len(req.output_token_ids)))
                req.known_to_worker = True
            else:
                cached_ids.append(req.request_id)
                cached_blocks.append(blocks[req.num_blocks_sent:])
            req.num_blocks_sent = len(blocks)
        plan = StepPlan(
            step_id=self._step_id, new_requests=new_reqs, cached_request_ids=cached_ids,
            cached_new_block_ids=cached_blocks, scheduled_request_ids=list(scheduled),
            num_scheduled_tokens=list(scheduled.values()), finished_request_ids=self._forget,
            spec_token_ids=[drafts.get(rid, []) for rid in scheduled] if drafts else [])
        self._forget = []
        samples: list[bool] = []
        for req, n, k in zip(reqs, plan.num_scheduled_tokens, plan.num_drafts(), strict=True):
            # The worker samples when a step reaches the end of the tokens it knows by then.
            samples.append(req.num_planned_tokens + n - k == req.num_known_tokens)
            req.num_inflight_tokens += n
            req.num_inflight_samples += samples[-1]
        self._in_flight.append(_InFlight(plan, reqs, [r.num_preemptions for r in reqs], samples))
        return plan

    def _count(self, reqs: list[Request], tokens: list[int]) -> None:
        c = self.counters
        # A decode row runs exactly the last sampled token; anything else is (re)computing a prompt.
        decode = 0
        for r, n in zip(reqs, tokens, strict=True):
            known = r.num_known_tokens
            if known > len(r.prompt_token_ids) and r.num_planned_tokens == known - 1:
                decode += n
        total = sum(tokens)
        prefill = total - decode
        c.steps += 1
        c.prefill_tokens += prefill
        c.decode_tokens += decode
        c.mixed_steps += int(prefill > 0 and decode > 0)
        c.last_step_tokens = total
        c.max_step_tokens = max(c.max_step_tokens, total)

    # ------------------------------------------------------------------------ step result

    def update(self, result: StepResult) -> StepOutcome:
        """Apply a step's sampled tokens: advance, check stops, cache full blocks, free finished ones."""
        step = self._pop_in_flight(result.step_id)
        if step is None:
            return StepOutcome(detok=None, finished=[])
        bs = self.kv.block_size
        sampled = _tokens_by_request(result)
        prompt_lps = dict(zip(result.request_ids, result.prompt_logprobs, strict=True)) \
            if result.prompt_logprobs else {}
        rows = DetokRows()
        finished: list[Request] = []
        parked: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for req, n, sampling, drafts in step.current_rows(self.requests):
            rid = req.request_id
            tokens, logprobs = sampled.get(rid, ([], []))
            accepted = max(len(tokens) - 1, 0)
            req.num_computed_tokens += n - (drafts - accepted)  # rejected drafts' KV is not kept
            req.num_inflight_tokens -= n
            req.num_inflight_samples -= sampling
            if rid in result.errors:
                self.running.remove(req)
                self._finish(req)
                failed.append((req, result.errors[rid]))
                continue
            if drafts and self.speculator is not None:
                self.speculator.record(drafts, accepted)
            offset = len(req.output_token_ids)
            reason = None
            for token in tokens:
                req.output_token_ids.append(token)
                reason = self._stop_reason(req, token)
                if reason is not None:
                    break  # accepted drafts past a stop are dropped
            kept = len(req.output_token_ids) - offset
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
            # Publish newly full blocks first: a request that ends now still leaves them cached.
            if self.kv.enable_prefix_caching and req.num_computed_tokens // bs > self.kv.num_hashed.get(rid, 0):
                self.kv.register_full_blocks(rid, req.hashes(bs, req.num_computed_tokens), req.num_computed_tokens)
            if not kept:
                continue
            rows.add(req, offset, tokens[:kept], reason, logprobs[:kept], prompt_lps.get(rid, []))
            if reason is not None:
                self.running.remove(req)
                self._finish(req)
                self.counters.finished_requests += 1
                finished.append(req)
            elif self.config.role == "prefill" and offset == 0:
                # Only at its first token: one that decodes here after all stays here.
                self.running.remove(req)
                self._park(req)
                parked.append(req)
        detok = rows.batch(self.config.engine_id, result.step_id) if rows else None
        return StepOutcome(detok=detok, finished=finished, parked=parked, failed=failed)

    def fail_in_flight(self, step_id: int) -> list[Request]:
        """The step failed on the worker: its requests end with an error."""
        step = self._pop_in_flight(step_id)
        failed: list[Request] = []
        for req, *_ in step.current_rows(self.requests) if step else ():
            self.running.remove(req)
            self._finish(req)
            failed.append(req)
        return failed

    def _pop_in_flight(self, step_id: int) -> _InFlight | None:
        """The oldest plan in flight, if `step_id` is its result (results come back in order)."""
        if not self._in_flight or self._in_flight[0].plan.step_id != step_id:
            return None
        return self._in_flight.popleft()

    def reset_worker(self) -> None:
        """The worker restarted and lost every request and all KV: recompute them all."""
        self._in_flight.clear()
        self._forget = []
        for req in reversed(list(self.running)):
            req.known_to_worker = False
            self._preempt(req)
        for req in self.waiting:
            req.known_to_worker = False
        self._forget = []  # the new worker never knew them
        self.kv.reset_prefix_cache()

    # ------------------------------------------------------ disaggregation: parked requests

    def _park(self, req: Request) -> None:
        req.status = Status.PARKED
        self.parked[req.request_id] = req
        if req.known_to_worker:  # the worker needs no state for it; exports name the blocks
            self._forget.append(req.request_id)
            req.known_to_worker = False

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

    def _stop_reason(self, req: Request, token: int) -> str | None:
        num_out = len(req.output_token_ids)
        if token in req.eos_token_ids and num_out >= req.params.min_tokens:
            return "stop"
        if num_out >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def stats(self) -> dict[str, int | float | list[int] | list[float]]:
        c = self.counters
        spec = self.speculator
        return dict(spec_num_drafts=spec.num_drafts if spec else 0,
                    spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
                    spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
                    num_running=len(self.running), num_waiting=len(self.waiting),
                    num_blocks=self.kv.num_blocks, num_free_blocks=self.kv.num_free_blocks,
                    block_size=self.kv.block_size, steps=c.steps, mixed_steps=c.mixed_steps,
                    prefill_tokens=c.prefill_tokens, decode_tokens=c.decode_tokens,
                    max_step_tokens=c.max_step_tokens, last_step_tokens=c.last_step_tokens,
                    finished_requests=c.finished_requests, aborted_requests=c.aborted_requests,
                    preemptions=c.preemptions, kv_usage=round(self.kv.usage, 4),
                    num_cached_blocks=len(self.kv.cached), released_blocks=self.kv.released_total,
                    prefix_cache_queries=self.kv.queries,
                    prefix_cache_hits=self.kv.hits, queue_time_bounds=list(self.queue_time.bounds),
                    queue_time_counts=self.queue_time.cumulative(), queue_time_sum=self.queue_time.sum,
                    num_transferring=len(self.parked))

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
            assert r.num_inflight_tokens >= 0 and 0 <= r.num_inflight_samples <= len(self._in_flight)


def _tokens_by_request(result: StepResult) -> dict[str, tuple[list[int], list[TokenLogprobs]]]:
    """Each request's tokens of a step result and their logprobs (where asked for)."""
    counts = result.num_tokens or [1] * len(result.request_ids)
    out: dict[str, tuple[list[int], list[TokenLogprobs]]] = {}
    at = 0
    for rid, k in zip(result.request_ids, counts, strict=True):
        lps = [lp for lp in result.logprobs[at:at + k] if lp is not None] if result.logprobs else []
        out[rid] = (result.token_ids[at:at + k], lps)
        at += k
    return out
