"""Predicted outputs (OpenAI's `prediction`): drafts from the predicted text wherever the output
stands in it, verified like any speculative draft, so the output never changes; the scheduler's
accounting of them, a real model's greedy output with exact, edited and useless predictions, and
the field through the whole stack with the official client."""

from __future__ import annotations

from array import array

import openai
import pytest
from test_scheduler_engine import chat, drive, greedy, make_sched

from rill.services.scheduler.kv_cache_manager import KVCacheManager
from rill.services.scheduler.scheduler import Scheduler, SchedulerConfig
from rill.services.scheduler.speculation import prediction_drafts
from rill.services.worker.model_runner import ModelRunner
from rill.shared.request_params import SamplingParams
from rill.shared.schema import StepPlan, StepResult, TokenizedRequest


def _drafts(output: list[int], prediction: list[int], at: int, k: int) -> tuple[list[int], int]:
    return prediction_drafts(output, array("i", prediction).tobytes(), at, k)


# --------------------------------------------------------------------------------- proposer


def test_drafts_follow_the_output_through_the_prediction() -> None:
    pred = [10, 11, 12, 13, 14, 15, 16, 17]
    assert _drafts([10], pred, 0, 3) == ([11, 12, 13], 1)
    assert _drafts([10, 11, 12], pred, 1, 3) == ([13, 14, 15], 3)
    assert _drafts([10, 11, 12, 13, 14, 15, 16], pred, 3, 5) == ([17], 7)  # the prediction runs out
    assert _drafts([10, 11, 99], pred, 3, 3) == ([], 3)  # an edit: nothing to go on
    assert _drafts([10, 11, 99, 14], pred, 3, 3) == ([], 3)  # one token is not enough to go back on
    assert _drafts([10, 11, 99, 14, 15], pred, 3, 3) == ([16, 17], 6)  # two are
    assert _drafts(pred, pred, 3, 3) == ([], 3)  # its last token: nothing follows


def test_the_longest_suffix_wins_then_the_position_reached() -> None:
    #       0  1  2  3  4  5  6
    pred = [1, 2, 3, 1, 2, 4, 5]
    assert _drafts([1, 2, 3, 1, 2], pred, 0, 2) == ([4, 5], 5)  # five tokens match only at 0
    assert _drafts([9, 1, 2], pred, 3, 2) == ([4, 5], 5)  # "1 2" twice: the one from where it was
    assert _drafts([9, 1, 2], pred, 0, 2) == ([3, 1], 2)
    # One token matches only as the first output token (from where the prediction starts).
    assert _drafts([1], pred, 0, 2) == ([2, 3], 1)
    assert _drafts([8, 4], pred, 5, 2) == ([], 5)


def test_drafts_match_whole_tokens_only() -> None:
    # 256 then 0 = bytes 00 01 00 00 00 00 00 00: token 1's bytes (01 00 00 00) straddle them, no match
    assert _drafts([1], [7, 256, 0, 9], 0, 2) == ([], 0)
    assert _drafts([256, 0], [7, 256, 0, 9], 0, 2) == ([9], 3)


# ---------------------------------------------------------------------- scheduler accounting


def _predicted(rid: str, prompt: list[int], prediction: list[int], max_tokens: int = 20,
               eos: int = 0) -> TokenizedRequest:
    return TokenizedRequest(request_id=rid, reply_to="r", prompt_token_ids=prompt, eos_token_ids=[eos],
                            params=SamplingParams(temperature=0.0, max_tokens=max_tokens, prediction_ids=prediction),
                            arrival_time=0.0)


def test_an_engine_without_speculation_drafts_from_a_prediction_and_counts_them() -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(64, 4))  # no speculator
    sched.add(_predicted("a", [5, 6, 7], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]))
    sched.add(TokenizedRequest(request_id="b", reply_to="r", prompt_token_ids=[5, 6, 7], eos_token_ids=[0],
                               params=SamplingParams(temperature=0.0, max_tokens=20), arrival_time=0.0))
    plan = sched.schedule()
    sched.update(StepResult(step_id=plan.step_id, request_ids=["a", "b"], token_ids=[20, 20]))
    plan = sched.schedule()
    drafts = dict(zip(plan.scheduled_request_ids, plan.spec_token_ids, strict=True))
    assert drafts == {"a": [21, 22, 23, 24, 25, 26, 27, 28], "b": []}
    assert not sched.may_plan_ahead(2)  # a's next drafts come from this step's tokens
    # the worker kept 21 22 23, then sampled 40 where the prediction said 24
    out = sched.update(StepResult(step_id=plan.step_id, request_ids=["a", "b"], token_ids=[21, 22, 23, 40, 21],
                                  num_tokens=[4, 1]))
    a = sched.requests["a"]
    assert a.output_token_ids == [20, 21, 22, 23, 40]
    assert (a.num_prediction_drafts, a.num_prediction_accepted) == (8, 3)
    assert a.num_computed_tokens == 3 + 4  # the rejected drafts' slots are not counted
    rows = dict(zip(out.detok.request_ids, out.detok.prediction_tokens, strict=True))
    assert rows == {"a": [3, 5], "b": []}
    sched.check_invariants()
    for token in (25, 26):  # 40 is nowhere in the prediction, "40 25" neither: no drafts
        plan = sched.schedule()
        assert not any(plan.spec_token_ids) and plan.num_scheduled_tokens[0] == 1
        assert sched.may_plan_ahead(2)  # nothing to draft from: the next step may go ahead
        sched.update(StepResult(step_id=plan.step_id, request_ids=["a"], token_ids=[token]))
    plan = sched.schedule()  # back on the prediction: "25 26" is followed by 27...; as many as stood last
    assert plan.spec_token_ids[0] == [27, 28, 29] and not sched.may_plan_ahead(2)
    sched.update(StepResult(step_id=plan.step_id, request_ids=["a"], token_ids=[27, 28, 29, 30], num_tokens=[4]))
    plan = sched.schedule()  # all stood: twice as many
    assert plan.spec_token_ids[0] == [31] and a.prediction_width == 6  # the prediction ends there


def test_an_output_off_its_prediction_lets_steps_be_planned_ahead() -> None:
    """A search that finds no draft lets the next 1, 2, 4 ... steps be planned ahead of their
    tokens (async scheduling kept), then the request searches again, and drafts as soon as its
    output is back on the prediction."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(64, 4))
    sched.add(_predicted("a", [5, 6, 7], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29], max_tokens=30))

    def step(plan: StepPlan, token: int) -> None:
        sched.update(StepResult(step_id=plan.step_id, request_ids=["a"], token_ids=[token]))

    step(sched.schedule(), 99)  # the prompt
    s1 = sched.schedule()  # "99" is not in the prediction: one step may go ahead
    assert not any(s1.spec_token_ids) and sched.may_plan_ahead(2)
    s2 = sched.schedule()  # ahead of 99's next token: nothing searched
    assert not any(s2.spec_token_ids) and not sched.may_plan_ahead(2)
    step(s1, 98)
    assert not sched.may_plan_ahead(2)  # the pause is over: s3 searches from s2's token
    step(s2, 97)
    s3 = sched.schedule()  # "98 97" is not either: two steps
    assert not any(s3.spec_token_ids) and sched.may_plan_ahead(2)
    s4 = sched.schedule()
    step(s3, 20)
    assert sched.may_plan_ahead(2)
    s5 = sched.schedule()
    step(s4, 21)
    assert not sched.may_plan_ahead(2)
    step(s5, 22)
    s6 = sched.schedule()  # "20 21 22" is: drafts, and no step ahead of them
    assert s6.spec_token_ids == [[23, 24, 25, 26, 27, 28, 29]] and not sched.may_plan_ahead(2)
    sched.check_invariants()
    # Off it for good (stepped without going ahead): the pause doubles up to PREDICTION_PAUSE.
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(64, 4))
    sched.add(_predicted("a", [5, 6, 7], [20, 21, 22], max_tokens=30))
    step(sched.schedule(), 90)
    pauses = []
    for token in range(91, 98):
        step(sched.schedule(), token)
        pauses.append(sched.requests["a"].prediction_pause)
    assert pauses == [1, 2, 4, 8, 16, 16, 16]


@pytest.mark.parametrize("agreeing", [0, 8, 12])
def test_drafts_keep_a_step_within_the_rows_that_agree(agreeing: int) -> None:
    """Where the worker's decode steps of up to `agreeing` rows give each row its bits alone, a
    step's drafts stop at that many rows, so they verify on decoding's bits; 0: no bound, nor
    where it would not hold one request's widest verify step (8 drafts and its token)."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, agreeing_rows=agreeing), KVCacheManager(64, 4))
    prediction = list(range(20, 40))
    for rid in "abc":
        sched.add(_predicted(rid, [5, 6, 7], prediction))
    plan = sched.schedule()
    sched.update(StepResult(step_id=plan.step_id, request_ids=list("abc"), token_ids=[20, 20, 20]))
    plan = sched.schedule()
    if agreeing > 9:  # a takes 1 + 8, b what is left of 12 but one row for c, c none
        assert [len(d) for d in plan.spec_token_ids] == [8, 1, 0] and sum(plan.num_scheduled_tokens) == agreeing
    else:
        assert [len(d) for d in plan.spec_token_ids] == [8, 8, 8]


def test_a_tensor_parallel_engine_refuses_a_prediction_by_name() -> None:
    sched = Scheduler(SchedulerConfig(verifies_drafts=False), KVCacheManager(64, 4))
    why = sched.check_admissible(_predicted("a", [5, 6, 7], [1, 2, 3]))
    assert why is not None and why.param == "prediction"
    assert sched.check_admissible(_predicted("a", [5, 6, 7], [])) is None


# ------------------------------------------------------------------- with a real model


@pytest.fixture(scope="module")
def smol(smollm2_dir: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return tok, ModelRunner(smollm2_dir, dtype="float32", device="cpu", num_blocks=1024, block_size=8)


def test_greedy_output_is_the_same_whatever_the_prediction(smol) -> None:
    """The reference output as the prediction: most of it is accepted, in far fewer steps; the
    output with a few words changed, or unrelated text: the very same output, fewer drafts kept."""
    tok, runner = smol
    prompts = ["Write a Python function that returns the squares of a list of numbers.",
               "Explain how a bicycle works to a ten year old, step by step."]
    plain = [greedy(f"q{i}", chat(tok, p), 48) for i, p in enumerate(prompts)]
    reference = drive(runner, make_sched(num_blocks=1024, block_size=8, budget=512), plain)
    other = tok.encode("The quick brown fox jumps over the lazy dog. " * 4, add_special_tokens=False)
    for kind in ("exact", "edited", "unrelated"):
        msgs = []
        for m in plain:
            out = list(reference.outputs[m.request_id])
            prediction = {"exact": out, "unrelated": other,
                          "edited": out[:10] + [tok.encode(" banana")[0]] * 3 + out[14:]}[kind]
            msgs.append(_predicted(m.request_id, m.prompt_token_ids, prediction, max_tokens=48, eos=2))
        sched = make_sched(num_blocks=1024, block_size=8, budget=512)
        run = drive(runner, sched, msgs)
        for m in msgs:
            assert run.outputs[m.request_id] == reference.outputs[m.request_id], (kind, m.request_id)
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
        if kind == "exact":  # all but the first token (from the prompt's step) can be drafts
            assert len(run.plans) < len(reference.plans) / 3, (len(run.plans), len(reference.plans))


# ------------------------------------------------------------------------ the whole stack


def test_prediction_through_the_stack(client: openai.OpenAI, mid: str) -> None:
    """Chat and completions with the official client: the same text with and without a
    prediction, streamed alike, usage counting the prediction's tokens; a bad one is a 400."""
    msgs = [{"role": "user", "content": "Write a haiku about the sea, then explain it in two sentences."}]
    plain = client.chat.completions.create(model=mid, messages=msgs, temperature=0, max_tokens=60)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None  # no prediction: nothing to count
    edited = text.replace("sea", "ocean", 1) if "sea" in text else "An opening line. " + text
    for prediction in (text, edited, [{"type": "text", "text": text[:20]}, {"type": "text", "text": text[20:]}]):
        got = client.chat.completions.create(model=mid, messages=msgs, temperature=0, max_tokens=60,
                                             prediction={"type": "content", "content": prediction})
        assert got.choices[0].message.content == text
        details = got.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0.5 * got.usage.completion_tokens, details
        assert details.accepted_prediction_tokens + 1 <= got.usage.completion_tokens
    chunks = list(client.chat.completions.create(
        model=mid, messages=msgs, temperature=0, max_tokens=60, stream=True, stream_options={"include_usage": True},
        prediction={"type": "content", "content": text}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0
    nothing = client.chat.completions.create(model=mid, messages=msgs, temperature=0, max_tokens=60,
                                             prediction={"type": "content", "content": "zebra " * 50})
    assert nothing.choices[0].message.content == text
    assert nothing.usage.completion_tokens_details.accepted_prediction_tokens < 5

    done = client.completions.create(model=mid, prompt="def add(a, b):\n", temperature=0, max_tokens=30)
    again = client.completions.create(model=mid, prompt="def add(a, b):\n", temperature=0, max_tokens=30,
                                      extra_body={"prediction": {"type": "content", "content": done.choices[0].text}})
    assert again.choices[0].text == done.choices[0].text
    assert again.usage.completion_tokens_details.accepted_prediction_tokens > 0

    for bad, fault in (({"type": "tokens", "content": "x"}, "prediction.type"),
                       ({"type": "content"}, "prediction.content"),
                       ({"type": "content", "content": []}, "prediction.content"),
                       ({"type": "content", "content": [{"type": "text", "text": "x" * 600_000}] * 2}, "prediction")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=mid, messages=msgs, max_tokens=5, prediction=bad)
        assert err.value.body["param"] == fault
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=mid, messages=msgs, max_tokens=5, n=2,
                                       extra_body={"use_beam_search": True},
                                       prediction={"type": "content", "content": text})
    assert err.value.body["param"] == "prediction"
