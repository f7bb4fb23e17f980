"""Continuous batching at step granularity. Plain data in, plain data out: no I/O.

Each step has a token budget (`max_num_batched_tokens`). Running requests go first (decodes and
the next chunk of unfinished prompts), then waiting requests fill what is left; a prompt longer
than the remaining budget is chunked across steps, and `long_prefill_token_threshold` caps one
request's chunk so short requests behind a long one still get in. When a running request needs
a block and none is free, a victim (the most recently admitted, or the lowest priority) gives up
its blocks and is recomputed later. A waiting request first reuses whatever prefix of its tokens
the KV cache already holds; the samples of an `n > 1` request share their prompt's blocks.
The worker hears about a request once (NewRequestData) and afterwards only diffs (in_flight.py).

Async scheduling: the bus loop may build step N+1 while step N runs. A request's tokens in
plans whose results are not back yet count as in flight (`num_inflight_tokens`), and a token the
worker will sample in such a plan as a placeholder (`num_inflight_samples`): the next plan can
already run it, because the worker keeps its own sampled tokens. Results apply in step order;
one that belongs to a request since finished, aborted or preempted is dropped (a request that
stops on EOS computes one token in vain). With nothing in flight this is the synchronous case.

Disaggregation (disagg.py drives it): on a prefill engine a request parks at its first token
while its KV goes to a decode engine (request_states.py has the moves).

Speculative decoding (speculation.py proposes): a decode row may run drafts after its last token;
the result then brings back several tokens, and only the accepted ones count as computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rill.services.scheduler import admission
from rill.services.scheduler.detok_rows import DetokRows
from rill.services.scheduler.in_flight import tokens_by_request
from rill.services.scheduler.kv_cache_manager import KVCacheManager
from rill.services.scheduler.request import Refusal, Request, Status
from rill.services.scheduler.request_states import RequestStates
from rill.services.scheduler.speculation import Speculator, next_prediction_width, prediction_request_drafts
from rill.shared.config import PREDICTION_DRAFTS, StepCost
from rill.shared.kinds import EngineRole, FinishReason
from rill.shared.schema import DetokBatch, StepPlan, StepResult, TokenizedRequest

__all__ = ["Refusal", "Request", "Scheduler", "SchedulerConfig", "Status", "StepOutcome"]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0  # 0: a prompt chunk may take the whole budget
    step_cost: StepCost | None = None  # the worker's measure of its prompt steps; None: chunks take the budget
    policy: str = "fcfs"  # "fcfs" | "priority"
    engine_id: int = 0
    role: EngineRole = "both"  # "prefill": park each request at its first token, for a decode engine (disagg.py)
    verifies_drafts: bool = True  # False under tensor parallelism: a request's prediction is refused
    # The worker's decode steps of up to this many rows give each row the bits it would get alone:
    # drafts keep a step within it (if it holds a widest verify step), so they verify on decoding's
    # bits (0: no such bound).
    agreeing_rows: int = 0


@dataclass
class StepOutcome:
    """What one step's result turned into: text work for detokenizers, freed requests."""

    detok: DetokBatch | None
    finished: list[Request]
    parked: list[Request] = field(default_factory=list)  # prefill role: prompts done this step
    failed: list[tuple[Request, str]] = field(default_factory=list)  # failed alone on the worker, why


class Scheduler(RequestStates):
    """The decisions: which requests run each step and with how many tokens, and what a step's
    result does to them."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, speculator: Speculator | None = None) -> None:
        if config.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {config.policy!r}")
        super().__init__(config, kv)
        self.config: SchedulerConfig = config
        self.speculator = speculator
        # Steps with drafts keep within the rows that agree only where that holds one request's
        # widest verify step: below, exactness is not on offer and the bound would only cost speed.
        widest = max(PREDICTION_DRAFTS, speculator.config.num_speculative_tokens if speculator else 0)
        self.agreeing_rows = config.agreeing_rows if config.agreeing_rows > widest else 0

    # ----------------------------------------------------------------------------- admission

    def check_admissible(self, msg: TokenizedRequest) -> Refusal | None:
        """Why this request can never run here (and which request field to blame), or None.
        Checked before it is queued."""
        if msg.request_id in self.groups or msg.request_id in self.requests:
            return Refusal(f"duplicate request id {msg.request_id}", None)
        return admission.refusal(msg, self.kv, self.config.max_model_len, self.config.max_num_seqs,
                                 self.config.verifies_drafts)

    # ------------------------------------------------------------------------- scheduling

    def may_plan_ahead(self, depth: int) -> bool:
        """Whether another plan may be built now, with at most `depth` in flight.

        Only behind a decode-only step: there the round trip hidden is a real share of the
        step. A step running prompt tokens is long (on a CPU each one costs about a decode
        row), and a plan fixed while it runs would hold every request arriving meanwhile back
        by one more whole step: waiting for its result lets them join the next plan instead.
        With speculative decoding, not behind any step that decodes (its requests may speculate);
        without it, not behind a step of a request with a prediction (it drafts from it), but
        during the pause of one whose output left it (speculation.prediction_request_drafts).
        """
        in_flight = self.plans.in_flight
        if len(in_flight) >= depth:
            return False
        if not in_flight:
            return True
        last = in_flight[-1]
        if last.reqs and ((self.speculator is not None and self.speculator.active(len(self.running)))
                          or any(r.prediction and not r.prediction_pause for r in last.reqs)):
            return False  # its next drafts come from the tokens this step samples
        return all(n == 1 for n in last.plan.num_scheduled_tokens)

    def _chunk(self, req: Request, budget: int) -> int:
        if req.num_inflight_samples and self._ends_on_placeholder(req):
            return 0
        n = req.num_unplanned_tokens
        if n > budget:
            n = budget
        return self._prompt_chunk(n, req.num_planned_tokens) if n > 1 else n

    def _prompt_chunk(self, n: int, context: int) -> int:
        """At most `n` prompt tokens after `context` computed ones: within
        long_prefill_token_threshold, and, where the worker measured its steps, within the step
        time deep in a long prompt too (StepCost.chunk): every running stream waits for it."""
        cap = self.config.long_prefill_token_threshold
        if cap > 0:
            n = min(n, cap)
        cost = self.config.step_cost
        return cost.chunk(n, context, self.config.max_num_batched_tokens) if cost is not None else n

    def _ends_on_placeholder(self, req: Request) -> bool:
        """A token already in flight is certainly this request's last (length limits): scheduling
        past it would only compute a token that is thrown away."""
        pending = req.num_inflight_samples
        return (len(req.output_token_ids) + pending >= req.max_tokens
                or req.num_tokens + pending >= self.config.max_model_len)

    def schedule(self, force: bool = False) -> StepPlan | None:
        """Decide the next step. Returns None when there is nothing to run, unless `force` (the
        step carries KV transfers only)."""
        scheduled: dict[str, int] = {}  # request id -> tokens, in batch order
        drafts: dict[str, list[int]] = {}  # request id -> draft tokens among them
        budget, preempted = self._schedule_running(self.config.max_num_batched_tokens, scheduled, drafts)
        if not preempted:  # after a preemption nothing new is admitted: memory is short this step
            self._admit_waiting(budget, scheduled)
        if not scheduled and not self.plans.forget_ids and not force:
            return None
        return self._build_plan(scheduled, drafts)

    def _schedule_running(self, budget: int, scheduled: dict[str, int],
                          drafts: dict[str, list[int]]) -> tuple[int, bool]:
        """Running requests in admission order: decodes and the rest of chunked prompts, into
        `scheduled` and `drafts`. Returns the budget left and whether anyone was preempted."""
        preempted = False
        windowed, speculating = self.kv.sliding_window is not None, self.speculator is not None
        agreeing, start = self.agreeing_rows, budget
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
            if windowed:
                self.kv.release_behind_window(req.request_id, req.num_computed_tokens)
            draft: list[int] = []
            if speculating or req.prediction:  # holds their blocks; within the rows that agree (see the config)
                rows_after = start - budget + len(self.running) - i  # those planned, this one, one each after
                draft = self._draft(req, n, min(budget, agreeing - rows_after + 1) if agreeing else budget)
            n += len(draft)  # already: the loop below then only ever preempts for the token itself
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
        return budget, preempted

    def _admit_waiting(self, budget: int, scheduled: dict[str, int]) -> None:
        """Waiting requests in queue order, into `scheduled`, while budget, sequence slots and
        blocks last."""
        j = 0
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[j]
            shared = self._reusable_prefix(req)
            if shared is None:  # a sample waiting for its prompt's KV from sample 0
                j += 1
                continue
            computed = len(shared) * self.kv.block_size
            n = self._prompt_chunk(min(req.num_tokens - computed, budget), computed)
            if self.kv.allocate(req.request_id, computed + n, prefix_blocks=shared) is None:
                break
            self.kv.record_query(req.num_tokens, computed, preempted=req.num_preemptions > 0)
            if req.num_preemptions == 0:
                req.num_cached_tokens = computed
            del self.waiting[j]
            req.num_computed_tokens = computed
            req.status = Status.RUNNING
            self.running.append(req)
            self._observe_queue_time(req)
            scheduled[req.request_id] = n
            budget -= n

    def _draft(self, req: Request, n: int, budget: int) -> list[int]:
        """Speculative drafts for a decode row, from its prediction if it has one, else from the
        engine's speculator while it speculates; only if blocks for them are free: drafts never
        preempt anyone."""
        if n != 1:
            return []
        if req.prediction:
            draft = prediction_request_drafts(req, budget, self.config.max_model_len)
        elif self.speculator is not None and self.speculator.active(len(self.running)):
            draft = self.speculator.drafts(req, budget, self.config.max_model_len)
        else:
            return []
        if draft and self.kv.allocate(req.request_id, req.num_planned_tokens + 1 + len(draft)) is None:
            return []
        return draft

    def transfer_step(self) -> StepPlan:
        """A step that runs no tokens: it carries the forget list and, added by the caller, KV
        exports, so a prefill engine hands a request over without waiting for a prompt chunk."""
        return self._build_plan({})

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
        return self.plans.build([self.requests[rid] for rid in scheduled], scheduled, drafts)

    # ------------------------------------------------------------------------ step result

    def update(self, result: StepResult) -> StepOutcome:
        """Apply a step's sampled tokens: advance, check stops, cache full blocks, free finished ones."""
        step = self.plans.pop(result.step_id)
        if step is None:
            return StepOutcome(detok=None, finished=[])
        bs = self.kv.block_size
        sampled = tokens_by_request(result)
        prompt_lps = dict(zip(result.request_ids, result.prompt_logprobs, strict=True)) \
            if result.prompt_logprobs else {}
        rows = DetokRows()
        finished: list[Request] = []
        parked: list[Request] = []
        failed: list[tuple[Request, str]] = []
        errors, caching, num_hashed = result.errors, self.kv.enable_prefix_caching, self.kv.num_hashed
        for req, n, sampling, drafts in step.current_rows(self.requests):
            rid = req.request_id
            tokens, logprobs = sampled.get(rid) or ([], [])
            accepted = len(tokens) - 1 if tokens else 0  # drafts kept: all tokens but the sample
            req.num_computed_tokens += n - (drafts - accepted)  # rejected drafts' KV is not kept
            req.num_inflight_tokens -= n
            req.num_inflight_samples -= sampling
            if errors and rid in errors:
                self.running.remove(req)
                self._finish(req)
                failed.append((req, errors[rid]))
                continue
            if drafts:
                self._record_drafts(req, drafts, accepted)
            output = req.output_token_ids
            offset = len(output)
            reason = None
            for token in tokens:
                output.append(token)
                reason = self._stop_reason(req, token)
                if reason is not None:
                    break  # accepted drafts past a stop are dropped
            kept = len(output) - offset
            num_tokens = len(req.prompt_token_ids) + len(output)
            if req.num_computed_tokens > num_tokens:
                req.num_computed_tokens = num_tokens
            # Publish newly full blocks first: a request that ends now still leaves them cached.
            if caching and req.num_computed_tokens // bs > num_hashed.get(rid, 0):
                self.kv.register_full_blocks(rid, req.hashes(bs, req.num_computed_tokens), req.num_computed_tokens)
            if not kept:
                continue
            if kept < len(tokens):
                tokens, logprobs = tokens[:kept], logprobs[:kept]
            rows.add(req, offset, tokens, reason, logprobs, prompt_lps.get(rid, []) if prompt_lps else [])
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

    def _record_drafts(self, req: Request, drafts: int, accepted: int) -> None:
        """Count a row's verified drafts: a prediction's in its request (usage, and how many it
        drafts next), others in the speculator."""
        if req.prediction:
            req.num_prediction_drafts += drafts
            req.num_prediction_accepted += accepted
            req.prediction_width = next_prediction_width(drafts, accepted)
        elif self.speculator is not None:
            self.speculator.record(drafts, accepted)

    def fail_in_flight(self, step_id: int) -> list[Request]:
        """The step failed on the worker: its requests end with an error."""
        step = self.plans.pop(step_id)
        failed: list[Request] = []
        for req, *_ in step.current_rows(self.requests) if step else ():
            self.running.remove(req)
            self._finish(req)
            failed.append(req)
        return failed

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        num_out = len(req.output_token_ids)
        if token in req.eos_token_ids and num_out >= req.params.min_tokens:
            return "stop"
        if num_out >= req.max_tokens or num_out + len(req.prompt_token_ids) >= self.config.max_model_len:
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
                    block_size=self.kv.block_size, max_model_len=self.config.max_model_len,
                    steps=c.steps, mixed_steps=c.mixed_steps,
                    prefill_tokens=c.prefill_tokens, decode_tokens=c.decode_tokens,
                    max_step_tokens=c.max_step_tokens, last_step_tokens=c.last_step_tokens,
                    finished_requests=c.finished_requests, aborted_requests=c.aborted_requests,
                    preemptions=c.preemptions, kv_usage=round(self.kv.usage, 4),
                    num_cached_blocks=len(self.kv.cached), released_blocks=self.kv.released_total,
                    prefix_cache_queries=self.kv.queries,
                    prefix_cache_hits=self.kv.hits, prefix_cache_preempted_queries=self.kv.preempted_queries,
                    prefix_cache_preempted_hits=self.kv.preempted_hits, queue_time_bounds=list(self.queue_time.bounds),
                    queue_time_counts=self.queue_time.cumulative(), queue_time_sum=self.queue_time.sum,
                    num_transferring=len(self.parked))
