"""ModelRunner driven by hand-built StepPlans, the sampler, and the worker service over real Redis."""

from __future__ import annotations

import os
import random
import threading
import time
import uuid

import pytest
import torch
from transformers import LlamaForCausalLM

from rill.services.worker.model_runner import ModelRunner
from rill.services.worker.sampler import Sampler, SampleRow
from rill.shared.bus import Bus
from rill.shared.config import EngineArgs, ModelConfig, kv_cache_blocks
from rill.shared.lifecycle import StopFlag
from rill.shared.request_params import SamplingParams
from rill.shared.schema import (
    Hello,
    NewRequestData,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerReady,
    worker_output_decoder,
)

BLOCK = 4
NUM_BLOCKS = 96
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama


@pytest.fixture
def runner(tiny) -> ModelRunner:
    return ModelRunner(str(tiny[0]), dtype="float32", device="cpu", num_blocks=NUM_BLOCKS, block_size=BLOCK)


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(2, 299, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class HandScheduler:
    """Just enough scheduler to write plans: shuffled block ids, diffs, preemption."""

    def __init__(self, seed: int = 0) -> None:
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[str, list[int]] = {}
        self.sent: dict[str, int] = {}  # blocks the worker already knows
        self.tokens: dict[str, list[int]] = {}
        self.num_prompt: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.params: dict[str, SamplingParams] = {}
        self.forget: list[str] = []
        self.step_id = 0

    def add(self, rid: str, tokens: list[int], params: SamplingParams = GREEDY) -> None:
        self.tokens[rid], self.num_prompt[rid], self.params[rid] = list(tokens), len(tokens), params
        self.computed[rid] = 0

    def preempt(self, rid: str) -> None:
        self.free.extend(self.blocks.pop(rid))
        self.sent.pop(rid)
        self.computed[rid] = 0
        self.forget.append(rid)

    def plan(self, work: dict[str, int]) -> StepPlan:
        """work: request id -> tokens to run this step (0 or missing: the rest of its tokens)."""
        new, cached_ids, cached_blocks = [], [], []
        for rid, n in work.items():
            n = n or len(self.tokens[rid]) - self.computed[rid]
            work[rid] = n
            table = self.blocks.setdefault(rid, [])
            while len(table) * BLOCK < self.computed[rid] + n:
                table.append(self.free.pop())
            if rid not in self.sent:
                new.append(NewRequestData(rid, list(self.tokens[rid]), self.params[rid], list(table),
                                          num_computed_tokens=self.computed[rid],
                                          num_output_tokens=len(self.tokens[rid]) - self.num_prompt[rid]))
            else:
                cached_ids.append(rid)
                cached_blocks.append(table[self.sent[rid]:])
            self.sent[rid] = len(table)
        self.step_id += 1
        plan = StepPlan(step_id=self.step_id, new_requests=new, cached_request_ids=cached_ids,
                        cached_new_block_ids=cached_blocks, scheduled_request_ids=list(work),
                        num_scheduled_tokens=list(work.values()), finished_request_ids=self.forget)
        self.forget = []
        for rid, n in work.items():
            self.computed[rid] += n
        return plan

    def update(self, result: StepResult) -> None:
        assert result.error is None, result.error
        for rid, tok in zip(result.request_ids, result.token_ids, strict=True):
            self.tokens[rid].append(tok)

    def outputs(self, rid: str) -> list[int]:
        return self.tokens[rid][self.num_prompt[rid]:]


def hf_greedy(model: LlamaForCausalLM, tokens: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(tokens):].tolist()


def test_runner_reproduces_transformers_greedy(tiny, runner: ModelRunner) -> None:
    """New requests, chunked prefill beside decodes, cached block diffs, a finished request,
    and a preemption whose request resumes as new with prompt + outputs."""
    _, ref = tiny
    sched = HandScheduler(seed=1)
    prompts = {"a": prompt(1, 9), "b": prompt(2, 14), "c": prompt(3, 5)}
    for rid, p in prompts.items():
        sched.add(rid, p)
    n_out = 16

    res = runner.execute(sched.plan({"a": 0}))  # a: whole prompt
    assert res.request_ids == ["a"]
    sched.update(res)
    res = runner.execute(sched.plan({"a": 1, "b": 6}))  # b: first chunk, nothing sampled for it
    assert res.request_ids == ["a"]
    sched.update(res)
    res = runner.execute(sched.plan({"b": 8, "a": 1, "c": 0}))  # b finishes its prompt
    assert res.request_ids == ["b", "a", "c"]
    sched.update(res)
    while len(sched.outputs("a")) < 8:
        sched.update(runner.execute(sched.plan({"a": 1, "b": 1, "c": 1})))
    sched.preempt("b")  # b loses its blocks; the worker is told to forget it
    sched.update(runner.execute(sched.plan({"a": 1, "c": 1})))
    assert "b" not in runner.requests
    res = runner.execute(sched.plan({"b": 0, "a": 1}))  # b resumes: recompute prompt + outputs
    assert res.request_ids == ["b", "a"]
    sched.update(res)
    while any(len(sched.outputs(r)) < n_out for r in prompts):
        sched.update(runner.execute(sched.plan({r: 1 for r in prompts if len(sched.outputs(r)) < n_out})))
    for rid, p in prompts.items():
        assert sched.outputs(rid)[:n_out] == hf_greedy(ref, p, n_out), rid
    sched.forget.extend(prompts)
    assert runner.execute(sched.plan({})).error is None
    assert runner.requests == {}


def test_logits_of_sampled_rows_exposed(tiny, runner: ModelRunner) -> None:
    _, ref = tiny
    sched = HandScheduler()
    p = prompt(7, 10)
    sched.add("x", p)
    res = runner.execute(sched.plan({"x": 0}))
    assert runner.last_logits is not None and runner.last_logits.shape == (1, 300)
    with torch.no_grad():
        want = ref(torch.tensor([p])).logits[0, -1]
    assert (runner.last_logits[0] - want).abs().max().item() <= 1e-4
    assert res.token_ids == [int(want.argmax())]
    assert res.forward_ms > 0


def run_seeded(runner: ModelRunner, companions: dict[str, SamplingParams], order: str, n: int,
               preempt_at: int | None = None) -> list[int]:
    """Generate n tokens for request "s" (seeded) amid companions; return its outputs."""
    runner.reset()
    sched = HandScheduler(seed=len(companions))
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    sched.add("s", prompt(11, 7), seeded)
    for i, (rid, params) in enumerate(companions.items()):
        sched.add(rid, prompt(20 + i, 3 + 2 * i), params)
    for step in range(n):
        if step == preempt_at:
            sched.preempt("s")
        ids = ["s", *companions]
        if order == "last":
            ids = ids[1:] + ids[:1]
        sched.update(runner.execute(sched.plan({rid: 0 for rid in ids})))
    return sched.outputs("s")


def test_seeded_sampling_is_independent_of_batch(runner: ModelRunner) -> None:
    alone = run_seeded(runner, {}, "first", 10)
    assert len(alone) == 10
    crowd = {"g": GREEDY, "u": SamplingParams(temperature=1.0),
             "o": SamplingParams(temperature=0.7, seed=99), "k": SamplingParams(temperature=1.2, top_k=5)}
    assert run_seeded(runner, crowd, "last", 10) == alone
    assert run_seeded(runner, {"u": SamplingParams(temperature=1.5)}, "first", 10) == alone
    assert run_seeded(runner, crowd, "first", 10, preempt_at=4) == alone  # resumed after preemption
    # The seed really drives it: unseeded runs of the same request differ from it.
    other = SamplingParams(temperature=0.9, top_p=0.95, top_k=40)
    runner.reset()
    sched = HandScheduler()
    sched.add("s", prompt(11, 7), other)
    for _ in range(10):
        sched.update(runner.execute(sched.plan({"s": 0})))
    assert sched.outputs("s") != alone


def test_bad_plans_return_errors_and_runner_keeps_working(tiny, runner: ModelRunner) -> None:
    _, ref = tiny
    sched = HandScheduler()
    p = prompt(5, 6)
    sched.add("ok", p)
    good = sched.plan({"ok": 0})

    def broken(**changes) -> StepPlan:
        fields = {f: getattr(good, f) for f in StepPlan.__struct_fields__}
        fields.update(changes)
        return StepPlan(**fields)

    new = good.new_requests[0]
    bad_plans = {
        "unknown scheduled id": broken(scheduled_request_ids=["ok", "ghost"], num_scheduled_tokens=[6, 1]),
        "unknown cached id": broken(cached_request_ids=["ghost"], cached_new_block_ids=[[1]]),
        "too many tokens": broken(num_scheduled_tokens=[7]),
        "block out of range": broken(new_requests=[NewRequestData("ok", p, GREEDY, [NUM_BLOCKS])]),
        "too few blocks": broken(new_requests=[NewRequestData("ok", p, GREEDY, new.block_ids[:1])]),
        "token outside vocab": broken(new_requests=[NewRequestData("ok", [*p[:-1], 300], GREEDY, new.block_ids)]),
        "negative temperature": broken(new_requests=[NewRequestData("ok", p, SamplingParams(temperature=-1),
                                                                    new.block_ids)]),
        "ragged columns": broken(num_scheduled_tokens=[6, 1]),
        "scheduled twice": broken(scheduled_request_ids=["ok", "ok"], num_scheduled_tokens=[3, 3]),
    }
    for why, plan in bad_plans.items():
        res = runner.execute(plan)
        assert res.error, why
        assert res.step_id == good.step_id and res.request_ids == [] and res.token_ids == []
        assert runner.requests == {}, f"{why}: a refused plan must leave no state behind"
    # The same runner still serves the good plan, and decodes on from it.
    res = runner.execute(good)
    assert res.error is None
    sched.update(res)
    for _ in range(4):
        sched.update(runner.execute(sched.plan({"ok": 1})))
    assert sched.outputs("ok") == hf_greedy(ref, p, 5)


def test_min_tokens_bans_stop_tokens(tiny, runner: ModelRunner) -> None:
    sched = HandScheduler()
    p = prompt(8, 6)
    sched.add("free", p)
    first = runner.execute(sched.plan({"free": 0})).token_ids[0]
    sched.add("held", p, SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[first]))
    res = runner.execute(sched.plan({"held": 0}))
    assert res.token_ids[0] != first
    assert int(runner.last_logits[0].argmax()) == first  # the logits themselves are untouched


def test_sampler_filters() -> None:
    sampler = Sampler(seed=0)
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]] * 4)
    rows = [SampleRow(SamplingParams(temperature=1.0, top_k=1), 0),
            SampleRow(SamplingParams(temperature=1.0, top_p=0.01), 0),
            SampleRow(SamplingParams(temperature=0.0), 0),
            SampleRow(SamplingParams(temperature=1e-4), 0)]
    for _ in range(20):
        assert sampler.sample(logits, rows) == [1, 1, 1, 1]
    # top_k=2 keeps exactly tokens 1 and 2, in roughly their softmax ratio.
    counts = torch.zeros(5)
    row = [SampleRow(SamplingParams(temperature=1.0, top_k=2), 0)] * 64
    for _ in range(40):
        for t in sampler.sample(logits[:1].expand(64, -1).contiguous(), row):
            counts[t] += 1
    assert counts[[0, 3, 4]].sum() == 0
    share = counts[1] / counts.sum()
    assert abs(share.item() - torch.softmax(torch.tensor([3.0, 2.9]), 0)[0].item()) < 0.05


def test_sampler_top_p_nucleus_and_top_k_renormalization() -> None:
    sampler = Sampler(seed=1)
    # A flat-ish 5000-token row: its 0.9 nucleus spans thousands of tokens, past the first
    # candidate stages, and every sample must fall inside it.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 5000, generator=gen) * 0.5
    probs = torch.softmax(logits, -1)
    sorted_p, order = probs.sort(-1, descending=True)
    nucleus_size = ((sorted_p.cumsum(-1) - sorted_p) < 0.9).sum(-1)
    assert nucleus_size.min() > 1024
    rows = [SampleRow(SamplingParams(temperature=1.0, top_p=0.9), 0)] * 8
    for _ in range(10):
        for i, tok in enumerate(sampler.sample(logits, rows)):
            rank = (order[i] == tok).nonzero().item()
            assert rank < nucleus_size[i]
    # top_p applies to the top-k renormalized distribution: p = (.5, .3, .2), top_k=2 gives
    # (.625, .375), so top_p=0.6 leaves token 0 alone (without renormalization it would keep 2).
    three = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    row = [SampleRow(SamplingParams(temperature=1.0, top_k=2, top_p=0.6), 0)]
    assert {sampler.sample(three, row)[0] for _ in range(50)} == {0}
    row = [SampleRow(SamplingParams(temperature=1.0, top_p=0.6), 0)]
    assert {sampler.sample(three, row)[0] for _ in range(200)} == {0, 1}


def test_sampler_full_vocab_frequencies_and_seeds() -> None:
    sampler = Sampler(seed=2)
    logits = torch.tensor([[1.0, 0.0, 2.0, -1.0]]).expand(256, -1).contiguous()
    want = torch.softmax(logits[0] / 0.7, 0)
    counts = torch.zeros(4)
    rows = [SampleRow(SamplingParams(temperature=0.7), 0)] * 256
    for _ in range(20):
        for t in sampler.sample(logits, rows):
            counts[t] += 1
    assert (counts / counts.sum() - want).abs().max() < 0.02
    # Same seed and output index: same token, whatever else is in the batch.
    seeded = SamplingParams(temperature=1.0, seed=7)
    gen_a, gen_b = torch.Generator(), torch.Generator()
    a = [sampler.sample(logits[:1], [SampleRow(seeded, i, gen_a)])[0] for i in range(30)]
    b = [sampler.sample(logits[:3], [SampleRow(SamplingParams(temperature=2.0), 0), SampleRow(seeded, i, gen_b),
                                     SampleRow(GREEDY, 0)])[1] for i in range(30)]
    assert a == b and len(set(a)) > 1


def test_inverse_cdf_never_picks_zero_weight_tokens() -> None:
    from rill.services.worker.sampler import _inverse_cdf

    p = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0], [0.2, 0.0, 0.0, 0.8, 0.0]])
    for u, want in (([0.0, 0.0], [1, 0]), ([0.5, 0.2], [2, 3]), ([1 - 1e-17, 1 - 1e-12], [2, 3])):
        assert _inverse_cdf(p, torch.tensor(u, dtype=torch.float64)).tolist() == want


def test_runner_reset_forgets_requests(runner: ModelRunner) -> None:
    sched = HandScheduler()
    sched.add("r", prompt(9, 4))
    sched.update(runner.execute(sched.plan({"r": 0})))
    runner.reset()
    assert runner.requests == {}
    res = runner.execute(sched.plan({"r": 1}))
    assert res.error and "unknown request id" in res.error


# ------------------------------------------------------------------------------ the service


def test_worker_service_over_redis(tiny) -> None:
    from rill.services.worker.service import run

    path, ref = tiny
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
    prefix = f"test-worker-{uuid.uuid4().hex[:8]}"
    kv_bytes = 1 << 20
    args = EngineArgs(model_dir=str(path), engine_id=3, block_size=BLOCK, kv_cache_memory=kv_bytes,
                      dtype="float32", device="cpu")
    bus = Bus(url, prefix)
    plans, results = bus.streams.plan(3), bus.streams.result(3)
    stop = StopFlag(install=False)
    thread = threading.Thread(target=run, args=(url, prefix, args, stop), daemon=True)
    seen = b"0-0"

    def next_output(timeout: float = 30.0):
        nonlocal seen
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for entry_id, payload in bus.read(results, seen, block_ms=200, count=1):
                seen = entry_id
                return worker_output_decoder.decode(payload)
        raise AssertionError("no message from the worker")

    try:
        thread.start()
        ready = next_output()
        want_blocks = kv_cache_blocks(ModelConfig.from_dir(path), "float32", BLOCK, kv_bytes)
        assert isinstance(ready, WorkerReady)
        assert (ready.num_blocks, ready.block_size, ready.dtype, ready.device) == (want_blocks, BLOCK,
                                                                                   "float32", "cpu")
        assert ready.max_model_len == 256
        p = prompt(4, 8)
        bus.send(plans, StepPlan(step_id=1, new_requests=[NewRequestData("q", p, GREEDY, [5, 1])],
                                 cached_request_ids=[], cached_new_block_ids=[], scheduled_request_ids=["q"],
                                 num_scheduled_tokens=[8]))
        res = next_output()
        assert isinstance(res, StepResult) and res.step_id == 1 and res.request_ids == ["q"]
        assert res.token_ids == hf_greedy(ref, p, 1)
        bus.r.xadd(plans, {b"m": b"\xc1 not msgpack"})  # garbage is skipped, not fatal
        bus.send(plans, StepPlan(step_id=2, new_requests=[], cached_request_ids=["nope"],
                                 cached_new_block_ids=[[]], scheduled_request_ids=["nope"],
                                 num_scheduled_tokens=[1]))
        res = next_output()
        assert isinstance(res, StepResult) and res.step_id == 2 and res.error
        bus.send(plans, Hello(scheduler_id="s2"))  # the scheduler restarted: state reset, ready again
        assert isinstance(next_output(), WorkerReady)
        bus.send(plans, StepPlan(step_id=3, new_requests=[], cached_request_ids=["q"], cached_new_block_ids=[[]],
                                 scheduled_request_ids=["q"], num_scheduled_tokens=[1]))
        res = next_output()
        assert res.error and "unknown request id" in res.error
        bus.send(plans, Shutdown(reason="test"))
        thread.join(timeout=10)
        assert not thread.is_alive()
    finally:
        stop.set()
        thread.join(timeout=10)
        bus.r.delete(plans, results)
        bus.close()


@pytest.mark.skipif(not os.environ.get("RILL_BENCH"), reason="timing only: set RILL_BENCH=1")
@pytest.mark.parametrize("batch", [16, 64])
def test_smollm2_bf16_decode_step_time(batch: int) -> None:
    """Prints (does not assert) the SmolLM2 bf16 decode step time at ~128 tokens of context."""
    from rill.shared.model_files import resolve_model

    ctx = 128
    r = ModelRunner(str(resolve_model()), dtype="bfloat16", device="cpu", num_blocks=2048, block_size=16)
    per = -(-(ctx + 32) // 16)
    news = [NewRequestData(f"r{i}", prompt(i, ctx), GREEDY, list(range(i * per, (i + 1) * per)))
            for i in range(batch)]
    for c in range(0, batch, 16):
        chunk = news[c:c + 16]
        r.execute(StepPlan(step_id=0, new_requests=chunk, cached_request_ids=[], cached_new_block_ids=[],
                           scheduled_request_ids=[n.request_id for n in chunk],
                           num_scheduled_tokens=[ctx] * len(chunk)))
    ids = [n.request_id for n in news]
    times = []
    for step in range(12):
        res = r.execute(StepPlan(step_id=step + 1, new_requests=[], cached_request_ids=ids,
                                 cached_new_block_ids=[[] for _ in ids], scheduled_request_ids=ids,
                                 num_scheduled_tokens=[1] * batch))
        assert res.error is None
        times.append(res.forward_ms)
    med = sorted(times[2:])[len(times[2:]) // 2]
    print(f"\nSmolLM2 bf16 decode, batch {batch}, ctx ~{ctx}: {med:.1f} ms/step, {batch / med * 1e3:.0f} tok/s "
          f"({torch.get_num_threads()} threads)")
