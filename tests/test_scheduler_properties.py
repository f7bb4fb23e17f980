"""Hypothesis state machine over the scheduler and its block manager.

Random arrivals (prompts drawn from a few shared prefixes so the prefix cache is exercised),
lengths, priorities, n > 1, aborts of whole requests or single samples, and tiny caches that
force chunking and preemption. After every step the invariants must hold.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rill.services.scheduler.kv_cache_manager import KVCacheManager
from rill.services.scheduler.scheduler import Scheduler, SchedulerConfig
from rill.shared.request_params import SamplingParams
from rill.shared.schema import StepResult, TokenizedRequest

EOS = 2
PREFIXES = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25], [5, 6, 7, 8, 30]]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 24), block_size=st.sampled_from([1, 2, 4]),
                budget=st.integers(1, 24), max_seqs=st.integers(1, 6), policy=st.sampled_from(["fcfs", "priority"]),
                threshold=st.sampled_from([0, 3]), caching=st.booleans())
    def setup(self, num_blocks: int, block_size: int, budget: int, max_seqs: int, policy: str,
              threshold: int, caching: bool) -> None:
        self.s = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=64,
                                           long_prefill_token_threshold=threshold, policy=policy),
                           KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching))
        self.next_id = 0
        self.outputs: dict[str, list[int]] = {}

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(3, 40), max_size=6),
          max_tokens=st.integers(1, 8), n=st.integers(1, 3), priority=st.integers(0, 2))
    def arrive(self, prefix: list[int], tail: list[int], max_tokens: int, n: int, priority: int) -> None:
        msg = TokenizedRequest(request_id=f"r{self.next_id}", reply_to="g", prompt_token_ids=prefix + tail,
                               params=SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n),
                               eos_token_ids=[EOS], arrival_time=0.0, priority=priority)
        self.next_id += 1
        if self.s.check_admissible(msg) is None:
            self.s.add(msg)

    @precondition(lambda self: bool(self.s.requests))
    @rule(data=st.data(), whole=st.booleans())
    def abort(self, data: st.DataObject, whole: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.s.requests)))
        if whole:
            rid = self.s.requests[rid].group_id
        self.s.abort(rid)

    @rule(tokens=st.lists(st.sampled_from([EOS, 3, 4, 5]), min_size=8, max_size=8))
    def step(self, tokens: list[int]) -> None:
        plan = self.s.schedule()
        if plan is None:
            assert not self.s.has_work or len(self.s.running) == 0
            return
        assert sum(plan.num_scheduled_tokens) <= self.s.config.max_num_batched_tokens
        assert len(plan.scheduled_request_ids) == len(set(plan.scheduled_request_ids))
        assert len(plan.scheduled_request_ids) <= self.s.config.max_num_seqs
        # A real worker samples for every row that reaches the end of the tokens it knows.
        ids = [rid for rid, n in zip(plan.scheduled_request_ids, plan.num_scheduled_tokens, strict=True)
               if self.s.requests[rid].num_computed_tokens + n == self.s.requests[rid].num_tokens]
        self.s.update(StepResult(step_id=plan.step_id, request_ids=ids,
                                 token_ids=[tokens[i % len(tokens)] for i in range(len(ids))]))

    @invariant()
    def blocks_consistent(self) -> None:
        if not hasattr(self, "s"):
            return
        s = self.s
        s.check_invariants()
        kv = s.kv
        in_use = sum(1 for c in kv.ref_cnt if c > 0)
        cached_free = kv.num_cached_free_blocks
        assert (kv.num_free_blocks - cached_free) + cached_free + in_use == kv.num_blocks
        if not s.requests:  # idle: everything free or cached-evictable
            assert kv.num_free_blocks == kv.num_blocks and not s.running and not s.waiting

    def teardown(self) -> None:
        if not hasattr(self, "s"):
            return
        # Drain: every admitted request finishes or is aborted and nothing leaks.
        for _ in range(2000):
            if not self.s.has_work:
                break
            self.step([EOS, 3, 4])
        for rid in list(self.s.groups):
            self.s.abort(rid)
        self.s.check_invariants()
        assert self.s.kv.num_free_blocks == self.s.kv.num_blocks


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestSchedulerMachine = SchedulerMachine.TestCase
