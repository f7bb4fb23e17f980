"""Speculative decoding with n-gram prompt lookup: the proposer, the flag, the scheduler's
accounting, and a real model runner verifying drafts: greedy output unchanged, sampled output
distributed as without speculation, KV all free afterwards."""

from __future__ import annotations

import asyncio
import urllib.request

import msgspec
import openai
import pytest
import torch
from service_stack import fresh_stack, openai_client
from test_e2e import assert_same_or_near_tie, chat_ids, hf_greedy
from test_scheduler_engine import chat, drive, greedy, make_sched

from rill.services.scheduler.kv_cache_manager import KVCacheManager
from rill.services.scheduler.scheduler import Scheduler, SchedulerConfig
from rill.services.scheduler.speculation import Speculator, ngram_drafts
from rill.services.worker.model_runner import ModelRunner
from rill.shared.config import SpeculativeConfig
from rill.shared.request_params import SamplingParams
from rill.shared.schema import StepResult, TokenizedRequest

NEAR_TIE = 2e-3
# The e2e prompts, and two a prompt lookup should speed up (they repeat what they were given).
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle works to a ten year old, step by step.",
    "List ten fruits and describe the colour of each one.",
    "What are the main differences between Python and C? Answer in detail.",
    "Repeat after me, word for word: The rain in Spain stays mainly in the plain, and the sun in Rome shines "
    "mostly on the dome.",
    "Write the word 'hello' twenty times, separated by spaces.",
]


def spec(k: int = 3, n_max: int = 4, n_min: int = 2) -> Speculator:
    return Speculator(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=n_max, prompt_lookup_min=n_min))


# --------------------------------------------------------------------------------- proposer


def test_ngram_takes_the_longest_suffix_match_and_the_latest_occurrence() -> None:
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 2, 3]
    # suffix [2, 3] occurred at 1 and at 5: the latest (5) is followed by 7, 8, 5
    assert ngram_drafts(tokens, 3, 2, 4) == [7, 8, 5]
    assert ngram_drafts(tokens, 1, 2, 4) == [7]
    # a longer match wins over a later shorter one: [1, 2, 3] occurred only at 0
    assert ngram_drafts([*tokens[:-2], 1, 2, 3], 2, 2, 4) == [9, 9]
    assert ngram_drafts([4, 5, 6], 3, 1, 3) == []  # nothing repeats
    assert ngram_drafts([4, 5, 4], 3, 2, 3) == []  # only a 1-gram repeats and min is 2
    assert ngram_drafts([4, 5, 4], 3, 1, 3) == [5, 4]  # the drafts may run up to the suffix itself


def test_ngram_matches_whole_tokens_only() -> None:
    # 256 = bytes 00 01 00 00: a byte-level match straddling two tokens must not count
    tokens = [1, 256, 0, 7, 1, 0]
    assert ngram_drafts(tokens, 2, 2, 2) == []
    assert ngram_drafts([70000, 3, 70000, 3, 5, 70000, 3], 2, 2, 2) == [5, 70000]


@pytest.mark.parametrize("text, fault", [
    ('{"method": "eagle", "num_speculative_tokens": 3}', "eagle"),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', "needs model"),
    ('{"model": "d", "num_speculative_tokens": 3, "prompt_lookup_max": 3}', "prompt_lookup_max"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_mux": 4}', "prompt_lookup_mux"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
     "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}', "disable_by_batch_size"),
    ("[3]", "object"),
    ("ngram", "JSON"),
])
def test_bad_config_is_refused_by_name(text: str, fault: str) -> None:
    with pytest.raises(ValueError, match=fault):
        SpeculativeConfig.parse(text)


def test_config_defaults_follow_the_given_bound() -> None:
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 1}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (5, 1, 1)
    cfg = SpeculativeConfig.parse('{"model": "/models/draft", "num_speculative_tokens": 3}')  # vLLM's shorthand
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", "/models/draft", 3)


# ---------------------------------------------------------------------- scheduler accounting


def _request(rid: str, prompt: list[int], max_tokens: int = 20, **params) -> TokenizedRequest:
    return TokenizedRequest(request_id=rid, reply_to="r", prompt_token_ids=prompt,
                            params=SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),
                            eos_token_ids=[0], arrival_time=0.0)


def _step(sched: Scheduler, tokens: dict[str, list[int]]) -> None:
    plan = sched.schedule()
    assert plan is not None
    ids = [rid for rid in plan.scheduled_request_ids if rid in tokens]
    sched.update(StepResult(step_id=plan.step_id, request_ids=ids, token_ids=[t for r in ids for t in tokens[r]],
                            num_tokens=[len(tokens[r]) for r in ids]))
    sched.check_invariants()


def test_rejected_drafts_are_not_computed_and_blocks_all_come_back() -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(16, 4), spec(k=3))
    sched.add(_request("a", [5, 9, 1, 2, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]))
    _step(sched, {"a": [7]})  # the prompt; first token 7
    req = sched.requests["a"]
    plan = sched.schedule()  # ...8 5 6 7 occurred before, followed by 8 5 6
    assert plan.spec_token_ids == [[8, 5, 6]] and plan.num_scheduled_tokens == [4]
    assert not sched.may_plan_ahead(2)  # the next drafts come from this step's tokens
    # the worker accepted 8 and 5, then sampled 9 where the draft said 6
    sched.update(StepResult(step_id=plan.step_id, request_ids=["a"], token_ids=[8, 5, 9], num_tokens=[3]))
    assert req.output_token_ids == [7, 8, 5, 9]
    assert req.num_computed_tokens == 17  # prompt 14 + 7 8 5; the rejected draft's slot is not counted
    assert (sched.speculator.num_drafts, sched.speculator.num_draft_tokens, sched.speculator.num_accepted_tokens) \
        == (1, 3, 2)
    sched.check_invariants()
    # a stop token among the accepted drafts ends the request there: the rest is dropped
    plan = sched.schedule()  # "5 9" occurred at the start, followed by 1 2 5
    assert plan.spec_token_ids == [[1, 2, 5]]
    sched.update(StepResult(step_id=plan.step_id, request_ids=["a"], token_ids=[1, 0, 5, 6], num_tokens=[4]))
    assert req.output_token_ids == [7, 8, 5, 9, 1, 0]
    assert not sched.has_work and sched.kv.num_free_blocks == sched.kv.num_blocks


def test_drafts_respect_max_tokens_budget_and_free_blocks() -> None:
    prompt = [5, 6, 7, 8] * 4
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(64, 4), spec(k=8))
    sched.add(_request("a", prompt, max_tokens=4))
    _step(sched, {"a": [5]})
    plan = sched.schedule()
    assert len(plan.spec_token_ids[0]) == 2  # 1 out, 4 at most: this step may add 3 = last + 2 drafts
    # the budget caps them too (the last token counts)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=3), KVCacheManager(64, 4), spec(k=8))
    sched.add(_request("b", prompt))
    for _ in range(5):
        _step(sched, {})  # prompt chunks of 3
    _step(sched, {"b": [5]})  # its last prompt token, and the first output
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == [3] and len(plan.spec_token_ids[0]) == 2
    # drafts never take blocks another request would need: a full cache gets none
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(5, 4), spec(k=3))
    sched.add(_request("c", prompt, max_tokens=2))  # 16 prompt + 1: all 5 blocks, none free for drafts
    _step(sched, {"c": [5]})
    plan = sched.schedule()
    assert plan.spec_token_ids == [] and plan.num_scheduled_tokens == [1]


def test_no_drafts_while_the_batch_reaches_disable_by_batch_size() -> None:
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 2}')
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(64, 4), Speculator(cfg))
    prompt = [5, 6, 7, 8] * 3
    sched.add(_request("a", prompt))
    sched.add(_request("b", prompt))
    _step(sched, {"a": [5], "b": [5]})
    plan = sched.schedule()  # two running: plain decode rows, and the next plan may be built ahead
    assert plan.spec_token_ids == [] and plan.num_scheduled_tokens == [1, 1]
    assert sched.may_plan_ahead(2)
    sched.update(StepResult(step_id=plan.step_id, request_ids=["a", "b"], token_ids=[6, 0], num_tokens=[1, 1]))
    plan = sched.schedule()  # b stopped: one running, it speculates again
    assert plan.scheduled_request_ids == ["a"] and plan.spec_token_ids == [[7, 8, 5]]
    assert not sched.may_plan_ahead(2)


def test_penalties_and_grammars_are_speculated() -> None:
    """Requests with penalties or a grammar draft like any other (the worker takes each draft's
    position as if the drafts before it stood); a step of requests that may speculate is not
    planned ahead."""
    prompt = [5, 6, 7, 8] * 4
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(64, 4), spec())
    sched.add(_request("p", prompt, presence_penalty=0.5))
    sched.add(_request("g", prompt, grammar='start: "x"'))
    sched.add(_request("ok", prompt))
    _step(sched, {"p": [5], "g": [5], "ok": [5]})
    plan = sched.schedule()
    drafts = dict(zip(plan.scheduled_request_ids, plan.spec_token_ids, strict=True))
    assert drafts["p"] == drafts["g"] == drafts["ok"] == [6, 7, 8]
    assert not sched.may_plan_ahead(2)


# ------------------------------------------------------------------- with a real model


@pytest.fixture(scope="module")
def smol(smollm2_dir: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    runner = ModelRunner(smollm2_dir, dtype="float32", device="cpu", num_blocks=1024, block_size=8,
                         quantization="none")
    return tok, runner


def _assert_same_greedy(ref, ours, msgs) -> int:
    """Every output equals the reference, except after a near-tie of the reference's logits;
    returns how many are identical."""
    same = 0
    for m in msgs:
        a, b = ours.outputs[m.request_id], ref.outputs[m.request_id]
        if a == b:
            same += 1
            continue
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        gap = ref.gaps[m.request_id][k]
        assert gap < NEAR_TIE, f"{m.request_id} differs at token {k} where the top-2 gap is {gap:.3g}"
    return same


def test_greedy_output_is_unchanged(smol, smollm2_dir: str) -> None:
    tok, runner = smol
    msgs = [greedy(f"q{i}", chat(tok, p), 48) for i, p in enumerate(PROMPTS)]
    reference = drive(runner, make_sched(num_blocks=1024, block_size=8, budget=512), msgs)
    for depth in (1, 2):  # synchronous, then async scheduling
        speculator = spec(k=4, n_min=1)
        sched = make_sched(num_blocks=1024, block_size=8, budget=512, speculator=speculator)
        run = drive(runner, sched, msgs, depth=depth)
        assert _assert_same_greedy(reference, run, msgs) >= len(msgs) - 1
        if depth == 1:  # planned ahead, a request's last token is not known yet: no drafts
            assert speculator.num_accepted_tokens > 40, "prompt lookup never paid off"  # each saves a step
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
    # A cache too small for everyone: preemption and recomputation with drafts in the mix.
    small = ModelRunner(smollm2_dir, dtype="float32", device="cpu", num_blocks=24, block_size=8, model=runner.model)
    sched = make_sched(num_blocks=24, block_size=8, budget=64, speculator=spec(k=4, n_min=1))
    run = drive(small, sched, msgs)
    assert sched.counters.preemptions > 0
    assert _assert_same_greedy(reference, run, msgs) >= len(msgs) - 1
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def _two_sample_chi2(a: list[int], b: list[int], min_expected: float = 5.0) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of two samples having one distribution, rare
    values pooled into one bin."""
    values = sorted(set(a) | set(b))
    ca = {v: a.count(v) for v in values}
    cb = {v: b.count(v) for v in values}
    total_a, total_b = len(a), len(b)
    n = total_a + total_b
    bins: list[tuple[int, int]] = []
    rare = [0, 0]
    for v in values:
        if (ca[v] + cb[v]) * min(total_a, total_b) / n >= min_expected:
            bins.append((ca[v], cb[v]))
        else:
            rare[0] += ca[v]
            rare[1] += cb[v]
    if sum(rare):
        bins.append((rare[0], rare[1]))
    stat = 0.0
    for x, y in bins:
        col = x + y
        for obs, tot in ((x, total_a), (y, total_b)):
            exp = col * tot / n
            stat += (obs - exp) ** 2 / exp
    return stat, len(bins) - 1


def _prompt_cached(runner: ModelRunner, sched: Scheduler, prompt: list[int]) -> Scheduler:
    """The scheduler with the prompt's full blocks in its prefix cache (one request computed them):
    hundreds of samples of one prompt then compute its last partial block each, not all of it."""
    drive(runner, sched, [greedy("warm", prompt, 1)])
    return sched


def test_sampled_tokens_keep_their_distribution(smol) -> None:
    """The same prompt sampled 240 times with and without drafts (different seeds): at every
    output position the tokens pass a chi-square test of one distribution, and with the same
    seeds speculation picks the same tokens (its samples are the ones it would draw anyway)."""
    tok, runner = smol
    prompt = chat(tok, "Count from one to twenty in words, separated by commas.")

    def sampled(seed0: int, speculator: Speculator | None, n: int = 240):
        msgs = [TokenizedRequest(request_id=f"s{seed0 + i}", reply_to="none", prompt_token_ids=prompt,
                                 params=SamplingParams(temperature=0.8, top_p=0.95, max_tokens=10, seed=seed0 + i),
                                 eos_token_ids=[2], arrival_time=0.0) for i in range(n)]
        sched = make_sched(num_blocks=1024, block_size=8, budget=4096, max_seqs=256, speculator=speculator)
        run = drive(runner, _prompt_cached(runner, sched, prompt), msgs)
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
        return [run.outputs[m.request_id] for m in msgs]

    speculator = spec(k=3, n_min=1)
    with_spec = sampled(0, speculator)
    without = sampled(10_000, None)
    assert speculator.num_accepted_tokens > 100, "too few drafts accepted to test anything"
    for pos in range(1, 10):  # position 0 comes from the prompt step: never speculated
        a = [o[pos] for o in with_spec if len(o) > pos]
        b = [o[pos] for o in without if len(o) > pos]
        stat, dof = _two_sample_chi2(a, b)
        if dof == 0:
            continue
        p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                                torch.tensor(stat / 2, dtype=torch.float64)))
        assert p_value > 1e-3, f"position {pos}: chi2={stat:.1f} on {dof} dof, p={p_value:.2g}"
    same_seeds = sampled(10_000, spec(k=3, n_min=1))
    identical = sum(x == y for x, y in zip(same_seeds, without, strict=True))
    assert identical >= 0.95 * len(without), f"only {identical} of {len(without)} seeded samples identical"


def test_penalized_requests_speculate_as_they_would_sample_without(smol) -> None:
    """Penalties under speculation: each draft position counts the drafts before it as outputs
    (and the counts keep only what stood), so greedy outputs with presence, frequency or
    repetition penalties are unchanged, and seeded sampled ones are the very tokens drawn
    without speculation, while drafts are verified and accepted for them."""
    tok, runner = smol
    kinds = [dict(temperature=0.0, presence_penalty=0.6), dict(temperature=0.0, repetition_penalty=1.3),
             dict(temperature=0.0, frequency_penalty=0.5), dict(temperature=0.8, frequency_penalty=0.4, presence_penalty=0.3)]
    msgs = [TokenizedRequest(request_id=f"r{i}-{j}", reply_to="none", prompt_token_ids=chat(tok, p),
                             params=SamplingParams(max_tokens=32, seed=100 * i + j, **kind), eos_token_ids=[2],
                             arrival_time=0.0)
            for i, p in enumerate(PROMPTS[3:]) for j, kind in enumerate(kinds)]
    reference = drive(runner, make_sched(num_blocks=1024, block_size=8, budget=512), msgs)
    speculator = spec(k=4, n_min=1)
    sched = make_sched(num_blocks=1024, block_size=8, budget=512, speculator=speculator)
    run = drive(runner, sched, msgs)
    assert speculator.num_accepted_tokens > 10, "no drafts stood for the penalized requests"
    greedy_msgs = [m for m in msgs if m.params.temperature == 0]
    assert _assert_same_greedy(reference, run, greedy_msgs) >= len(greedy_msgs) - 1
    sampled = [m.request_id for m in msgs if m.params.temperature > 0]
    assert sum(run.outputs[r] == reference.outputs[r] for r in sampled) >= len(sampled) - 1
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


# ------------------------------------------------------------------------ the whole stack


@pytest.fixture(scope="module")
def spec_stack(redis_url: str, smollm2_dir: str):
    config = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'
    with fresh_stack(redis_url, smollm2_dir, "spec", ["--speculative-config", config, "--block-size", "8"]) as stack:
        yield stack


def test_served_greedy_matches_transformers_and_drafts_are_counted(spec_stack, smollm2_hf) -> None:
    """Over HTTP with --speculative-config: the e2e prompts' greedy text is transformers' own,
    a stop string inside accepted drafts still ends the text before it, n=2 sampling returns two
    choices, /metrics shows drafts accepted, and every KV block is free afterwards."""
    tok, model = smollm2_hf
    client = openai_client(spec_stack)
    model_id = client.models.list().data[0].id

    async def all_at_once() -> list:
        aclient = openai.AsyncOpenAI(base_url=f"{spec_stack.base_url}/v1", api_key="none", max_retries=0)
        try:
            return await asyncio.gather(*[aclient.chat.completions.create(
                model=model_id, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=40)
                for p in PROMPTS])
        finally:
            await aclient.close()

    for prompt, resp in zip(PROMPTS, asyncio.run(all_at_once()), strict=True):
        ids = chat_ids(tok, prompt)
        hf = hf_greedy(model, ids, resp.usage.completion_tokens)
        assert_same_or_near_tie(tok, model, ids, hf, resp.choices[0].message.content)

    hello = [{"role": "user", "content": PROMPTS[-1]}]
    full = client.chat.completions.create(model=model_id, messages=hello, temperature=0, max_tokens=30)
    text = full.choices[0].message.content
    words = text.split()
    assert len(words) > 6, text
    stop = " ".join(words[4:6])  # deep inside a run that drafts predict
    cut = client.chat.completions.create(model=model_id, messages=hello, temperature=0, max_tokens=30, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == text[:text.index(stop)]

    scored = client.chat.completions.create(model=model_id, messages=hello, temperature=0, max_tokens=30,
                                            logprobs=True, top_logprobs=2)
    assert scored.choices[0].message.content == text  # one logprob per token, accepted drafts included
    assert len(scored.choices[0].logprobs.content) == scored.usage.completion_tokens == full.usage.completion_tokens

    two = client.chat.completions.create(model=model_id, messages=hello, temperature=0.8, n=2, max_tokens=20, seed=3)
    assert len(two.choices) == 2 and all(c.message.content for c in two.choices)

    st = spec_stack.wait_idle()
    assert st.spec_num_accepted_tokens > 10 and st.spec_num_drafts > 0
    assert st.kv_usage == 0 and st.num_running == 0
    with urllib.request.urlopen(f"{spec_stack.base_url}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    accepted = [line for line in metrics.splitlines() if line.startswith("rill:spec_decode_num_accepted_tokens_total")]
    assert accepted and float(accepted[0].rsplit(" ", 1)[1]) == st.spec_num_accepted_tokens
    assert "rill:spec_decode_acceptance_rate{" in metrics and "rill:spec_decode_mean_accepted_length{" in metrics


# ------------------------------------------------------------------------------ draft model


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: str) -> str:
    """A tiny randomly initialised Llama with SmolLM2's vocabulary: a draft that is mostly wrong."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("draft")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def _draft_spec(path: str, k: int = 3) -> Speculator:
    return Speculator(SpeculativeConfig(num_speculative_tokens=k, method="draft_model", model=path))


@pytest.mark.parametrize("draft", ["itself", "random"])
def test_draft_model_greedy_output_is_unchanged(smol, smollm2_dir: str, random_draft: str, draft: str) -> None:
    """A draft as good as can be (the target itself) and a useless one (random weights): greedy
    output is the target's either way; acceptance follows the draft's quality."""
    tok, runner = smol
    path = smollm2_dir if draft == "itself" else random_draft
    drafted = ModelRunner(smollm2_dir, dtype="float32", device="cpu", num_blocks=256, block_size=8,
                          model=runner.model, draft_model=path)
    msgs = [greedy(f"q{i}", chat(tok, p), 24) for i, p in enumerate(PROMPTS[:4])]
    reference = drive(runner, make_sched(num_blocks=1024, block_size=8, budget=512), msgs)
    speculator = _draft_spec(path)
    sched = make_sched(num_blocks=256, block_size=8, budget=512, speculator=speculator)
    run = drive(drafted, sched, msgs)
    assert _assert_same_greedy(reference, run, msgs) >= len(msgs) - 1
    rate = speculator.num_accepted_tokens / speculator.num_draft_tokens
    assert rate > 0.9 if draft == "itself" else rate < 0.3, rate
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and not drafted.draft.seen
    if draft == "random":  # a cache too small for all four: preempted requests' draft KV starts over
        small = ModelRunner(smollm2_dir, dtype="float32", device="cpu", num_blocks=16, block_size=8,
                            model=runner.model, draft_model=path)
        sched = make_sched(num_blocks=16, block_size=8, budget=64, speculator=_draft_spec(path))
        run = drive(small, sched, msgs)
        assert sched.counters.preemptions > 0
        assert _assert_same_greedy(reference, run, msgs) >= len(msgs) - 1
        assert sched.kv.num_free_blocks == sched.kv.num_blocks and not small.draft.seen


def test_drafting_paused_by_batch_size_resumes_with_the_draft_caught_up(smol, smollm2_dir: str) -> None:
    """disable_by_batch_size 3 with four requests of different lengths: no drafts while three or
    more run, then drafts again, the draft model first computing the tokens it missed; greedy
    output is the target's throughout."""
    tok, runner = smol
    drafted = ModelRunner(smollm2_dir, dtype="float32", device="cpu", num_blocks=256, block_size=8,
                          model=runner.model, draft_model=smollm2_dir)
    # EOS ignored: the lengths, and so the batch sizes, as planned.
    msgs = [msgspec.structs.replace(m, params=msgspec.structs.replace(m.params, ignore_eos=True), eos_token_ids=[])
            for m in (greedy(f"q{i}", chat(tok, p), 8 + 8 * i) for i, p in enumerate(PROMPTS[:4]))]
    reference = drive(runner, make_sched(num_blocks=1024, block_size=8, budget=512), msgs)
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=3, method="draft_model", model=smollm2_dir,
                                              disable_by_batch_size=3))
    sched = make_sched(num_blocks=256, block_size=8, budget=512, speculator=speculator)
    run = drive(drafted, sched, msgs)
    assert _assert_same_greedy(reference, run, msgs) >= len(msgs) - 1
    # Only the two longest drafted, once the two shortest had ended (at 8 and 16 tokens): q2's last 8
    # and q3's last 16 tokens, 4 a step, about 6 drafting rows (about 20 without the limit).
    assert 0 < speculator.num_drafts <= 8, speculator.num_drafts
    assert speculator.num_accepted_tokens / speculator.num_draft_tokens > 0.9
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and not drafted.draft.seen


def test_sampled_drafts_from_the_target_itself_all_stand(smol, smollm2_dir: str) -> None:
    """Drafts drawn from q = p are accepted with probability min(1, p/q) = 1: sampled requests
    accept nearly every draft (a greedy draft would be accepted only with p(argmax))."""
    tok, runner = smol
    drafted = ModelRunner(smollm2_dir, dtype="float32", device="cpu", num_blocks=512, block_size=8,
                          model=runner.model, draft_model=smollm2_dir)
    msgs = [TokenizedRequest(request_id=f"t{i}", reply_to="none", prompt_token_ids=chat(tok, "Tell me a story."),
                             params=SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=i),
                             eos_token_ids=[2], arrival_time=0.0) for i in range(4)]
    speculator = _draft_spec(smollm2_dir)
    sched = make_sched(num_blocks=512, block_size=8, budget=512, speculator=speculator)
    drive(drafted, sched, msgs)
    assert speculator.num_accepted_tokens / speculator.num_draft_tokens > 0.9
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_distributions_are_what_the_sampler_draws_from() -> None:
    """Sampler.distributions (used by rejection sampling) against 20000 draws of the sampler
    itself, with top-k, top-p and min-p."""
    from rill.services.worker.sampler import Sampler, SampleRow

    torch.manual_seed(0)
    logits = torch.randn(1, 40) * 2
    sampler = Sampler("cpu", vocab_size=40)
    for params in (SamplingParams(temperature=0.7, top_k=12), SamplingParams(temperature=1.3, top_p=0.8),
                   SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.02)):
        want = sampler.distributions(logits, [SampleRow(params, 0)])[0]
        picks = sampler.sample(logits.expand(20000, 40), [SampleRow(params, 0)] * 20000)
        got = torch.bincount(torch.tensor(picks), minlength=40).float() / 20000
        assert (got - want).abs().max() < 0.015, (params, (got - want).abs().max())
        assert torch.all(got[want == 0] == 0)


def test_draft_model_sampling_keeps_the_distribution(smol, smollm2_dir: str, random_draft: str) -> None:
    """Mostly rejected drafts: the tokens drawn where a draft was refused still pass the
    chi-square test against sampling without speculation, with penalties too."""
    tok, runner = smol
    drafted = ModelRunner(smollm2_dir, dtype="float32", device="cpu", num_blocks=1024, block_size=8,
                          model=runner.model, draft_model=random_draft)
    prompt = chat(tok, "Name a colour.")

    def sampled(r: ModelRunner, seed0: int, speculator: Speculator | None, n: int = 200,
                **penalties: float) -> list[list[int]]:
        msgs = [TokenizedRequest(request_id=f"c{seed0 + i}", reply_to="none", prompt_token_ids=prompt,
                                 params=SamplingParams(temperature=1.0, max_tokens=4, seed=seed0 + i, **penalties),
                                 eos_token_ids=[2], arrival_time=0.0) for i in range(n)]
        sched = make_sched(num_blocks=1024, block_size=8, budget=4096, max_seqs=256, speculator=speculator)
        run = drive(r, _prompt_cached(r, sched, prompt), msgs)
        return [run.outputs[m.request_id] for m in msgs]

    # Plain, then with penalties (q drawn with them too, the drafts before each counted).
    for penalties in ({}, {"frequency_penalty": 0.8, "presence_penalty": 0.5}):
        speculator = _draft_spec(random_draft, k=2)
        with_draft = sampled(drafted, 0, speculator, **penalties)
        without = sampled(runner, 10_000, None, **penalties)
        assert speculator.num_draft_tokens > 200
        for pos in range(1, 4):
            a = [o[pos] for o in with_draft if len(o) > pos]
            b = [o[pos] for o in without if len(o) > pos]
            stat, dof = _two_sample_chi2(a, b)
            if dof:
                p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                                        torch.tensor(stat / 2, dtype=torch.float64)))
                assert p_value > 1e-3, f"{penalties} position {pos}: chi2={stat:.1f} on {dof} dof, p={p_value:.2g}"


def test_constrained_requests_speculate_with_per_draft_masks(smol) -> None:
    """A JSON-schema request decodes with drafts: each draft row masked by the grammar's state
    after the drafts before it, the output the same as without speculation and valid."""
    import json

    from rill.services.gateway.structured import _from_json

    tok, runner = smol
    schema = {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string"}, "maxItems": 6}},
              "required": ["fruits"], "additionalProperties": False}
    grammar = _from_json(schema, "response_format")
    prompt = chat(tok, "List six fruits as JSON: apple, apple, pear, pear, apple, pear.")
    msgs = [TokenizedRequest(request_id="j", reply_to="none", prompt_token_ids=prompt,
                             params=SamplingParams(temperature=0.0, max_tokens=60, grammar=grammar),
                             eos_token_ids=[2], arrival_time=0.0)]
    reference = drive(runner, make_sched(num_blocks=1024, block_size=8, budget=512), msgs)
    speculator = spec(k=4, n_min=1)
    run = drive(runner, make_sched(num_blocks=1024, block_size=8, budget=512, speculator=speculator), msgs)
    assert _assert_same_greedy(reference, run, msgs) == 1
    assert speculator.num_accepted_tokens > 0 and speculator.num_draft_tokens > speculator.num_accepted_tokens
    assert "fruits" in json.loads(tok.decode(run.outputs["j"], skip_special_tokens=True))


def test_a_draft_of_another_vocabulary_is_refused_at_start(tmp_path, smollm2_dir: str, random_draft: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from rill.services.cli import build_parser, engine_args

    other = tmp_path / "other-vocab"
    LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(other)
    flag = ["--speculative-config", '{"model": "%s", "num_speculative_tokens": 3}']
    with pytest.raises(SystemExit, match=r"draft model .*vocabulary \(1000 tokens\) is not the target's \(49152\)"):
        engine_args(build_parser().parse_args(["serve", smollm2_dir, flag[0], flag[1] % other]), smollm2_dir)
    ok = engine_args(build_parser().parse_args(["serve", smollm2_dir, flag[0], flag[1] % random_draft]), smollm2_dir)
    assert ok.speculative_config == flag[1] % random_draft  # the same vocabulary passes
