"""The worker's logits processing (logit_bias, min_tokens and bad-word bans, repetition/frequency/presence
penalties, min_p), logprobs and seeded sampling, against plain per-row torch references, and
through the ModelRunner with a tiny random Llama (preemption and resume included)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from test_worker_runner import BLOCK, NUM_BLOCKS, HandScheduler, prompt

from rill.services.worker.model_runner import ModelRunner
from rill.services.worker.sampler import Sampler, SampleRow, bad_word_tail, check_params
from rill.shared.request_params import SamplingParams

EOS = [2]

# ---------------------------------------------------------------------------------------------
# The reference: the same math, one row and one token at a time.


def ref_process(raw: torch.Tensor, p: SamplingParams, prompt_ids: list[int], outputs: list[int]) -> torch.Tensor:
    x = raw.clone()
    vocab = x.shape[0]
    if p.allowed_token_ids:
        x = torch.full_like(x, float("-inf"))
        for tok in p.allowed_token_ids:
            if 0 <= tok < vocab:
                x[tok] = raw[tok]
    for tok, bias in p.logit_bias.items():
        if 0 <= tok < vocab:
            x[tok] += bias
    if len(outputs) < p.min_tokens:
        for tok in EOS + p.stop_token_ids:
            x[tok] = float("-inf")
    for word in p.bad_word_ids:  # banned where the output ends with the word's other tokens
        if word[-1] < vocab and len(outputs) >= len(word) - 1 and outputs[len(outputs) - len(word) + 1:] == word[:-1]:
            x[word[-1]] = float("-inf")
    if p.repetition_penalty != 1.0:
        for tok in set(prompt_ids) | set(outputs):
            x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    for tok in set(outputs):
        x[tok] -= p.frequency_penalty * outputs.count(tok) + p.presence_penalty
    return x


def ref_probs(processed: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    probs = torch.softmax(processed / p.temperature, dim=-1)
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs


@dataclass
class Req:
    params: SamplingParams
    prompt: list[int]
    outputs: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    slot: int | None = None

    def row(self) -> SampleRow:
        return SampleRow(self.params, len(self.outputs), self.generator, self.slot,
                         recent=bad_word_tail(self.params, self.prompt + self.outputs, len(self.prompt)))


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    """Each feature on in about half the rows, so batches mix rows with and without it."""
    def maybe(value, default):
        return value if rng.random() < 0.5 else default

    bias = {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(rng.randint(1, 4))}
    bias[vocab + 3] = 50.0  # outside the vocabulary: ignored
    # Bad words over the narrow range outputs come from (make_batch), so their prefixes do occur.
    narrow = min(vocab, 40)
    bad = [[rng.randrange(narrow) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(1, 8))]
    return SamplingParams(
        temperature=rng.choice([0.0, 0.6, 1.3]), top_k=maybe(rng.choice([3, 20]), 0),
        top_p=maybe(rng.choice([0.5, 0.9]), 1.0), min_p=maybe(rng.choice([0.05, 0.3]), 0.0),
        repetition_penalty=maybe(rng.choice([0.7, 1.4]), 1.0),
        frequency_penalty=maybe(rng.uniform(-2, 2), 0.0), presence_penalty=maybe(rng.uniform(-2, 2), 0.0),
        logit_bias=maybe(bias, {}), min_tokens=maybe(rng.randint(1, 4), 0),
        stop_token_ids=maybe([rng.randrange(vocab)], []), logprobs=maybe(rng.choice([0, 1, 5]), None),
        allowed_token_ids=maybe([*rng.sample(range(vocab), min(vocab, rng.randint(3, 30))), vocab + 5], []),
        bad_word_ids=maybe([*bad, [vocab + 2]], []), seed=maybe(rng.randrange(1 << 30), None))


def make_batch(rng: random.Random, sampler: Sampler, vocab: int, size: int) -> list[Req]:
    reqs = []
    for i in range(size):
        # Token ids from a narrow range so prompts and outputs repeat tokens (counts > 1).
        prompt_ids = [rng.randrange(min(vocab, 40)) for _ in range(rng.randint(1, 12))]
        outputs = [rng.randrange(min(vocab, 40)) for _ in range(rng.randint(0, 10))]
        # Every fourth row plain, so every batch of 4+ mixes rows with and without the features.
        p = SamplingParams(temperature=rng.choice([0.0, 1.0])) if i % 4 == 3 else random_params(rng, vocab)
        req = Req(p, prompt_ids, outputs, sampler.make_generator(p))
        req.slot = sampler.track(p, prompt_ids, outputs)
        reqs.append(req)
    return reqs


def logits_for(seed: int, rows: int, vocab: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize(("vocab", "size"), [(50, 1), (97, 7), (300, 16), (3000, 5)])
def test_processing_matches_reference_over_steps(vocab: int, size: int) -> None:
    """process() equals the reference every step, and the history follows the sampled tokens;
    greedy rows pick the reference argmax; the raw logits are never written."""
    rng = random.Random(vocab * 31 + size)
    sampler = Sampler(eos_token_ids=EOS, seed=3, vocab_size=vocab)
    reqs = make_batch(rng, sampler, vocab, size)
    for step in range(6):
        raw = logits_for(step * 100 + size, size, vocab)
        before = raw.clone()
        rows = [r.row() for r in reqs]
        want = torch.stack([ref_process(raw[i], r.params, r.prompt, r.outputs) for i, r in enumerate(reqs)])
        got = sampler.process(raw, rows)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        out = sampler.sample_batch(raw, rows)
        assert torch.equal(raw, before)
        for i, r in enumerate(reqs):
            tok = out.token_ids[i]
            if r.params.temperature == 0:
                assert tok == int(want[i].argmax()), (step, i)
            else:
                assert ref_probs(want[i], r.params)[tok] > 0, (step, i)
            r.outputs.append(tok)


def test_rows_without_features_are_left_alone() -> None:
    sampler = Sampler(eos_token_ids=EOS, vocab_size=64)
    raw = logits_for(1, 4, 64)
    rows = [SampleRow(SamplingParams(temperature=t), 5) for t in (0.0, 1.0, 0.5, 0.0)]
    assert sampler.process(raw, rows) is raw  # nothing to do, nothing copied
    out = sampler.sample_batch(raw, rows)
    assert out.logprobs == []
    assert out.token_ids[0] == int(raw[0].argmax()) and out.token_ids[3] == int(raw[3].argmax())


def test_bad_words_ban_the_token_that_completes_one() -> None:
    """A one-token word is never sampled; a longer word's last token only right after its others
    in the output (the prompt does not count, drafts do)."""
    sampler = Sampler(vocab_size=8)
    raw = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 2.0, 1.0]])  # greedy order 5, 6, 7
    p = SamplingParams(temperature=0.0, bad_word_ids=[[1, 2, 5], [6]])

    def pick(prompt_ids: list[int], outputs: list[int], drafted: tuple[int, ...] = ()) -> int:
        tail = bad_word_tail(p, prompt_ids + outputs, len(prompt_ids))
        return sampler.sample(raw, [SampleRow(p, len(outputs), drafted=drafted, recent=tail)])[0]

    assert pick([0], [1, 2]) == 7  # 5 completes [1, 2, 5]; 6 is always banned
    assert pick([0, 1], [2]) == 5  # the prompt's 1 is not the word's start
    assert pick([0], [1]) == 5 and pick([0], [1, 2, 3]) == 5 and pick([0], [2, 1]) == 5
    assert pick([0], [1], drafted=(2,)) == 7 and pick([3], [2, 1, 2]) == 7


def test_penalties_change_greedy_picks() -> None:
    sampler = Sampler(vocab_size=5)
    raw = torch.tensor([[4.0, 3.9, -1.0, -1.2, 0.0]] * 3)
    reqs = [SamplingParams(temperature=0.0, repetition_penalty=1.2),
            SamplingParams(temperature=0.0, frequency_penalty=0.2),  # 2 occurrences: -0.4
            SamplingParams(temperature=0.0, presence_penalty=0.2, logit_bias={3: 5.5})]
    rows = [SampleRow(p, 2, None, sampler.track(p, [0], [0, 0])) for p in reqs]
    assert sampler.sample(raw, rows) == [1, 1, 3]
    # Negative logits are multiplied: token 2 in the prompt drops further below token 3.
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    row = SampleRow(p, 0, None, sampler.track(p, [2], []))
    assert sampler.process(torch.tensor([[-1.0, -5.0, -1.5, -1.75, -3.0]]), [row]).tolist() == \
        [[-1.0, -5.0, -3.0, -1.75, -3.0]]


def test_a_speculated_row_counts_its_drafts_as_outputs() -> None:
    """A draft position's penalties read the request's outputs plus the drafts before it, exactly
    as if they had been sampled; rows that do not record leave the history as it was."""
    vocab = 12
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25)
    raw = logits_for(3, 3, vocab)
    ours, theirs = Sampler(vocab_size=vocab), Sampler(vocab_size=vocab)
    slot = ours.track(params, [1, 2, 3], [4, 5])
    drafts = (5, 6, 6)
    rows = [SampleRow(params, 2 + j, None, slot, drafts[:j], record=False) for j in range(3)]
    got = ours.process(raw, rows)
    for j in range(3):
        ref = SampleRow(params, 2 + j, None, theirs.track(params, [1, 2, 3], [4, 5, *drafts[:j]]))
        assert torch.equal(got[j], theirs.process(raw[j:j + 1], [ref])[0]), j
    before = ours.history.counts.clone()
    ours.sample_batch(raw, rows)
    assert torch.equal(ours.history.counts, before)


def test_min_p_distribution_matches_reference() -> None:
    rng = random.Random(5)
    vocab = 200
    sampler = Sampler(seed=4, vocab_size=vocab)
    params = [SamplingParams(temperature=rng.choice([0.5, 1.0, 2.0]), min_p=rng.choice([0.0, 0.02, 0.2, 0.9]))
              for _ in range(12)]
    rows = [SampleRow(p, 0) for p in params]
    x = logits_for(9, len(rows), vocab)
    want = torch.stack([ref_probs(x[i], p) for i, p in enumerate(params)])
    torch.testing.assert_close(sampler.probabilities(x, rows), want, rtol=0, atol=1e-6)
    # Sampling draws only from the surviving tokens, and reaches every one of them.
    allowed = [set((want[i] > 0).nonzero()[:, 0].tolist()) for i in range(len(rows))]
    seen: list[set[int]] = [set() for _ in rows]
    for _ in range(300):
        for i, tok in enumerate(sampler.sample(x, rows)):
            seen[i].add(tok)
    for i, p in enumerate(params):
        assert seen[i] <= allowed[i], i
        if p.min_p >= 0.2:
            assert seen[i] == allowed[i], i


def test_top_p_reads_the_mass_left_after_min_p() -> None:
    """probs (.5, .3, .15, .05), min_p=0.2 drops the last one; renormalized, the cumulative mass
    before token 2 is .842 >= top_p=.82, so only tokens 0 and 1 remain (as vLLM masks then
    softmaxes). Without renormalization it would be .80 and token 2 would stay."""
    sampler = Sampler(seed=6)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    row = [SampleRow(SamplingParams(temperature=1.0, min_p=0.2, top_p=0.82), 0)]
    assert {sampler.sample(logits, row)[0] for _ in range(300)} == {0, 1}
    row = [SampleRow(SamplingParams(temperature=1.0, top_p=0.82), 0)]
    assert {sampler.sample(logits, row)[0] for _ in range(300)} == {0, 1, 2}


@pytest.mark.parametrize("vocab", [60, 1000])
def test_logprobs_are_raw_log_softmax(vocab: int) -> None:
    rng = random.Random(vocab)
    sampler = Sampler(eos_token_ids=EOS, seed=1, vocab_size=vocab)
    reqs = make_batch(rng, sampler, vocab, 10)
    raw = logits_for(vocab, len(reqs), vocab)
    out = sampler.sample_batch(raw, [r.row() for r in reqs])
    assert len(out.logprobs) == len(reqs)
    ref = torch.log_softmax(raw, dim=-1)
    for i, r in enumerate(reqs):
        entry = out.logprobs[i]
        if r.params.logprobs is None:
            assert entry is None
            continue
        assert entry is not None
        n = r.params.logprobs
        assert len(entry.token_ids) == len(entry.logprobs) == 1 + n
        assert entry.token_ids[0] == out.token_ids[i]
        top = sorted(range(vocab), key=lambda t, i=i: -ref[i, t].item())[:n]
        assert entry.token_ids[1:] == top
        want = ref[i, entry.token_ids]
        assert torch.allclose(torch.tensor(entry.logprobs), want, atol=1e-6, rtol=0)
    # More top logprobs than the vocabulary has: the whole vocabulary, once.
    row = SampleRow(SamplingParams(temperature=0.0, logprobs=vocab + 5), 0)
    entry = sampler.sample_batch(raw[:1], [row]).logprobs[0]
    assert entry is not None and sorted(entry.token_ids[1:]) == list(range(vocab))


def test_seeded_rows_ignore_their_batch() -> None:
    """A seeded row using every feature samples the same tokens alone and amid random others."""
    vocab = 400
    mine = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.02, repetition_penalty=1.2,
                          frequency_penalty=0.4, presence_penalty=0.3, logit_bias={7: 2.0}, min_tokens=2,
                          logprobs=2, seed=42)

    def run(companions: int, position: int) -> list[int]:
        rng = random.Random(companions)
        sampler = Sampler(eos_token_ids=EOS, seed=companions, vocab_size=vocab)
        others = make_batch(rng, sampler, vocab, companions)
        me = Req(mine, [1, 5, 7, 9], [], sampler.make_generator(mine))
        me.slot = sampler.track(mine, me.prompt, [])
        reqs = others[:position] + [me] + others[position:]
        for step in range(25):
            raw = logits_for(1000 + step * 7 + companions, len(reqs), vocab)
            raw[position] = logits_for(step, 1, vocab)[0] * 0.4  # my row's logits depend on the step only
            for r, tok in zip(reqs, sampler.sample(raw, [r.row() for r in reqs]), strict=True):
                r.outputs.append(tok)
        return me.outputs

    alone = run(0, 0)
    assert len(set(alone)) > 5
    assert run(6, 2) == alone
    assert run(12, 12) == alone


def test_check_params_ranges() -> None:
    ok = SamplingParams(min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.1,
                        logit_bias={5: -100.0}, logprobs=0)
    assert check_params(ok) is None
    bad = {"min_p": SamplingParams(min_p=1.5), "presence_penalty": SamplingParams(presence_penalty=2.5),
           "frequency_penalty": SamplingParams(frequency_penalty=float("nan")),
           "repetition_penalty": SamplingParams(repetition_penalty=0.0),
           "logit_bias": SamplingParams(logit_bias={3: float("inf")}), "logprobs": SamplingParams(logprobs=-1)}
    for name, params in bad.items():
        why = check_params(params)
        assert why is not None and name in why, name


# ---------------------------------------------------------------------------------------------
# Through the ModelRunner


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama


@pytest.fixture
def runner(tiny) -> ModelRunner:
    return ModelRunner(str(tiny[0]), dtype="float32", device="cpu", num_blocks=NUM_BLOCKS, block_size=BLOCK)


PENALIZED = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3,
                           logit_bias={17: 1.0}, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_k=30, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.3,
                        seed=5, ignore_eos=True)


def generate(runner: ModelRunner, n: int, preempt_at: int | None = None) -> HandScheduler:
    """Greedy-with-penalties "g" and seeded-with-penalties "s" beside a plain greedy "x"."""
    runner.reset()
    sched = HandScheduler(seed=3)
    sched.add("g", prompt(1, 9), PENALIZED)
    sched.add("s", prompt(2, 6), SEEDED)
    sched.add("x", prompt(3, 5))
    for step in range(n):
        if step == preempt_at:
            sched.preempt("g")
            sched.preempt("s")
        sched.update(runner.execute(sched.plan({"g": 0, "s": 0, "x": 0})))
    return sched


def test_runner_penalties_follow_reference_and_survive_preemption(tiny, runner: ModelRunner) -> None:
    _, ref = tiny
    n = 14
    whole = generate(runner, n)
    resumed = generate(runner, n, preempt_at=6)  # both resume with prompt + 6 outputs
    for rid in ("g", "s"):
        assert resumed.outputs(rid) == whole.outputs(rid), rid
    # Greedy with penalties is the reference argmax over transformers' logits, step by step.
    tokens = whole.tokens["g"]
    num_prompt = whole.num_prompt["g"]
    with torch.no_grad():
        logits = ref(torch.tensor([tokens])).logits[0]
    for k in range(n):
        at = num_prompt + k
        want = ref_process(logits[at - 1], PENALIZED, tokens[:num_prompt], tokens[num_prompt:at])
        assert tokens[at] == int(want.argmax()), k
    with torch.no_grad():  # and the penalties did change the output
        out = ref.generate(torch.tensor([tokens[:num_prompt]]), max_new_tokens=n, do_sample=False,
                           attention_mask=torch.ones(1, num_prompt, dtype=torch.long), pad_token_id=0)
    plain = out[0, num_prompt:].tolist()
    assert plain != whole.outputs("g")


def test_step_result_logprobs_aligned_with_request_ids(tiny, runner: ModelRunner) -> None:
    _, ref = tiny
    sched = HandScheduler(seed=4)
    sched.add("a", prompt(4, 7), SamplingParams(temperature=0.8, logprobs=3, seed=1))
    sched.add("b", prompt(5, 12))
    sched.add("c", prompt(6, 5), SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=1.3))
    res = runner.execute(sched.plan({"b": 0}))
    assert res.request_ids == ["b"] and res.logprobs == []  # nobody asked: nothing extra
    sched.update(res)
    res = runner.execute(sched.plan({"a": 4, "b": 0}))  # a: a prompt chunk, nothing sampled
    assert res.request_ids == ["b"] and res.logprobs == []
    sched.update(res)
    for _ in range(3):
        res = runner.execute(sched.plan({"c": 0, "b": 0, "a": 0}))
        sched.update(res)
        assert res.request_ids == ["c", "b", "a"]
        assert len(res.logprobs) == 3 and res.logprobs[1] is None
        for i, rid in ((0, "c"), (2, "a")):
            entry = res.logprobs[i]
            assert entry is not None and entry.token_ids[0] == res.token_ids[i]
            want_n = sched.params[rid].logprobs
            assert len(entry.token_ids) == 1 + want_n
            context = sched.tokens[rid][:-1]  # the sampled token was just appended
            with torch.no_grad():
                lp = torch.log_softmax(ref(torch.tensor([context])).logits[0, -1].float(), dim=-1)
            assert entry.token_ids[1:] == lp.topk(want_n).indices.tolist()
            assert torch.allclose(torch.tensor(entry.logprobs), lp[entry.token_ids], atol=1e-4, rtol=0)


def test_prompt_logprobs_across_chunks_equal_transformers(tiny, runner: ModelRunner) -> None:
    """A prompt run in three chunks (beside another request) returns, with its first output
    token, one entry per prompt token: the first unscored, the rest log_softmax of the model's
    logits at the previous position, top-3 included."""
    _, ref = tiny
    sched = HandScheduler(seed=5)
    ids = prompt(2, 41)
    sched.add("p", ids, SamplingParams(temperature=0.0, prompt_logprobs=3))
    sched.add("x", prompt(3, 9))
    results = [runner.execute(sched.plan({"p": 13, "x": 0})), runner.execute(sched.plan({"p": 20})),
               runner.execute(sched.plan({"p": 8}))]
    assert all(not r.prompt_logprobs for r in results[:2])
    last = results[2]
    assert last.request_ids == ["p"]
    lps = last.prompt_logprobs[0]
    assert len(lps) == len(ids) and lps[0].token_ids == [ids[0]] and lps[0].logprobs == []
    with torch.inference_mode():
        want = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)
    for p in range(1, len(ids)):
        entry, row = lps[p], want[p - 1]
        assert entry.token_ids[0] == ids[p]
        assert abs(entry.logprobs[0] - float(row[ids[p]])) < 1e-4
        assert entry.token_ids[1:] == torch.topk(row, 3).indices.tolist()
        assert torch.allclose(torch.tensor(entry.logprobs[1:]), torch.topk(row, 3).values, atol=1e-4)
    # Later steps carry none.
    sched.update(last)
    assert not runner.execute(sched.plan({"p": 1})).prompt_logprobs
