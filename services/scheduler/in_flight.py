"""The worker's side of the scheduler's books: the plan each step sends, and those in flight.

The worker hears about a request once (NewRequestData: its tokens, blocks and parameters) and
afterwards only of its new blocks; the ids of requests it must drop ride on the next plan. A
plan stays in flight until its result is applied. Results come back in step order, and a row
whose request finished, was aborted or was preempted since is dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from rill.services.scheduler.kv_cache_manager import KVCacheManager
from rill.services.scheduler.request import Request, Status
from rill.services.scheduler.step_stats import StepCounters
from rill.shared.schema import NewRequestData, StepPlan, StepResult, TokenLogprobs


@dataclass(slots=True)
class InFlight:
    """A plan sent to the worker whose result is not back: what it will do to each request."""

    plan: StepPlan
    reqs: list[Request]
    incarnations: list[int]  # num_preemptions at scheduling time: a preempted request restarts
    samples: list[bool]  # the step samples a token for this request

    def current_rows(self, requests: dict[str, Request]) -> list[tuple[Request, int, bool, int]]:
        """(request, tokens, samples, drafts) of the rows whose request is still the one
        scheduled: not finished, aborted or preempted since."""
        running = Status.RUNNING
        return [(req, n, sampling, drafts)
                for req, incarnation, sampling, n, drafts in zip(self.reqs, self.incarnations, self.samples,
                                                                 self.plan.num_scheduled_tokens,
                                                                 self.plan.num_drafts(), strict=True)
                if requests.get(req.request_id) is req and req.status is running
                and req.num_preemptions == incarnation]


class PlanLedger:
    """Turns the scheduler's choice of rows into a StepPlan and keeps the plans in flight."""

    def __init__(self, kv: KVCacheManager, counters: StepCounters) -> None:
        self.kv = kv
        self.counters = counters
        self.step_id = 0
        self.forget_ids: list[str] = []  # ids the worker must drop at the next plan
        self.in_flight: deque[InFlight] = deque()  # in step order

    def forget(self, req: Request) -> None:
        """The worker drops the request's state at the next plan (if it ever had any)."""
        if req.known_to_worker:
            self.forget_ids.append(req.request_id)
            req.known_to_worker = False

    def build(self, reqs: list[Request], scheduled: dict[str, int], drafts: dict[str, list[int]] | None) -> StepPlan:
        """The plan for `reqs` (in batch order, `scheduled` their tokens), now in flight: its
        tokens count as in flight until its result is applied, and it counts in the step stats."""
        self.step_id += 1
        new_reqs: list[NewRequestData] = []
        cached_ids: list[str] = []
        cached_blocks: list[list[int]] = []
        plan = StepPlan(  # its lists are filled below
            step_id=self.step_id, new_requests=new_reqs, cached_request_ids=cached_ids,
            cached_new_block_ids=cached_blocks, scheduled_request_ids=list(scheduled),
            num_scheduled_tokens=list(scheduled.values()), finished_request_ids=self.forget_ids,
            spec_token_ids=[drafts.get(rid, []) for rid in scheduled] if drafts else [])
        samples: list[bool] = []
        decode = 0
        for req, n, k in zip(reqs, plan.num_scheduled_tokens, plan.num_drafts(), strict=True):
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
            planned, known = req.num_planned_tokens, req.num_known_tokens
            # The worker samples when a step reaches the end of the tokens it knows by then.
            samples.append(planned + n - k == known)
            # A decode row runs exactly the last sampled token; anything else is (re)computing a prompt.
            if planned == known - 1 and known > len(req.prompt_token_ids):
                decode += n
            req.num_inflight_tokens += n
            req.num_inflight_samples += samples[-1]
        self.counters.record_step(decode, sum(plan.num_scheduled_tokens))
        self.forget_ids = []
        self.in_flight.append(InFlight(plan, reqs, [r.num_preemptions for r in reqs], samples))
        return plan

    def pop(self, step_id: int) -> InFlight | None:
        """The oldest plan in flight, if `step_id` is its result (results come back in order)."""
        if not self.in_flight or self.in_flight[0].plan.step_id != step_id:
            return None
        return self.in_flight.popleft()

    def reset(self) -> None:
        """The worker restarted: it never knew any of this."""
        self.in_flight.clear()
        self.forget_ids = []


def tokens_by_request(result: StepResult) -> dict[str, tuple[list[int], list[TokenLogprobs]]]:
    """Each request's tokens of a step result and their logprobs (where asked for)."""
    if not result.num_tokens and not result.logprobs:  # the common step: one token each, no logprobs
        return {rid: ([t], []) for rid, t in zip(result.request_ids, result.token_ids, strict=True)}
    counts = result.num_tokens or [1] * len(result.request_ids)
    out: dict[str, tuple[list[int], list[TokenLogprobs]]] = {}
    at = 0
    for rid, k in zip(result.request_ids, counts, strict=True):
        lps = [lp for lp in result.logprobs[at:at + k] if lp is not None] if result.logprobs else []
        out[rid] = (result.token_ids[at:at + k], lps)
        at += k
    return out
