"""The whole stack end to end: every service its own OS process, talking only through Redis.

SmolLM2-135M-Instruct in float32 is checked against transformers' own greedy generation, over
real HTTP (the official openai client) and a real WebSocket client.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator

import openai
import pytest
import torch
import websockets
from service_stack import ServiceStack, standard_stack

from rill.shared.broker import free_port

NEAR_TIE = 2e-3
BLOCK_SIZE = 8  # small blocks: every prompt spans several


@pytest.fixture(scope="module")
def stack(redis_url: str, smollm2_dir: str) -> Iterator[ServiceStack]:
    prefix = f"rille2e-{os.getpid()}-{time.time_ns() % 10**8}"
    port = free_port()
    common = [smollm2_dir, "--redis-url", redis_url, "--prefix", prefix, "--dtype", "float32", "--quantization", "none",
              "--block-size", str(BLOCK_SIZE), "--max-num-batched-tokens", "256", "--max-num-seqs", "32",
              "--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--port", str(port),
              "--host", "127.0.0.1"]
    with standard_stack(redis_url, smollm2_dir, prefix, port, common) as s:
        yield s


def chat_ids(tok, content: str) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                  tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def hf_greedy(model, prompt_ids: list[int], max_new: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def assert_same_or_near_tie(tok, model, prompt_ids: list[int], hf_ids: list[int], ours: str) -> None:
    """Our text must equal transformers' greedy text; where it departs, transformers' own top-2
    logit gap at that position must be a near-tie (< 2e-3), else it is a bug."""
    theirs = tok.decode(hf_ids, skip_special_tokens=True)
    if ours == theirs:
        return
    k = 0  # first HF token whose text is no longer a prefix of ours
    while k < len(hf_ids) and ours.startswith(tok.decode(hf_ids[: k + 1], skip_special_tokens=True)):
        k += 1
    if k == len(hf_ids):
        pytest.fail(f"our text runs on past transformers' output:\n ours={ours!r}\n hf  ={theirs!r}")
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + hf_ids[:k]])).logits[0, -1]
    top2 = torch.topk(logits.float(), 2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE, (f"diverged at output token {k} where transformers' top-2 gap is {gap:.4g} "
                            f"(not a near-tie):\n ours={ours!r}\n hf  ={theirs!r}")


PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle works to a ten year old, step by step.",
    "List ten fruits and describe the colour of each one.",
    "What are the main differences between Python and C? Answer in detail.",
]


def test_greedy_matches_transformers_over_http(stack: ServiceStack, smollm2_hf) -> None:
    tok, model = smollm2_hf
    model_id = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none").models.list().data[0].id

    async def all_at_once() -> list:
        aclient = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="none")
        calls = [aclient.chat.completions.create(model=model_id, messages=[{"role": "user", "content": p}],
                                                 temperature=0, max_tokens=40) for p in PROMPTS]
        try:
            return await asyncio.gather(*calls)
        finally:
            await aclient.close()

    responses = asyncio.run(all_at_once())
    for prompt, resp in zip(PROMPTS, responses, strict=True):
        ids = chat_ids(tok, prompt)
        assert resp.usage.prompt_tokens == len(ids)
        assert resp.usage.completion_tokens >= 32, resp
        hf = hf_greedy(model, ids, resp.usage.completion_tokens)
        assert_same_or_near_tie(tok, model, ids, hf, resp.choices[0].message.content)


def test_a_begun_assistant_reply_is_continued(stack: ServiceStack, smollm2_hf) -> None:
    """continue_final_message: the prompt ends inside the client's begun reply (transformers' ids),
    the output goes on with it greedily as transformers' does, over HTTP and the WebSocket."""
    tok, model = smollm2_hf
    messages = [{"role": "user", "content": "List three rivers of Europe."}, {"role": "assistant", "content": "1. The"}]
    out = tok.apply_chat_template(messages, continue_final_message=True, tokenize=True)
    ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none")
    model_id = client.models.list().data[0].id
    resp = client.chat.completions.create(model=model_id, messages=messages, temperature=0, max_tokens=16,
                                          extra_body={"continue_final_message": True})
    assert resp.usage.prompt_tokens == len(ids)
    assert_same_or_near_tie(tok, model, ids, hf_greedy(model, ids, 16), resp.choices[0].message.content)

    async def over_ws(**extra: object) -> list[dict]:
        async with websockets.connect(stack.ws_url) as ws:
            await ws.send(json.dumps({"type": "chat", "id": "c", "messages": messages, "max_tokens": 16,
                                      "temperature": 0, "continue_final_message": True, **extra}))
            frames = []
            while not frames or frames[-1]["type"] == "delta":
                frames.append(json.loads(await ws.recv()))
            return frames

    frames = asyncio.run(over_ws())
    assert frames[-1]["type"] == "done" and frames[-1]["usage"]["prompt_tokens"] == len(ids)
    assert "".join(f["text"] for f in frames[:-1]) == resp.choices[0].message.content
    assert "".join(f["text"] for f in asyncio.run(over_ws(echo=True))[:-1]) == "1. The" + resp.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(model=model_id, messages=messages, max_tokens=4, extra_body={
            "continue_final_message": True, "add_generation_prompt": True})
    # echo (as vLLM): the reply opens with the begun text, streamed or not; not after a user turn.
    echoed = {"continue_final_message": True, "echo": True}
    full = client.chat.completions.create(model=model_id, messages=messages, temperature=0, max_tokens=16,
                                          extra_body=echoed)
    chunks = client.chat.completions.create(model=model_id, messages=messages, temperature=0, max_tokens=16,
                                            stream=True, extra_body=echoed)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.content == streamed == "1. The" + resp.choices[0].message.content
    question = messages[:1]
    plain, echo = (client.chat.completions.create(model=model_id, messages=question, temperature=0, max_tokens=8,
                                                  extra_body=extra) for extra in ({}, {"echo": True}))
    assert echo.choices[0].message.content == plain.choices[0].message.content


def test_websocket_frames_carry_ids_and_prompt_logprobs(stack: ServiceStack) -> None:
    """return_token_ids, prompt_logprobs and return_tokens_as_token_ids in a frame give what the
    same request over HTTP gives: the ids over the delta frames and in the done frame."""
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none")
    body = {"model": client.models.list().data[0].id, "prompt": "The three rivers of Europe are", "max_tokens": 6,
            "temperature": 0, "logprobs": 1}
    extra = {"return_token_ids": True, "prompt_logprobs": 2, "return_tokens_as_token_ids": True}
    http = client.completions.create(**body, extra_body=extra).model_dump()["choices"][0]

    async def over_ws() -> list[dict]:
        async with websockets.connect(stack.ws_url) as ws:
            await ws.send(json.dumps({"type": "completion", "id": "w", **body, **extra}))
            frames = []
            while not frames or frames[-1]["type"] == "delta":
                frames.append(json.loads(await ws.recv()))
            return frames

    frames = asyncio.run(over_ws())
    done, deltas = frames[-1], frames[:-1]
    assert done["type"] == "done" and done["prompt_token_ids"] == http["prompt_token_ids"]
    assert [t for f in deltas for t in f.get("token_ids", [])] == http["token_ids"]
    assert [lp["token"] for f in deltas for lp in f["logprobs"]] == http["logprobs"]["tokens"]  # "token_id:<id>"
    assert len(done["prompt_logprobs"]) == len(http["prompt_logprobs"]) and done["prompt_logprobs"][0] is None
    for ws_entry, http_entry in zip(done["prompt_logprobs"][1:], http["prompt_logprobs"][1:], strict=True):
        assert ws_entry.keys() == http_entry.keys()
        for t, e in ws_entry.items():
            assert e["rank"] == http_entry[t]["rank"] and abs(e["logprob"] - http_entry[t]["logprob"]) < 1e-4


def test_websocket_echo_opens_each_sample_with_the_prompt(stack: ServiceStack) -> None:
    """echo in a completion frame: each sample's text opens with the prompt's (decoded when the
    prompt is ids), as over HTTP; with logprobs, the done frame has the prompt's."""
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none")
    body = {"model": client.models.list().data[0].id, "max_tokens": 6, "temperature": 0, "echo": True}
    text = "The three rivers of Europe are"
    http = client.completions.create(**body, prompt=text, extra_body={"return_token_ids": True}).model_dump()
    ids = http["choices"][0]["prompt_token_ids"]
    http_ids = client.completions.create(**body, prompt=ids).choices[0].text

    async def over_ws() -> dict[str, list[dict]]:
        async with websockets.connect(stack.ws_url) as ws:
            await ws.send(json.dumps({"type": "completion", "id": "t", **body, "prompt": text, "n": 2}))
            await ws.send(json.dumps({"type": "completion", "id": "i", **body, "prompt": ids, "logprobs": 1}))
            await ws.send(json.dumps({"type": "completion", "id": "x", **body, "prompt": [*ids, 10 ** 6]}))
            frames: dict[str, list[dict]] = {"t": [], "i": [], "x": []}
            while any(not f or f[-1]["type"] == "delta" for f in frames.values()):
                f = json.loads(await ws.recv())
                frames[f["id"]].append(f)
            return frames

    frames = asyncio.run(over_ws())
    assert [f["type"] for f in frames["t"]][-1] == [f["type"] for f in frames["i"]][-1] == "done"
    for i in (0, 1):
        assert "".join(f["text"] for f in frames["t"][:-1] if f.get("index") == i) == http["choices"][0]["text"]
    assert http_ids.startswith(text) and "".join(f["text"] for f in frames["i"][:-1]) == http_ids
    assert frames["x"][-1]["type"] == "error" and frames["x"][-1]["error"]["param"] == "prompt"
    prompt_lps = frames["i"][-1]["prompt_logprobs"]
    assert len(prompt_lps) == len(ids) and prompt_lps[0] is None and all(str(t) in e for t, e in
                                                                         zip(ids[1:], prompt_lps[1:], strict=True))


def test_openai_client_streams_chat(stack: ServiceStack) -> None:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none")
    model = client.models.list().data[0].id
    full = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                          temperature=0, max_tokens=24)
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                            temperature=0, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    assert len(pieces) > 1  # it really streamed
    assert "".join(pieces) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_websocket_two_requests_one_cancelled(stack: ServiceStack) -> None:
    async def scenario() -> dict:
        async with websockets.connect(stack.ws_url) as ws:
            await ws.send(json.dumps({"type": "chat", "id": "long", "max_tokens": 400, "temperature": 0,
                                      "ignore_eos": True,
                                      "messages": [{"role": "user", "content": "Tell me a very long story."}]}))
            await ws.send(json.dumps({"type": "completion", "id": "short", "prompt": "The capital of France is",
                                      "max_tokens": 12, "temperature": 0}))
            frames: dict[str, list[dict]] = {"long": [], "short": []}
            cancelled = False
            while not (frames["long"] and frames["long"][-1]["type"] in ("done", "error")
                       and frames["short"] and frames["short"][-1]["type"] in ("done", "error")):
                msg = json.loads(await asyncio.wait_for(ws.recv(), 120))
                frames[msg["id"]].append(msg)
                if not cancelled and msg["id"] == "long" and msg["type"] == "delta":
                    await ws.send(json.dumps({"type": "cancel", "id": "long"}))
                    cancelled = True
            return frames

    frames = asyncio.run(scenario())
    assert frames["short"][-1]["type"] == "done" and frames["short"][-1]["finish_reason"] == "length"
    assert frames["short"][-1]["usage"]["completion_tokens"] == 12
    assert "".join(f["text"] for f in frames["short"] if f["type"] == "delta").strip()
    assert frames["long"][-1]["type"] == "done" and frames["long"][-1]["finish_reason"] == "abort"
    long_tokens = sum(1 for f in frames["long"] if f["type"] == "delta")
    assert long_tokens < 400
    st = stack.wait_idle()
    assert st.num_running == 0 and st.num_free_blocks == st.num_blocks
    assert st.aborted_requests >= 1


def test_sixteen_concurrent_requests(stack: ServiceStack, smollm2_hf) -> None:
    tok, model = smollm2_hf
    topics = ["the sea", "mountains", "a robot", "coffee", "trains", "winter", "music", "a cat",
              "the moon", "gardening", "chess", "rain", "a library", "volcanoes", "bread", "friendship"]
    jobs = [(f"Write {'a few sentences' if i % 3 else 'one sentence'} about {t}." + " Be vivid." * (i % 5),
             6 + (i * 7) % 27) for i, t in enumerate(topics)]
    before = stack.wait_idle()  # stats trail the outputs by a step: count from an idle engine

    async def run_all() -> list:
        aclient = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0)
        model_id = (await aclient.models.list()).data[0].id
        try:
            return await asyncio.gather(*[
                aclient.chat.completions.create(model=model_id, messages=[{"role": "user", "content": p}],
                                                temperature=0, max_tokens=n) for p, n in jobs])
        finally:
            await aclient.close()

    responses = asyncio.run(run_all())
    for i, ((prompt, n), resp) in enumerate(zip(jobs, responses, strict=True)):
        ids = chat_ids(tok, prompt)
        choice = resp.choices[0]
        assert resp.usage.prompt_tokens == len(ids)
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "length":
            assert resp.usage.completion_tokens == n
        if i % 4 == 1:  # a quarter against transformers (test_greedy_matches_... checks a whole batch)
            hf = hf_greedy(model, ids, resp.usage.completion_tokens)
            assert_same_or_near_tie(tok, model, ids, hf, choice.message.content)
    st = stack.wait_idle()
    assert st.mixed_steps > before.mixed_steps, "no step mixed prefill and decode work"
    assert st.num_running == 0 and st.num_waiting == 0
    assert st.num_free_blocks == st.num_blocks, "KV blocks leaked"


def test_bad_input_gets_openai_errors_and_stack_survives(stack: ServiceStack) -> None:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=model, prompt="hi " * 3000, max_tokens=5)
    assert "maximum context length" in str(too_long.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], temperature=-1)
    ok = client.completions.create(model=model, prompt="One, two, three,", max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens == 4


def test_each_service_is_its_own_process(stack: ServiceStack) -> None:
    pids = {name: p.pid for name, p in stack.procs.items()}
    assert len(set(pids.values())) == 5
    assert all(p.poll() is None for p in stack.procs.values()), "a service died during the tests"
    # The services found each other only through the broker: their streams exist under our prefix.
    keys = {k.decode() for k in stack.redis.scan_iter(match=f"{stack.streams.prefix}:*")}
    for stream in (*stack.requests_streams(), stack.streams.engine_in(0), stack.streams.plan(0),
                   stack.streams.result(0), stack.streams.detok(0)):
        assert stream in keys
