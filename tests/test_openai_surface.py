"""The OpenAI surface end to end: every sampling parameter through the official openai client
(sync and async, streamed and not) against the real stack of service processes (SmolLM2,
float32), checked against transformers' logits where the result is determined."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import torch
from service_stack import ServiceStack, rill_executable

AsyncFactory = Callable[[], openai.AsyncOpenAI]
NEAR_TIE = 2e-3
LOGPROB_TOL = 1e-3
CHAT = [{"role": "user", "content": "Write a short poem about the sea and the wind."}]
PROMPT = "The three most important inventions in history are"


@pytest.fixture(scope="module")
def aclient(stack: ServiceStack) -> AsyncFactory:
    """A factory: an async client's connections belong to the event loop that opened them."""
    return lambda: openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0,
                                      timeout=120)


@pytest.fixture(scope="module")
def hf(smollm2_dir: str):
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return tok, model


def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def token_ids(logprobs_content) -> list[int]:
    """Ids from logprob entries rendered with return_tokens_as_token_ids ("token_id:<id>")."""
    return [int(t.split(":", 1)[1]) for t in logprobs_content]


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """Raw float32 logits at every position of `ids`."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


# --------------------------------------------------------------------------- tokenize


def test_tokenize_and_detokenize_match_the_tokenizer(stack: ServiceStack, hf) -> None:
    tok, _ = hf
    with httpx.Client(base_url=stack.base_url, timeout=30) as c:
        r = c.post("/tokenize", json={"prompt": PROMPT}).json()
        assert r["tokens"] == tok(PROMPT)["input_ids"] and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == 2048
        chat = c.post("/tokenize", json={"messages": CHAT}).json()
        expected = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
        expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        assert chat["tokens"] == expected
        d = c.post("/detokenize", json={"tokens": r["tokens"]}).json()
        assert d["prompt"] == tok.decode(r["tokens"])
        assert c.post("/v1/tokenize", json={"messages": CHAT}).json() == chat  # vLLM's newer paths
        assert c.post("/v1/detokenize", json={"tokens": r["tokens"]}).json() == d
        bad = c.post("/detokenize", json={"tokens": [10**9]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        # vLLM's /tokenizer_info, which lm-eval's remote tokenizer reads (and then encodes eos_token).
        info = c.get("/tokenizer_info").json()
        assert (info["eos_token"], info["bos_token"], info["chat_template"]) == (
            tok.eos_token, tok.bos_token, tok.chat_template)
        assert info["model_max_length"] == 2048 and tok.eos_token_id in info["eos_token_ids"]
        eos = c.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
        assert eos["tokens"] == [tok.eos_token_id]


# --------------------------------------------------------------------------- logprobs


def test_chat_logprobs_equal_transformers_log_softmax(stack: ServiceStack, client: openai.OpenAI, hf) -> None:
    tok, model = hf
    r = client.chat.completions.create(model=model_name(client), messages=CHAT, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=5,
                                       extra_body={"return_tokens_as_token_ids": True})
    content = r.choices[0].logprobs.content
    out = token_ids([c.token for c in content])
    assert len(out) == r.usage.completion_tokens == 8
    prompt = httpx.post(f"{stack.base_url}/tokenize", json={"messages": CHAT}).json()["tokens"]
    logp = torch.log_softmax(hf_logits(model, prompt + out), dim=-1)[len(prompt) - 1:-1]
    for k, entry in enumerate(content):
        ref = logp[k]
        assert abs(entry.logprob - float(ref[out[k]])) < LOGPROB_TOL
        assert len(entry.top_logprobs) == 5
        top_ids = token_ids([t.token for t in entry.top_logprobs])
        for t, tid in zip(entry.top_logprobs, top_ids, strict=True):
            assert abs(t.logprob - float(ref[tid])) < LOGPROB_TOL
        # The listed tokens are the 5 most likely (up to ties within the tolerance).
        fifth = float(torch.topk(ref, 5).values[-1])
        assert all(float(ref[tid]) >= fifth - LOGPROB_TOL for tid in top_ids)
        assert out[k] == int(ref.argmax()) or float(ref.max() - ref[out[k]]) < NEAR_TIE


def test_completion_logprobs_shape_and_stream(client: openai.OpenAI) -> None:
    name = model_name(client)
    full = client.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == full.choices[0].text
    assert lp.text_offset[0] == 0 and all(b > a for a, b in zip(lp.text_offset, lp.text_offset[1:], strict=False))
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert val <= 0 and tok in top and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(val)  # greedy: the sampled token is the most likely
    streamed = list(client.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0,
                                              logprobs=3, stream=True))
    tokens = [t for ch in streamed for c in ch.choices if c.logprobs for t in c.logprobs.tokens]
    assert tokens == lp.tokens


# --------------------------------------------------------------------------- penalties


def reference_greedy(model, prompt: list[int], n: int, rep: float, freq: float, pres: float,
                     bias: dict[int, float]) -> tuple[list[int], list[float]]:
    """Greedy decoding with logit_bias, then repetition, frequency and presence penalties, as
    plain per-token Python over transformers' logits. Also returns each step's top-2 gap."""
    out: list[int] = []
    gaps: list[float] = []
    for _ in range(n):
        x = hf_logits(model, prompt + out)[-1].clone()
        for t, b in bias.items():
            x[t] += b
        for t in set(prompt + out):
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        for t, c in Counter(out).items():
            x[t] -= freq * c + pres
        top2 = torch.topk(x, 2).values
        gaps.append(float(top2[0] - top2[1]))
        out.append(int(x.argmax()))
    return out, gaps


def test_greedy_with_penalties_follows_the_reference(stack: ServiceStack, client: openai.OpenAI, hf) -> None:
    _, model = hf
    name = model_name(client)
    prompt = httpx.post(f"{stack.base_url}/tokenize", json={"prompt": "List of animals: cat, dog, cat, dog,"}).json()
    prompt_ids = prompt["tokens"]
    n = 12
    plain, _ = reference_greedy(model, prompt_ids, n, 1.0, 0.0, 0.0, {})
    bias = {plain[1]: -5.0}
    expected, gaps = reference_greedy(model, prompt_ids, n, 1.3, 0.4, 0.3, bias)
    assert expected != plain  # the penalties matter for this prompt
    r = client.completions.create(model=name, prompt=prompt_ids, max_tokens=n, temperature=0, logprobs=0,
                                  frequency_penalty=0.4, presence_penalty=0.3,
                                  logit_bias={str(k): v for k, v in bias.items()},
                                  extra_body={"repetition_penalty": 1.3, "ignore_eos": True,
                                              "return_tokens_as_token_ids": True})
    got = token_ids(r.choices[0].logprobs.tokens)
    for k, (a, b) in enumerate(zip(got, expected, strict=True)):
        if a != b:
            assert gaps[k] < NEAR_TIE, f"diverged at token {k} (gap {gaps[k]:.3g}): {got} vs {expected}"
            break


def test_logit_bias_forces_a_token(client: openai.OpenAI, hf) -> None:
    tok, _ = hf
    forced = tok(" banana", add_special_tokens=False)["input_ids"][0]
    r = client.completions.create(model=model_name(client), prompt=PROMPT, max_tokens=4, temperature=0,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text == tok.decode([forced] * 4)


# --------------------------------------------------------------------------- filters, seeds, n


def test_filters_that_keep_only_the_top_token_equal_greedy(client: openai.OpenAI) -> None:
    name = model_name(client)
    greedy = client.completions.create(model=name, prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    for extra in ({"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-9}):
        r = client.completions.create(model=name, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=5,
                                      **({"top_p": extra["top_p"]} if "top_p" in extra else {}),
                                      extra_body={k: v for k, v in extra.items() if k != "top_p"})
        assert r.choices[0].text == greedy, extra


def test_same_seed_same_text_alone_and_in_a_busy_batch(aclient: AsyncFactory, client: openai.OpenAI) -> None:
    name = model_name(client)

    async def seeded(ac: openai.AsyncOpenAI) -> str:
        r = await ac.completions.create(model=name, prompt=PROMPT, max_tokens=16, temperature=1.0,
                                             top_p=0.95, seed=1234, extra_body={"min_p": 0.02})
        return r.choices[0].text

    async def noise(ac: openai.AsyncOpenAI, i: int) -> None:
        await ac.completions.create(model=name, prompt=f"Count to {i + 5}:", max_tokens=24, temperature=1.0)

    async def scenario() -> tuple[str, str, str]:
        ac = aclient()
        alone = await seeded(ac)
        busy = await asyncio.gather(seeded(ac), *(noise(ac, i) for i in range(6)))
        other = await ac.completions.create(model=name, prompt=PROMPT, max_tokens=16, temperature=1.0,
                                                 top_p=0.95, seed=99, extra_body={"min_p": 0.02})
        return alone, busy[0], other.choices[0].text

    alone, busy, other = asyncio.run(scenario())
    assert alone == busy
    assert other != alone  # the seed matters


def test_n_choices_plain_and_streamed(client: openai.OpenAI, aclient: AsyncFactory) -> None:
    name = model_name(client)
    kw = dict(model=name, messages=CHAT, max_tokens=8, temperature=1.0, seed=7, n=3)
    full = client.chat.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts = [c.message.content for c in full.choices]
    assert len(set(texts)) > 1  # different seeds per sample
    assert full.usage.completion_tokens == 24 and all(c.finish_reason == "length" for c in full.choices)

    async def streamed() -> tuple[list[str], list[str | None], object]:
        parts: list[list[str]] = [[], [], []]
        reasons: list[str | None] = [None, None, None]
        usage = None
        stream = await aclient().chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                parts[c.index].append(c.delta.content or "")
                reasons[c.index] = c.finish_reason or reasons[c.index]
        return ["".join(p) for p in parts], reasons, usage

    s_texts, s_reasons, usage = asyncio.run(streamed())
    assert s_texts == texts and s_reasons == ["length"] * 3
    assert usage is not None and usage.completion_tokens == 24


# --------------------------------------------------------------------------- lengths, stops, echo


def test_lengths_stops_and_eos(client: openai.OpenAI, hf) -> None:
    tok, _ = hf
    name = model_name(client)
    r = client.chat.completions.create(model=name, messages=CHAT, max_completion_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    base = client.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0,
                                     logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    text = base.choices[0].text
    ids = token_ids(base.choices[0].logprobs.tokens)
    stop = text[len(text) // 2:len(text) // 2 + 4]
    assert stop.strip(), text
    cut = client.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.index(stop)]
    kept = client.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:text.index(stop) + len(stop)]
    by_id = client.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0,
                                      extra_body={"stop_token_ids": [ids[3]]})
    assert by_id.choices[0].finish_reason == "stop" and by_id.usage.completion_tokens == ids.index(ids[3]) + 1
    # The stop token's text is left out (as vLLM), unless include_stop_str_in_output.
    assert by_id.choices[0].text == tok.decode(ids[:ids.index(ids[3])]), (by_id.choices[0].text, text)
    kept_id = client.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={
        "stop_token_ids": [ids[3]], "include_stop_str_in_output": True})
    assert kept_id.choices[0].text == tok.decode(ids[:ids.index(ids[3]) + 1])
    # A prompt the model answers briefly: EOS ends it early, ignore_eos and min_tokens do not.
    short = [{"role": "user", "content": "Reply with just the word yes."}]
    early = client.chat.completions.create(model=name, messages=short, max_tokens=48, temperature=0)
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens < 35
    n_early = early.usage.completion_tokens
    forced = client.chat.completions.create(model=name, messages=short, max_tokens=48, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 48 and forced.choices[0].finish_reason == "length"
    at_least = client.chat.completions.create(model=name, messages=short, max_tokens=48, temperature=0,
                                              extra_body={"min_tokens": n_early + 5})
    assert at_least.usage.completion_tokens >= n_early + 5


def test_echo_string_and_token_prompts(client: openai.OpenAI, hf) -> None:
    tok, _ = hf
    name = model_name(client)
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model=name, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].text == PROMPT + plain.choices[0].text
    ids = tok(PROMPT)["input_ids"]
    r_ids = client.completions.create(model=name, prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert r_ids.choices[0].text.startswith(tok.decode(ids))
    chunks = list(client.completions.create(model=name, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    with pytest.raises(openai.BadRequestError) as err:  # an id the vocabulary lacks: the prompt's fault
        client.completions.create(model=name, prompt=[*ids, 10 ** 6], max_tokens=4, echo=True)
    assert err.value.param == "prompt"


def test_echo_with_logprobs_scores_the_prompt(stack: ServiceStack, client: openai.OpenAI, hf) -> None:
    """lm-eval's loglikelihood request: echo + logprobs gives every prompt token's logprob (the
    first has none) from the model's raw distribution, then the outputs'."""
    tok, model = hf
    ids = tok(PROMPT)["input_ids"]
    r = client.completions.create(model=model_name(client), prompt=ids, max_tokens=2, temperature=0, echo=True,
                                  logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    got = token_ids(lp.tokens)
    assert got[:len(ids)] == ids and len(got) == len(ids) + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = torch.log_softmax(hf_logits(model, got), dim=-1)
    for p in range(1, len(got)):
        assert abs(lp.token_logprobs[p] - float(want[p - 1, got[p]])) < LOGPROB_TOL, p
        assert len(lp.top_logprobs[p]) >= 2
    streamed = list(client.completions.create(model=model_name(client), prompt=ids, max_tokens=2, temperature=0,
                                              echo=True, logprobs=2, stream=True,
                                              extra_body={"return_tokens_as_token_ids": True}))
    tokens = [t for ch in streamed for c in ch.choices if c.logprobs for t in c.logprobs.tokens]
    assert tokens == lp.tokens
    # OpenAI's legacy scoring: max_tokens 0 with echo gives the prompt and its logprobs, nothing more.
    score = dict(model=model_name(client), max_tokens=0, echo=True, logprobs=2,
                 extra_body={"return_tokens_as_token_ids": True})
    only = client.completions.create(prompt=ids, **score)
    c = only.choices[0]
    assert c.text == tok.decode(ids) and c.finish_reason == "length" and only.usage.completion_tokens == 0
    assert c.logprobs.tokens == lp.tokens[:len(ids)] and c.logprobs.token_logprobs == lp.token_logprobs[:len(ids)]
    chunks = list(client.completions.create(prompt=ids, stream=True, **score))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    assert [t for ch in chunks for x in ch.choices if x.logprobs for t in x.logprobs.tokens] == c.logprobs.tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name(client), prompt=ids, max_tokens=0)
    assert err.value.body["param"] == "max_tokens" and "echo" in err.value.body["message"]


def test_prompt_logprobs_score_every_prompt_token(client: openai.OpenAI, hf) -> None:
    """vLLM's prompt_logprobs: per prompt token (the first: null) its logprob from the model's raw
    distribution, its rank in the vocabulary, and the k likeliest ranked; chat's at the top;
    streamed or past --max-logprobs: a 400."""
    tok, model = hf
    ids, mid = tok(PROMPT)["input_ids"], model_name(client)
    r = client.completions.create(model=mid, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 3}).model_dump()
    scored = r["choices"][0]["prompt_logprobs"]
    want = torch.log_softmax(hf_logits(model, ids), dim=-1)
    assert len(scored) == len(ids) and scored[0] is None
    for p in range(1, len(ids)):
        entry, best = scored[p], torch.topk(want[p - 1], 3)
        assert abs(entry[str(ids[p])]["logprob"] - float(want[p - 1, ids[p]])) < LOGPROB_TOL, p
        ranked = sorted((e["rank"], int(t)) for t, e in entry.items() if e["rank"] is not None and e["rank"] <= 3)
        assert [r for r, _ in ranked] == [1, 2, 3] and abs(entry[str(ranked[0][1])]["logprob"] - float(best.values[0])) < LOGPROB_TOL
        own = want[p - 1, ids[p]]  # its rank: 1 + the tokens likelier than it, give or take near ties
        likelier = [int((want[p - 1] > own + d).sum()) + 1 for d in (NEAR_TIE, -NEAR_TIE)]
        assert likelier[0] <= entry[str(ids[p])]["rank"] <= likelier[1], (p, entry, likelier)
        assert entry[str(ids[p])]["decoded_token"] == tok.decode([ids[p]])
    chat = client.chat.completions.create(model=mid, messages=CHAT, max_tokens=1, extra_body={"prompt_logprobs": 0})
    got = chat.model_dump()["prompt_logprobs"]
    assert len(got) == chat.usage.prompt_tokens and got[0] is None and all(len(e) == 1 for e in got[1:])
    for extra in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 21}):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=mid, prompt=ids, max_tokens=1, extra_body=extra)
        assert err.value.param == "prompt_logprobs"


def test_batched_prompts_equal_single_requests(client: openai.OpenAI, hf) -> None:
    """A list of prompts (lm-eval's batched loglikelihood and generation requests) answers as the
    prompts would one at a time, prompt i's n choices from index i * n, streamed or not."""
    tok, _ = hf
    name = model_name(client)
    ids = [tok(t)["input_ids"] for t in (PROMPT, "The sea and the wind", "Paris is the capital of")]
    score = dict(model=name, max_tokens=1, temperature=0, echo=True, logprobs=1)
    batch = client.completions.create(prompt=ids, **score)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    for c, prompt in zip(batch.choices, ids, strict=True):
        alone = client.completions.create(prompt=prompt, **score).choices[0]
        assert c.text == alone.text and c.logprobs.tokens == alone.logprobs.tokens
        assert all(abs(a - b) < LOGPROB_TOL for a, b in zip(c.logprobs.token_logprobs[1:],
                                                                alone.logprobs.token_logprobs[1:], strict=True))
    assert batch.usage.prompt_tokens == sum(len(p) for p in ids) and batch.usage.completion_tokens == 3

    texts = ["Once upon a time", "The best way to learn is"]
    sample = dict(model=name, max_tokens=6, temperature=1.0, seed=11, n=2)
    want = [c.text for t in texts for c in client.completions.create(prompt=t, **sample).choices]
    got = client.completions.create(prompt=texts, **sample)
    assert [c.text for c in got.choices] == want and [c.index for c in got.choices] == [0, 1, 2, 3]
    streamed = ["", "", "", ""]
    for chunk in client.completions.create(prompt=texts, stream=True, **sample):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == want


def test_async_stream_with_usage_matches_plain(aclient: AsyncFactory, client: openai.OpenAI) -> None:
    name = model_name(client)
    plain = client.chat.completions.create(model=name, messages=CHAT, max_tokens=10, temperature=0)

    async def run() -> tuple[str, object]:
        text, usage = [], None
        stream = await aclient().chat.completions.create(model=name, messages=CHAT, max_tokens=10, temperature=0,
                                                       stream=True, stream_options={"include_usage": True},
                                                       presence_penalty=0.0, frequency_penalty=0.0)
        async for chunk in stream:
            usage = chunk.usage or usage
            text += [c.delta.content or "" for c in chunk.choices]
        return "".join(text), usage

    text, usage = asyncio.run(run())
    assert text == plain.choices[0].message.content
    assert usage.completion_tokens == plain.usage.completion_tokens == 10
    assert usage.prompt_tokens == plain.usage.prompt_tokens
    # vLLM's continuous_usage_stats: every chunk carries the usage so far.
    chunks = list(client.chat.completions.create(
        model=name, messages=CHAT, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))  # type: ignore[typeddict-unknown-key]
    assert all(c.usage is not None and c.usage.prompt_tokens == usage.prompt_tokens for c in chunks)
    done = [c.usage.completion_tokens for c in chunks]
    assert done[0] == 0 and done == sorted(done) and done[-1] == 10
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=name, messages=CHAT, max_tokens=2, stream=True,
                                       stream_options={"continuous_usage_stats": True})  # type: ignore[typeddict-unknown-key]
    assert err.value.body["param"] == "stream_options.continuous_usage_stats"


def test_prompt_too_long_names_the_numbers(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name(client), prompt=PROMPT, max_tokens=2047)
    msg = str(err.value)
    assert "2048" in msg and "2047" in msg and err.value.param == "max_tokens"


def test_truncate_prompt_tokens_keeps_the_prompts_end(client: openai.OpenAI) -> None:
    """A prompt past the context runs on its last k tokens: the same text and usage as sending
    those ids; chat cuts the template's output; 0, more than the context, or echo: a 400."""
    mid, text = model_name(client), "The sea, the wind and the stars. " * 300
    ids = client.post("/tokenize", cast_to=httpx.Response, body={"prompt": text}).json()["tokens"]
    assert len(ids) > 2048
    truncated = client.completions.create(model=mid, prompt=text, max_tokens=6, temperature=0,
                                          extra_body={"truncate_prompt_tokens": 100})
    as_ids = client.completions.create(model=mid, prompt=ids, max_tokens=6, temperature=0,
                                      extra_body={"truncate_prompt_tokens": 100})
    direct = client.completions.create(model=mid, prompt=ids[-100:], max_tokens=6, temperature=0)
    assert truncated.usage.prompt_tokens == as_ids.usage.prompt_tokens == 100
    assert truncated.choices[0].text == as_ids.choices[0].text == direct.choices[0].text
    chat = client.chat.completions.create(model=mid, messages=CHAT, max_tokens=3, temperature=0,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    for extra in ({"truncate_prompt_tokens": 0}, {"truncate_prompt_tokens": 2049},
                  {"truncate_prompt_tokens": 10, "echo": True}):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=mid, prompt=ids, max_tokens=2, extra_body=extra)
        assert err.value.param == "truncate_prompt_tokens"


def test_return_token_ids_give_the_ids_the_text_came_from(client: openai.OpenAI, hf) -> None:
    """vLLM's return_token_ids: the prompt's ids (as /tokenize gives them) and each choice's
    output ids (as many as usage counts, decoding to its text), equal streamed and not."""
    tok, _ = hf
    mid, ids = model_name(client), {"return_token_ids": True}
    prompt_ids = client.post("/tokenize", cast_to=httpx.Response, body={"prompt": PROMPT}).json()["tokens"]
    chat_ids = client.post("/tokenize", cast_to=httpx.Response, body={"messages": CHAT}).json()["tokens"]
    r = client.completions.create(model=mid, prompt=PROMPT, max_tokens=8, temperature=0.8, seed=3, n=2,
                                  extra_body=ids).model_dump()
    chunks = [c.model_dump() for c in client.completions.create(
        model=mid, prompt=PROMPT, max_tokens=8, temperature=0.8, seed=3, n=2, stream=True, extra_body=ids)]
    for i, choice in enumerate(r["choices"]):
        assert choice["prompt_token_ids"] == prompt_ids and len(choice["token_ids"]) == 8
        assert tok.decode(choice["token_ids"]) == choice["text"]
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert [c.get("prompt_token_ids") for c in mine if c.get("prompt_token_ids")] == [prompt_ids]
        assert [t for c in mine for t in c.get("token_ids") or []] == choice["token_ids"]
    chat = client.chat.completions.create(model=mid, messages=CHAT, max_tokens=40, temperature=0, extra_body=ids)
    got = chat.model_dump()
    assert got["prompt_token_ids"] == chat_ids and len(got["choices"][0]["token_ids"]) == chat.usage.completion_tokens
    assert tok.decode(got["choices"][0]["token_ids"], skip_special_tokens=True) == chat.choices[0].message.content
    stream = [c.model_dump() for c in client.chat.completions.create(
        model=mid, messages=CHAT, max_tokens=40, temperature=0, stream=True, extra_body=ids)]
    assert stream[0]["prompt_token_ids"] == chat_ids and not any("prompt_token_ids" in c for c in stream[1:])
    assert [t for c in stream for ch in c["choices"] for t in ch.get("token_ids") or []] == got["choices"][0]["token_ids"]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]  # the text passes a ChatStream
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    full, parts = (client.chat.completions.create(model=mid, messages=weather, tools=tools, max_tokens=30,
                                                  temperature=0, stream=stream, extra_body=ids) for stream in (False, True))
    full_ids = full.model_dump()["choices"][0]["token_ids"]
    assert len(full_ids) == full.usage.completion_tokens
    assert [t for c in parts for ch in c.model_dump()["choices"] for t in ch.get("token_ids") or []] == full_ids
    plain = client.completions.create(model=mid, prompt=PROMPT, max_tokens=2).model_dump()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


@pytest.mark.parametrize("extra", [{"reasoning_effort": "low"}, {"documents": [{"title": "a", "text": "b"}]}])
def test_a_field_for_templates_that_read_it_is_refused_by_one_that_does_not(client: openai.OpenAI,
                                                                           extra: dict) -> None:
    """SmolLM2's template reads neither: a 400 naming the field rather than a prompt without it."""
    name = next(iter(extra))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_name(client), messages=CHAT, max_tokens=2, extra_body=extra)
    assert err.value.param == name and name in err.value.message


def test_a_request_template_needs_the_trust_flag(stack: ServiceStack, client: openai.OpenAI) -> None:
    """vLLM's chat_template, on a server started without --trust-request-chat-template (the
    default): a 400 naming it, on chat and /tokenize alike, as vLLM refuses it."""
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_name(client), messages=CHAT, max_tokens=2,
                                       extra_body={"chat_template": "{{ messages[0].content }}"})
    assert err.value.param == "chat_template" and "--trust-request-chat-template" in err.value.message
    r = httpx.post(f"{stack.base_url}/tokenize", json={"messages": CHAT, "chat_template": "{{ 1 }}"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_a_suffix_needs_a_model_with_fim_tokens(client: openai.OpenAI) -> None:
    """SmolLM2's vocabulary has no fill-in-the-middle markers: a suffix is a 400 naming it (from
    the tokenizer, which reads the vocabulary); an empty one asks for nothing, OpenAI's default."""
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name(client), prompt="def f(x):", suffix="\nprint(f(1))", max_tokens=4)
    assert err.value.param == "suffix" and "fill-in-the-middle" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:  # the cut would drop the FIM markers
        client.completions.create(model=model_name(client), prompt="def f(x):", suffix="\nprint(f(1))", max_tokens=4,
                                  extra_body={"truncate_prompt_tokens": 8})
    assert err.value.param == "truncate_prompt_tokens" and "suffix" in err.value.message
    plain, empty = (client.completions.create(model=model_name(client), prompt=PROMPT, max_tokens=4, temperature=0,
                                              **kw) for kw in ({}, {"suffix": ""}))
    assert empty.choices[0].text == plain.choices[0].text


def test_allowed_token_ids_keep_the_output_to_them(client: openai.OpenAI, hf) -> None:
    """vLLM's allowed_token_ids: greedy picks the likeliest allowed token (transformers' logits);
    with a grammar, or an id outside the vocabulary: a 400."""
    tok, model = hf
    mid, ids = model_name(client), tok(PROMPT)["input_ids"]
    allowed = [tok(w)["input_ids"][0] for w in (" paper", " fire", " wheel", " the")]
    r = client.completions.create(model=mid, prompt=ids, max_tokens=5, temperature=0,
                                  extra_body={"allowed_token_ids": allowed, "return_token_ids": True}).model_dump()
    out = r["choices"][0]["token_ids"]
    assert len(out) == 5 and set(out) <= set(allowed)
    first = hf_logits(model, ids)[-1]
    assert out[0] == max(allowed, key=lambda t: float(first[t]))
    sampled = client.completions.create(model=mid, prompt=ids, max_tokens=8, temperature=1.5, seed=1,
                                        extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    assert set(sampled.model_dump()["choices"][0]["token_ids"]) <= set(allowed)
    eos = tok.eos_token_id
    for extra in ({"allowed_token_ids": allowed, "response_format": {"type": "json_object"}},
                  {"allowed_token_ids": [10 ** 6]}, {"allowed_token_ids": [eos], "min_tokens": 1}):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=mid, prompt=ids, max_tokens=2, extra_body=extra)
        assert err.value.param == "allowed_token_ids"


def test_bad_words_are_never_generated(client: openai.OpenAI, hf) -> None:
    """vLLM's bad_words: greedy output equals the unbanned one up to where a banned word came, then
    goes another way, and neither of the word's forms (opening the text, after a space) completes
    anywhere in it; streamed the same. With a grammar or allowed_token_ids, or a word of no tokens: a 400."""
    tok = hf[0]
    mid = model_name(client)

    def greedy(**extra: object) -> list[int]:
        r = client.completions.create(model=mid, prompt=PROMPT, max_tokens=16, temperature=0,
                                      extra_body={"return_token_ids": True, **extra})
        return r.model_dump()["choices"][0]["token_ids"]

    def occurs(form: list[int], ids: list[int]) -> bool:
        return any(ids[i:i + len(form)] == form for i in range(len(ids)))

    plain = greedy()
    for k, t in enumerate(plain):  # the output's first word whose forms did not occur before it
        word = tok.decode([t])
        forms = [tok.encode(word.strip(), add_special_tokens=False), tok.encode(word, add_special_tokens=False)]
        if word.startswith(" ") and word.strip().isalpha() and not any(occurs(f, plain[:k]) for f in forms):
            break
    else:
        pytest.fail(f"no word to ban in {tok.decode(plain)!r}")
    banned = greedy(bad_words=[word.strip()])
    assert banned[:k] == plain[:k] and banned[k] != plain[k]
    assert not any(occurs(f, banned) for f in forms), (word, tok.decode(banned))
    chunks = client.completions.create(model=mid, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                       extra_body={"bad_words": [word.strip()]})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tok.decode(banned)
    for extra in ({"bad_words": ["x"], "response_format": {"type": "json_object"}}, {"bad_words": ["   "]},
                  {"bad_words": ["x"], "allowed_token_ids": [5, 6]}):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=mid, prompt=PROMPT, max_tokens=2, extra_body=extra)
        assert err.value.param == "bad_words"


def reference_beams(model, prompt: list[int], width: int, steps: int, ends: set[int],
                    penalty: float) -> list[tuple[list[int], float]]:
    """vLLM's beam search over transformers' logits: the best (output ids, score), best first."""
    live: list[tuple[list[int], float]] = [([], 0.0)]
    done: list[tuple[list[int], float]] = []
    for _ in range(steps):
        grown = []
        for toks, lp in live:
            top = torch.log_softmax(hf_logits(model, prompt + toks)[-1], -1).topk(2 * width)
            for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                (done if t in ends else grown).append((toks + [t], lp + v))
        live = sorted(grown, key=lambda b: b[1], reverse=True)[:width]
    scored = [(t, lp / (len(prompt) + len(t) - (t[-1] in ends)) ** penalty) for t, lp in done + live]
    return sorted(scored, key=lambda b: b[1], reverse=True)[:width]


def beam_score(model, prompt: list[int], toks: list[int], ends: set[int], penalty: float) -> float:
    lps = torch.log_softmax(hf_logits(model, prompt + toks)[len(prompt) - 1:-1], -1)
    return float(lps[torch.arange(len(toks)), toks].sum()) / (len(prompt) + len(toks) - (toks[-1] in ends)) ** penalty


def test_beam_search_finds_the_reference_beams(stack: ServiceStack, client: openai.OpenAI, hf) -> None:
    """use_beam_search (vLLM's): the n beams are a reference beam search's over transformers'
    logits, best first (where a near tie swaps two, their scores agree); width 1 is greedy. Fields
    it cannot honour are 400s naming them, as is length_penalty without it."""
    tok, model = hf
    mid, ids = model_name(client), tok(PROMPT)["input_ids"]
    with httpx.Client(base_url=stack.base_url) as c:
        ends = set(c.get("/tokenizer_info").json()["eos_token_ids"])
    for width, steps, penalty in ((3, 8, 1.0), (2, 24, 0.5), (2, 12, 0.0)):
        r = client.completions.create(model=mid, prompt=PROMPT, max_tokens=steps, n=width, extra_body={
            "use_beam_search": True, "length_penalty": penalty, "return_token_ids": True}).model_dump()
        got = [c["token_ids"] for c in r["choices"]]
        want = reference_beams(model, ids, width, steps, ends, penalty)
        scores = [beam_score(model, ids, t, ends, penalty) for t in got]
        assert len(got) == width and all(a >= b - 2e-3 for a, b in zip(scores, scores[1:], strict=False))
        for g, s, (w, ws) in zip(got, scores, want, strict=True):
            assert g == w or abs(s - ws) < 2e-3, (tok.decode(g), tok.decode(w), s, ws)
        assert [c["text"] for c in r["choices"]] == [tok.decode(t[:-1] if t[-1] in ends else t) for t in got]
        assert r["usage"]["completion_tokens"] == sum(map(len, got))
    greedy = client.completions.create(model=mid, prompt=PROMPT, max_tokens=8, temperature=0)
    one = client.completions.create(model=mid, prompt=PROMPT, max_tokens=8, extra_body={"use_beam_search": True})
    assert one.choices[0].text == greedy.choices[0].text
    # A prompt whose blocks are cached: the search's usage says so, as a plain request's does.
    long = "Rivers, mountains and seas: " * 6 + PROMPT
    client.completions.create(model=mid, prompt=long, max_tokens=2, temperature=0)
    searched = client.completions.create(model=mid, prompt=long, max_tokens=2, extra_body={"use_beam_search": True})
    plain = client.completions.create(model=mid, prompt=long, max_tokens=2, temperature=0)
    assert searched.usage.prompt_tokens_details.cached_tokens == plain.usage.prompt_tokens_details.cached_tokens > 0
    for extra in ({"use_beam_search": True, "temperature": 0.7}, {"use_beam_search": True, "logprobs": 0},
                  {"use_beam_search": True, "stream": True}, {"length_penalty": 2.0}, {"use_beam_search": True, "n": 11}):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=mid, prompt=PROMPT, max_tokens=2, extra_body=extra)
        assert err.value.param == next(k for k in extra if k != "use_beam_search"), extra
    with pytest.raises(openai.BadRequestError) as err:  # one prompt a search
        client.completions.create(model=mid, prompt=[PROMPT, PROMPT], max_tokens=2, extra_body={"use_beam_search": True})
    assert err.value.param == "prompt"


def test_cache_salt_isolates_the_prefix_cache(client: openai.OpenAI) -> None:
    """A prompt's cached blocks serve only requests with its cache_salt (none is a salt of its
    own): completions, chat and responses, the salted text equal to the unsalted one."""
    prompt = f"{uuid.uuid4().hex} " + "Rivers run to the sea. " * 12
    mid = model_name(client)

    def cached(salt: str | None) -> tuple[int, str]:
        r = client.completions.create(model=mid, prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body={"cache_salt": salt} if salt else None)
        return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].text

    first = cached("tenant-1")
    assert first[0] == 0 and [cached(s) for s in (None, "tenant-2")] == [(0, first[1])] * 2
    hit = cached("tenant-1")
    assert hit[0] > 0 and hit[1] == first[1] and cached(None)[0] == hit[0]
    chat = [{"role": "user", "content": prompt}]
    first_chat, again = (client.chat.completions.create(model=mid, messages=chat, max_tokens=2, temperature=0,
                                                        extra_body={"cache_salt": "tenant-3"}) for _ in range(2))
    assert first_chat.usage.prompt_tokens_details.cached_tokens == 0 < again.usage.prompt_tokens_details.cached_tokens
    r = client.responses.create(model=mid, input=prompt, max_output_tokens=2, temperature=0,
                                extra_body={"cache_salt": "tenant-3"})
    assert r.usage.input_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=mid, prompt="x", max_tokens=1, extra_body={"cache_salt": ""})
    assert err.value.param == "cache_salt"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=mid, prompt="x", max_tokens=1, extra_body={"cache_salt": "s" * 1025})
    assert err.value.param == "cache_salt"


# --------------------------------------------------------------------------- rill bench serve

BENCH_PROMPTS, BENCH_OUT = 6, 12


def bench(stack: ServiceStack, tmp_path: Path, *flags: str) -> tuple[int, dict, str]:
    """`rill bench serve` as a user runs it; (exit code, the --save-result JSON, stdout)."""
    out = tmp_path / "result.json"
    proc = subprocess.run([*rill_executable(), "bench", "serve", "--base-url", stack.base_url,
                           "--num-prompts", str(BENCH_PROMPTS), "--input-len-range", "5:40",
                           "--output-len", str(BENCH_OUT), "--ignore-eos", "--max-concurrency", "3", "--warmup", "1",
                           "--quiet", "--save-result", str(out), *flags],
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, json.loads(out.read_text()), proc.stdout


@pytest.mark.parametrize("backend", ["openai-completions", "openai-chat", "rill-ws"])
def test_bench_serve_times_every_token(stack: ServiceStack, tmp_path: Path, backend: str) -> None:
    code, r, stdout = bench(stack, tmp_path, "--backend", backend)
    assert code == 0, r["errors"]
    assert (r["completed"], r["failed"]) == (BENCH_PROMPTS, 0)
    assert r["total_output_tokens"] == BENCH_PROMPTS * BENCH_OUT  # EOS ignored: every request runs to the end
    assert 0 < r["ttft_ms"]["median"] < r["e2e_ms"]["median"]
    assert r["tpot_ms"]["median"] > 0 and r["itl_ms"]["median"] > 0
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration_s"])
    assert "Output token throughput (tok/s):" in stdout and "P99 TTFT (ms):" in stdout


def test_bench_serve_reports_the_servers_error(stack: ServiceStack, tmp_path: Path) -> None:
    code, r, _ = bench(stack, tmp_path, "--model", "no-such-model")
    assert code == 1
    assert (r["completed"], r["failed"]) == (0, BENCH_PROMPTS)
    assert any(e.startswith("HTTP 404") and "no-such-model" in e for e in r["errors"]), r["errors"]
