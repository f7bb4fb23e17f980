"""The scheduler driving a real model runner in-process (no broker): its decisions must never
change what greedy decoding produces, and its chunking and prefix caching must do what they say."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
import torch

from rill.services.scheduler.kv_cache_manager import KVCacheManager
from rill.services.scheduler.scheduler import Scheduler, SchedulerConfig
from rill.services.scheduler.speculation import Speculator
from rill.services.worker.model_runner import ModelRunner
from rill.shared.request_params import SamplingParams
from rill.shared.schema import StepPlan, TokenizedRequest

NEAR_TIE = 2e-3


@dataclass
class Run:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    gaps: dict[str, list[float]] = field(default_factory=dict)  # top-2 logit gap at each output position
    plans: list[StepPlan] = field(default_factory=list)
    decode_rows: list[set[str]] = field(default_factory=list)  # requests decoding in each step


def drive(runner: ModelRunner, sched: Scheduler, msgs: list[TokenizedRequest], max_steps: int = 5000,
          depth: int = 1) -> Run:
    """Run to completion with up to `depth` plans in flight (2 = the service's async scheduling:
    each plan is built before the previous step's result is applied)."""
    run = Run()
    for m in msgs:
        assert sched.check_admissible(m) is None
        sched.add(m)
    queue: deque[StepPlan] = deque()
    for _ in range(max_steps):
        while len(queue) < depth and (plan := sched.schedule()) is not None:
            queue.append(plan)
            run.plans.append(plan)
            run.decode_rows.append({  # one token past the prompt: a decode row
                rid for rid, n in zip(plan.scheduled_request_ids, plan.num_scheduled_tokens, strict=True)
                if n == 1 and sched.requests[rid].num_planned_tokens > len(sched.requests[rid].prompt_token_ids)})
        if not queue:
            break
        result = runner.execute(queue.popleft())
        assert result.error is None, result.error
        gaps: dict[str, list[float]] = {}  # per returned token (several with speculative drafts)
        if runner.last_logits is not None and result.request_ids:
            top2 = torch.topk(runner.last_logits.float(), 2, dim=-1).values
            per_token = (top2[:, 0] - top2[:, 1]).tolist()
            at = 0
            for rid, k in zip(result.request_ids, result.num_tokens or [1] * len(result.request_ids), strict=True):
                gaps[rid], at = per_token[at:at + k], at + k
        detok = sched.update(result).detok
        for rid, new in zip(detok.request_ids, detok.new_token_ids, strict=True) if detok else ():
            run.outputs.setdefault(rid, []).extend(new)  # what reaches clients, not what the worker ran
            run.gaps.setdefault(rid, []).extend(gaps[rid][:len(new)])
    assert not sched.has_work, "engine did not drain"
    assert not runner.requests, "the worker still holds requests"
    return run


def make_sched(num_blocks: int, block_size: int, budget: int, max_seqs: int = 64, caching: bool = True,
               max_model_len: int = 8192, threshold: int = 0, speculator: Speculator | None = None) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                                     long_prefill_token_threshold=threshold),
                     KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching), speculator)


def greedy(rid: str, ids: list[int], max_tokens: int) -> TokenizedRequest:
    return TokenizedRequest(request_id=rid, reply_to="none", prompt_token_ids=ids,
                            params=SamplingParams(temperature=0.0, max_tokens=max_tokens), eos_token_ids=[2],
                            arrival_time=0.0)


@pytest.fixture(scope="module")
def smol(smollm2_dir: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    runner = ModelRunner(smollm2_dir, dtype="float32", device="cpu", num_blocks=1024, block_size=8)
    return tok, runner


def chat(tok, text: str) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_preemption_and_chunking_do_not_change_greedy_outputs(smol, smollm2_dir: str) -> None:
    tok, big = smol
    topics = ["rivers", "owls", "glass", "tea", "maps", "clocks", "salt", "bees"]
    msgs = [greedy(f"q{i}", chat(tok, f"Tell me {'one fact' if i % 2 else 'two facts'} about {topics[i % 8]}."
                                     + " Please." * (i % 4)), 10 + (i * 5) % 13) for i in range(32)]
    # Reference: everything fits, nothing is chunked, nothing is reused.
    reference = drive(big, make_sched(num_blocks=1024, block_size=8, budget=8192, caching=False), msgs)

    small = ModelRunner(smollm2_dir, dtype="float32", device="cpu", num_blocks=48, block_size=8, model=big.model)
    # Synchronous, then async scheduling (each plan built while the previous step runs).
    for depth in (1, 2):
        sched = make_sched(num_blocks=48, block_size=8, budget=96)
        tight = drive(small, sched, msgs, depth=depth)
        assert sched.counters.preemptions > 0, "the small cache never preempted"
        chunked = any(m.num_computed_tokens + n < len(m.token_ids) for p in tight.plans for m in p.new_requests
                      for rid, n in zip(p.scheduled_request_ids, p.num_scheduled_tokens, strict=True)
                      if rid == m.request_id)
        assert chunked, "no prompt was chunked"
        for m in msgs:
            ours, ref = tight.outputs[m.request_id], reference.outputs[m.request_id]
            if ours != ref:
                k = next(i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b)
                gap = reference.gaps[m.request_id][k]
                assert gap < NEAR_TIE, f"{m.request_id} differs at token {k} where the top-2 gap is {gap:.3g}"
        assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_shared_system_prompt_computes_only_new_tokens(smol, smollm2_dir: str) -> None:
    tok, _ = smol
    runner = ModelRunner(smollm2_dir, dtype="float32", device="cpu", num_blocks=256, block_size=16,
                         model=smol[1].model)
    system = ("You are a meticulous assistant. " * 100)[:3000]

    def with_system(q: str) -> list[int]:
        out = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                      add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    a, b = with_system("Name a colour."), with_system("Name an animal, please.")
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert common >= 512

    cached_sched = make_sched(num_blocks=256, block_size=16, budget=2048)
    first = drive(runner, cached_sched, [greedy("a", a, 8)])
    second = drive(runner, cached_sched, [greedy("b", b, 8)])
    computed_b = second.plans[0].num_scheduled_tokens[0]
    assert computed_b == len(b) - (common // 16) * 16, "the cached prefix was computed again"
    assert cached_sched.kv.hits == (common // 16) * 16

    cold = drive(runner, make_sched(num_blocks=256, block_size=16, budget=2048, caching=False), [greedy("b", b, 8)])
    assert cold.plans[0].num_scheduled_tokens[0] == len(b)
    assert second.outputs["b"] == cold.outputs["b"] or min(cold.gaps["b"]) < NEAR_TIE
    assert first.outputs["a"]


def test_long_prompt_never_stalls_decodes(tmp_path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    runner = ModelRunner(str(tmp_path), dtype="float32", device="cpu", num_blocks=600, block_size=16)
    sched = make_sched(num_blocks=600, block_size=16, budget=512, max_model_len=8192)
    decoders = [greedy(f"d{i}", [3 + i, 4, 5, 6], 40) for i in range(8)]
    for m in decoders:
        sched.add(m)
    # Let the 8 streams reach decode, then a 4k-token prompt arrives.
    for _ in range(2):
        plan = sched.schedule()
        sched.update(runner.execute(plan))
    long = TokenizedRequest(request_id="long", reply_to="none", prompt_token_ids=[7 + (i % 100) for i in range(4096)],
                            params=SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                            eos_token_ids=[2], arrival_time=0.0)
    run = drive(runner, sched, [long])
    long_steps = [p for p in run.plans if "long" in p.scheduled_request_ids]
    assert len(long_steps) >= 4096 // 512, "the long prompt was not chunked"
    streams = {m.request_id for m in decoders}
    for plan in run.plans:
        assert sum(plan.num_scheduled_tokens) <= 512, "a step went over the token budget"
    # Every stream decodes in every step of the long prefill (they outlive it: 40 tokens each).
    for plan, decodes in zip(run.plans, run.decode_rows, strict=True):
        if plan in long_steps[:-1]:
            assert decodes >= streams, f"step {plan.step_id} left decode streams out: {streams - decodes}"


def test_parallel_samples_share_prompt_blocks(smol, smollm2_dir: str) -> None:
    tok, _ = smol
    runner = ModelRunner(smollm2_dir, dtype="float32", device="cpu", num_blocks=128, block_size=8,
                         model=smol[1].model)
    for caching in (True, False):
        sched = make_sched(num_blocks=128, block_size=8, budget=1024, caching=caching)
        ids = chat(tok, "Invent a name for a cat.")
        msg = TokenizedRequest(request_id="p", reply_to="none", prompt_token_ids=ids,
                               params=SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=7),
                               eos_token_ids=[2], arrival_time=0.0)
        sched.add(msg)
        plan = sched.schedule()
        assert plan.scheduled_request_ids == ["p:0"]  # the others wait for the prompt's KV
        sched.update(runner.execute(plan))
        plan = sched.schedule()
        shared = (len(ids) - 1) // 8
        tables = {rid: sched.kv.block_ids(rid) for rid in ("p:0", "p:1", "p:2")}
        assert tables["p:1"][:shared] == tables["p:0"][:shared] == tables["p:2"][:shared]
        assert all(sched.kv.ref_cnt[b] == 3 for b in tables["p:0"][:shared])
        assert len(set(tables["p:1"][shared:]) & set(tables["p:2"][shared:])) == 0  # diverging tails are private
        for rid, n in zip(plan.scheduled_request_ids, plan.num_scheduled_tokens, strict=True):
            if rid != "p:0":
                assert n == len(ids) - shared * 8  # only the unshared tail is computed
        sched.update(runner.execute(plan))
        while sched.has_work:
            sched.update(runner.execute(sched.schedule()))
        assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_preempted_constrained_requests_resume_and_validate(smol, smollm2_dir: str) -> None:
    """Requests under a JSON schema, preempted (their worker state dropped and rebuilt from the
    tokens so far) under synchronous and async scheduling: every output still validates."""
    import json

    import jsonschema

    from rill.services.gateway.structured import _from_json

    tok, big = smol
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "rank", "tags"],
              "properties": {"city": {"type": "string", "maxLength": 14},
                             "rank": {"type": "integer", "minimum": 1, "maximum": 50},
                             "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["old", "big", "wet"]}}}}
    grammar = _from_json(schema, "schema")
    msgs = [TokenizedRequest(request_id=f"j{i}", reply_to="none",
                             prompt_token_ids=chat(tok, f"Describe city number {i} as JSON." + " Please." * (i % 3)),
                             params=SamplingParams(temperature=1.0, seed=i, max_tokens=80, grammar=grammar),
                             eos_token_ids=[2], arrival_time=0.0) for i in range(8)]
    small = ModelRunner(smollm2_dir, dtype="float32", device="cpu", num_blocks=28, block_size=8, model=big.model)
    for depth in (1, 2):
        sched = make_sched(num_blocks=28, block_size=8, budget=96)
        run = drive(small, sched, msgs, depth=depth)
        assert sched.counters.preemptions > 0, "the small cache never preempted"
        for m in msgs:
            out = run.outputs[m.request_id]
            assert out[-1] == 2, (m.request_id, tok.decode(out))  # ended by the grammar, not max_tokens
            jsonschema.validate(json.loads(tok.decode(out, skip_special_tokens=True)), schema)
