"""Scheduler decisions and KV block bookkeeping, driven without Redis or a model."""

from __future__ import annotations

import pytest

from rill.services.scheduler.kv_cache_manager import KVCacheManager
from rill.services.scheduler.scheduler import Scheduler, SchedulerConfig, Status
from rill.shared.config import StepCost
from rill.shared.request_params import SamplingParams
from rill.shared.schema import StepPlan, StepResult, TokenizedRequest

EOS = 2


def make(rid: str, prompt_len: int, max_tokens: int | None = 8, **params: object) -> TokenizedRequest:
    return TokenizedRequest(request_id=rid, reply_to="reply", prompt_token_ids=list(range(10, 10 + prompt_len)),
                            params=SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),
                            eos_token_ids=[EOS], arrival_time=0.0)


def sched(num_blocks: int = 64, block_size: int = 4, budget: int = 32, max_seqs: int = 8,
          max_model_len: int = 256) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                     max_model_len=max_model_len), KVCacheManager(num_blocks, block_size))


def fake_result(plan: StepPlan, s: Scheduler, token: int = 7) -> StepResult:
    """What a worker returns: one token for every request that reaches the end of its known tokens."""
    ids = []
    for rid, n in zip(plan.scheduled_request_ids, plan.num_scheduled_tokens, strict=True):
        req = s.requests.get(rid)
        if req is not None and req.num_computed_tokens + n == req.num_tokens:
            ids.append(rid)
    return StepResult(step_id=plan.step_id, request_ids=ids, token_ids=[token] * len(ids))


def run_to_idle(s: Scheduler, token: int = 7, limit: int = 1000) -> list[StepPlan]:
    plans = []
    for _ in range(limit):
        plan = s.schedule()
        if plan is None:
            break
        plans.append(plan)
        s.update(fake_result(plan, s, token))
    return plans


def test_new_request_joins_next_step_and_finishes_frees_blocks() -> None:
    s = sched()
    s.add(make("a", 6, max_tokens=3))
    p1 = s.schedule()
    assert p1 is not None and p1.scheduled_request_ids == ["a"] and p1.num_scheduled_tokens == [6]
    assert [r.request_id for r in p1.new_requests] == ["a"]
    out = s.update(fake_result(p1, s))
    assert out.detok is not None and out.detok.offsets == [0]
    s.add(make("b", 3, max_tokens=2))
    p2 = s.schedule()
    assert p2 is not None
    # "a" is cached on the worker: sent as a diff; "b" joins in the very next step.
    assert p2.cached_request_ids == ["a"] and [r.request_id for r in p2.new_requests] == ["b"]
    assert p2.num_scheduled_tokens == [1, 3]
    s.update(fake_result(p2, s))
    run_to_idle(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert not s.requests and s.counters.finished_requests == 2


def test_block_diffs_only_send_new_blocks() -> None:
    s = sched(block_size=4)
    s.add(make("a", 4, max_tokens=10))
    plans = run_to_idle(s)
    sent: list[int] = list(plans[0].new_requests[0].block_ids)
    for p in plans[1:]:
        for rid, blocks in zip(p.cached_request_ids, p.cached_new_block_ids, strict=True):
            assert rid == "a"
            sent += blocks
    assert len(sent) == len(set(sent)) == 4  # 4 prompt + 10 output = 14 tokens -> 4 blocks (last token never cached)


def test_chunks_deep_in_a_prompt_shorten_to_hold_the_step_time() -> None:
    """With the worker's step cost (1 ms a token at a prompt's start, +1 % per token of context,
    an 80 ms target), a chunk after c tokens of context holds what fits 80 ms: 80 / (1 + 0.01 c)
    tokens, at most the budget, never under a quarter of it; with no measured cost, and where
    the budget's own step at a prompt's start is longer than the target, the budget's time holds."""
    def chunks(cost: StepCost | None) -> list[int]:
        s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024,
                                      step_cost=cost), KVCacheManager(256, 4))
        s.add(make("long", 600, max_tokens=1))
        return [p.num_scheduled_tokens[0] for p in run_to_idle(s) if p.num_scheduled_tokens]

    assert chunks(None) == [64] * 9 + [24]
    for target_s, bound in ((0.080, 80), (0.010, 64)):
        got = chunks(StepCost(0.001, 0.01, target_s))
        done = 0
        for n in got:
            assert n == min(600 - done, 64, max(16, int(bound / (1 + 0.01 * done)))), (target_s, got)
            done += n
        assert done == 600 and got[0] == 64 and 16 in got
    assert chunks(StepCost(0.001, 0.01, 0.080))[:3] == [64, 48, 37]  # 80 / 1.64 = 48 after 64


def test_chunked_prefill_respects_budget_and_mixes_with_decode() -> None:
    s = sched(budget=8, num_blocks=64)
    s.add(make("short", 3, max_tokens=6))
    p = s.schedule()
    s.update(fake_result(p, s))
    s.add(make("long", 20, max_tokens=2))
    chunks = []
    for _ in range(4):
        p = s.schedule()
        assert sum(p.num_scheduled_tokens) <= 8
        if "long" in p.scheduled_request_ids:
            chunks.append(p.num_scheduled_tokens[p.scheduled_request_ids.index("long")])
        assert p.scheduled_request_ids[0] == "short"  # the decode is never stalled by the long prompt
        s.update(fake_result(p, s))
    assert chunks[:3] == [7, 7, 6]
    assert s.counters.mixed_steps >= 3
    run_to_idle(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_eos_stop_token_and_length_stops() -> None:
    s = sched()
    s.add(make("eos", 3, max_tokens=50))
    s.add(make("stop_id", 3, max_tokens=50, stop_token_ids=[9]))
    s.add(make("len", 3, max_tokens=2))
    p = s.schedule()
    out = s.update(StepResult(step_id=p.step_id, request_ids=["eos", "stop_id", "len"], token_ids=[EOS, 9, 5]))
    assert out.detok.finish_reasons == ["stop", "stop", None]
    p = s.schedule()  # the worker is told to forget the finished requests in the next plan
    assert sorted(p.finished_request_ids) == ["eos", "stop_id"] and p.scheduled_request_ids == ["len"]
    out = s.update(StepResult(step_id=p.step_id, request_ids=["len"], token_ids=[5]))
    assert out.detok.finish_reasons == ["length"]
    p = s.schedule()
    assert p is not None and p.finished_request_ids == ["len"] and not p.scheduled_request_ids


def test_ignore_eos_and_min_tokens() -> None:
    s = sched()
    s.add(make("a", 3, max_tokens=3, ignore_eos=True))
    s.add(make("b", 3, max_tokens=5, min_tokens=2))
    p = s.schedule()
    out = s.update(StepResult(step_id=p.step_id, request_ids=["a", "b"], token_ids=[EOS, EOS]))
    assert out.detok.finish_reasons == [None, None]
    p = s.schedule()
    out = s.update(StepResult(step_id=p.step_id, request_ids=["a", "b"], token_ids=[EOS, EOS]))
    assert out.detok.finish_reasons == [None, "stop"]


def test_preemption_frees_newest_and_resumes_as_new() -> None:
    s = sched(num_blocks=6, block_size=4, budget=64)
    s.add(make("old", 8, max_tokens=12))
    s.add(make("new", 8, max_tokens=12))
    run_steps = 0
    preempted_plan = None
    while s.has_work and run_steps < 200:
        p = s.schedule()
        if p is None:
            break
        if "new" in p.finished_request_ids and preempted_plan is None:
            preempted_plan = p
        s.update(fake_result(p, s))
        run_steps += 1
    assert s.counters.preemptions >= 1 and preempted_plan is not None
    assert s.counters.finished_requests == 2
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_a_preempted_requests_lookup_again_is_counted_apart() -> None:
    """vLLM's rule: the hit rate counts each request's first lookup; a victim looking up again finds
    its own blocks, which would otherwise read as prefix-cache hits the more an engine preempts."""
    s = sched(num_blocks=6, block_size=4, budget=64)
    s.add(make("old", 8, max_tokens=12))
    s.add(make("new", 8, max_tokens=12))
    run_to_idle(s)
    assert s.counters.preemptions >= 1
    assert s.kv.queries == 16 and s.kv.hits <= 4  # the two prompts, once each
    assert s.kv.preempted_queries > 8 and s.kv.preempted_hits > 0  # the victim's prompt and output, again
    stats = s.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_preempted_queries"]) == (16, s.kv.preempted_queries)


def test_abort_in_every_state_frees_exactly_once() -> None:
    s = sched(num_blocks=8, block_size=4, budget=8, max_seqs=1)
    s.add(make("run", 10, max_tokens=4))
    s.add(make("wait", 4, max_tokens=4))
    p = s.schedule()  # "run" is mid-chunk (8 of 10)
    assert s.requests["run"].status is Status.RUNNING and s.requests["wait"].status is Status.WAITING
    assert [r.request_id for r in s.abort("wait")] == ["wait"]
    assert [r.request_id for r in s.abort("run")] == ["run"]
    assert s.abort("run") == []  # idempotent
    out = s.update(fake_result(p, s))  # the in-flight step's result is ignored for aborted requests
    assert out.detok is None
    assert s.kv.num_free_blocks == s.kv.num_blocks
    p = s.schedule()
    assert p is not None and p.finished_request_ids == ["run"] and not p.scheduled_request_ids


def test_admission_rejects_what_can_never_fit() -> None:
    s = sched(num_blocks=4, block_size=4, max_model_len=64)
    assert "maximum context length" in s.check_admissible(make("a", 60, max_tokens=10)).message
    assert "KV cache" in s.check_admissible(make("b", 10, max_tokens=10)).message
    assert s.check_admissible(make("c", 10, max_tokens=6)) is None


def test_an_unset_max_tokens_fills_the_context_this_engine_serves() -> None:
    # Chat's default (the tokenizer leaves it unset): the engine's own context, which may be less
    # than the model's when its KV cache holds less (shared/config.py fitted_max_model_len).
    s = sched(num_blocks=16, block_size=4, max_model_len=64)
    (req,) = s.add(make("a", 10, max_tokens=None, ignore_eos=True))
    assert req.max_tokens == 54
    run_to_idle(s)
    assert req.status is Status.FINISHED and len(req.output_token_ids) == 54 and req.num_tokens == 64
    too_long = s.check_admissible(make("b", 64, max_tokens=None))
    assert too_long.param == "messages" and "prompt has 64 tokens" in too_long.message
    assert s.check_admissible(make("c", 63, max_tokens=None)) is None


def test_max_num_seqs_caps_running() -> None:
    s = sched(max_seqs=2)
    for i in range(5):
        s.add(make(f"r{i}", 3, max_tokens=4))
    p = s.schedule()
    assert len(p.scheduled_request_ids) == 2 and len(s.waiting) == 3
    s.update(fake_result(p, s))
    run_to_idle(s)
    assert s.counters.finished_requests == 5


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_never_leaks(seed: int) -> None:
    import random

    rng = random.Random(seed)
    s = sched(num_blocks=12, block_size=4, budget=rng.choice([4, 8, 16]), max_seqs=4)
    n = 0
    for _ in range(300):
        if rng.random() < 0.3:
            s.add(make(f"r{n}", rng.randint(1, 12), max_tokens=rng.randint(1, 10)))
            n += 1
        if rng.random() < 0.05 and s.requests:
            s.abort(rng.choice(list(s.requests)))
        p = s.schedule()
        if p is not None:
            s.check_invariants()  # shared prefix blocks are counted by reference
            assert sum(p.num_scheduled_tokens) <= s.config.max_num_batched_tokens
            s.update(fake_result(p, s, token=rng.choice([EOS, 5, 6])))
    run_to_idle(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks and not s.requests


def test_prefix_cache_survives_a_request_that_ends_in_its_prefill_step() -> None:
    s = sched(num_blocks=16, block_size=4, budget=64)
    s.add(make("a", 10, max_tokens=1))
    run_to_idle(s)
    assert s.kv.num_free_blocks == 16 and len(s.kv.cached) == 2  # two full prompt blocks stay cached
    s.add(make("b", 10, max_tokens=1))
    p = s.schedule()
    assert p.new_requests[0].num_computed_tokens == 8 and p.num_scheduled_tokens == [2]
    assert s.kv.hits == 8 and s.kv.queries == 20


def test_cache_salt_shares_blocks_only_under_the_same_salt() -> None:
    """vLLM's cache_salt: the same prompt under another salt (or none) computes every token again;
    under the same salt it hits as an unsalted prompt hits an unsalted one."""
    s = sched(num_blocks=32, block_size=4, budget=64)
    computed: dict[str, int] = {}
    for rid, salt in (("a", "tenant-1"), ("b", None), ("c", "tenant-2"), ("d", "tenant-1"), ("e", None)):
        s.add(make(rid, 10, max_tokens=1, cache_salt=salt))
        p = s.schedule()
        computed[rid] = p.new_requests[0].num_computed_tokens
        s.update(fake_result(p, s))
        run_to_idle(s)
    assert computed == {"a": 0, "b": 0, "c": 0, "d": 8, "e": 8}


@pytest.mark.parametrize("salt", [None, "tenant"])
def test_request_hashes_grow_from_new_blocks_only(salt: str | None) -> None:
    """A request's memoised block hashes, grown step by step across its prompt and output,
    equal the hashes of all its tokens computed at once (the chain is one, wherever it is cut)."""
    from rill.services.scheduler.request import Request
    from rill.shared.block_hash import block_hashes

    bs, prompt = 4, list(range(3, 3 + 10))  # the prompt ends inside its third block
    req = Request.from_message(TokenizedRequest(
        request_id="h", reply_to="g", prompt_token_ids=prompt, eos_token_ids=[2], arrival_time=0.0,
        params=SamplingParams(max_tokens=50, cache_salt=salt)), 256)[0]
    for num_tokens in (3, 9, 10, 10, 13, 16, 17, 30):
        while len(req.prompt_token_ids) + len(req.output_token_ids) < num_tokens:
            req.output_token_ids.append(100 + len(req.output_token_ids))
        got = list(req.hashes(bs, num_tokens))
        assert got == block_hashes(req.all_token_ids[:num_tokens], bs, salt=salt)
        assert len(got) == num_tokens // bs
    # One with its output known before its first hashes (a preempted or handed-over request),
    # first hashed short of its prompt's end: no output token may slip into a prompt block.
    again = Request.from_message(TokenizedRequest(
        request_id="h2", reply_to="g", prompt_token_ids=prompt, eos_token_ids=[2], arrival_time=0.0,
        params=SamplingParams(max_tokens=50, cache_salt=salt)), 256)[0]
    again.output_token_ids.extend(req.output_token_ids)
    for num_tokens in (9, 30):
        assert again.hashes(bs, num_tokens) == block_hashes(req.all_token_ids[:num_tokens], bs, salt=salt)
