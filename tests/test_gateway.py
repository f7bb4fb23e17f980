"""Gateway tests against real Redis and a real uvicorn server; the test plays the downstream services.

The test reads GenerateRequests from the requests stream and answers on the gateway's reply
stream with ReplyBatch / ErrorReply messages, out of order and with duplicates, as scaled-out
detokenizer replicas would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from service_stack import SentRequests
from websockets.asyncio.client import ClientConnection, connect

from rill.services.gateway.app import create_app
from rill.services.gateway.gateway import BROKER_FAILED_OVER, BROKER_RESTARTED, Gateway
from rill.services.gateway.request_tracker import DeltaSequencer, RequestTracker
from rill.services.gateway.responses import GENERATION_FAILED
from rill.shared.bus import FIELD
from rill.shared.heartbeat import Heartbeat
from rill.shared.request_params import sample_request_id
from rill.shared.schema import (
    ENGINE_LOST_PREFIX,
    EngineStats,
    ErrorReply,
    GenerateRequest,
    ReplyBatch,
    Routed,
    TextDelta,
    encode,
    engine_input_decoder,
    generate_decoder,
)
from rill.shared.streams import Streams

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
MODEL = "test-model"
MAX_LEN = 2048

# ---------------------------------------------------------------------------------------------
# Harness


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """create_app served by uvicorn in a background thread, on a free port and its own prefix;
    `options` go to create_app (e.g. ignore_unknown_fields=True)."""

    def __init__(self, prefix: str, **options: Any) -> None:
        self.prefix = prefix
        self.port = _free_port()
        self.app = create_app(REDIS_URL, prefix, MODEL, MAX_LEN, **options)
        self.gateway = self.app.state.gateway
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "gateway did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@contextlib.contextmanager
def serving(**options: Any) -> Iterator[LiveServer]:
    """A started LiveServer on a fresh prefix, stopped and its keys deleted afterwards."""
    prefix = f"test-gw-{uuid.uuid4().hex[:10]}"
    srv = LiveServer(prefix, **options)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        r = redis.Redis.from_url(REDIS_URL)
        keys = list(r.scan_iter(match=f"{prefix}:*"))
        if keys:
            r.delete(*keys)
        r.close()


@pytest.fixture
def server() -> Iterator[LiveServer]:
    with serving() as srv:
        yield srv


class Downstream:
    """Plays tokenizer + detokenizer: reads GenerateRequests, writes replies, watches aborts."""

    def __init__(self, prefix: str, url: str = REDIS_URL) -> None:
        self.streams = Streams(prefix)
        self.r = aioredis.Redis.from_url(url, decode_responses=False)
        self.sent = SentRequests(self.r, self.streams)
        self.abort_last: dict[int, bytes] = {}

    async def next_request(self, timeout: float = 5.0) -> GenerateRequest:
        return generate_decoder.decode(await self.sent.next(timeout))

    async def num_requests(self) -> int:
        return await self.sent.count()

    async def reply(self, reply_to: str, deltas: list[TextDelta]) -> None:
        await self.r.xadd(reply_to, {FIELD: encode(ReplyBatch(deltas=deltas))})

    async def routed(self, req: GenerateRequest, engine: int) -> None:
        await self.r.xadd(req.reply_to, {FIELD: encode(Routed(req.request_id, engine))})

    async def error(self, req: GenerateRequest, message: str, status: int = 400, param: str | None = None) -> None:
        await self.r.xadd(req.reply_to, {FIELD: encode(ErrorReply(req.request_id, message, status=status,
                                                                  param=param))})

    async def aborted_ids(self, engine: int = 0, timeout: float = 5.0) -> list[str]:
        """Request ids of the next AbortRequest on an engine's input stream."""
        stream = self.streams.engine_in(engine)
        resp = await self.r.xread({stream: self.abort_last.get(engine, b"0-0")}, count=1,
                                  block=int(timeout * 1000))
        assert resp, f"no abort reached engine {engine}"
        entry_id, fields = resp[0][1][0]
        self.abort_last[engine] = entry_id
        msg = engine_input_decoder.decode(fields[FIELD])
        return msg.request_ids

    async def close(self) -> None:
        await self.r.aclose()


@pytest.fixture
async def down(server: LiveServer) -> AsyncIterator[Downstream]:
    d = Downstream(server.prefix)
    yield d
    await d.close()


def make_deltas(request_id: str, pieces: list[str], finish: str = "stop", prompt_tokens: int = 7,
                cached_tokens: int = 0) -> list[TextDelta]:
    """One delta per piece; piece i covers 1 or 2 tokens so offsets are not simply indexes."""
    out, off = [], 0
    for i, text in enumerate(pieces):
        n = 1 + i % 2
        last = i == len(pieces) - 1
        out.append(TextDelta(request_id, off, n, text, finish if last else None, prompt_tokens, off + n,
                             cached_tokens=cached_tokens if i == 0 else 0))
        off += n
    return out


def scramble(deltas: list[TextDelta], seed: int) -> list[list[TextDelta]]:
    """Shuffled, with about half of the deltas sent twice, split into batches of 1-3."""
    rng = random.Random(seed)
    items = deltas + rng.sample(deltas, k=len(deltas) // 2 + 1)
    rng.shuffle(items)
    batches = []
    while items:
        k = rng.randint(1, 3)
        batches.append(items[:k])
        items = items[k:]
    return batches


PIECES = ["Hel", "lo", "", ", wor", "ld", " — ", "ünï", "cödé", " 🙂", "\n", "end."]
EXPECTED = "".join(PIECES)
NUM_TOKENS = sum(1 + i % 2 for i in range(len(PIECES)))


async def send_scrambled(down: Downstream, req: GenerateRequest, pieces: list[str] = PIECES,
                         finish: str = "stop", seed: int = 0) -> None:
    for batch in scramble(make_deltas(req.request_id, pieces, finish), seed):
        await down.reply(req.reply_to, batch)


def oai(server: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=10)


def sse_events(raw: str) -> list[str]:
    return [block[len("data: "):] for block in raw.split("\n\n") if block.startswith("data: ")]


# ---------------------------------------------------------------------------------------------
# (4) Pure logic: the sequencer and the tracker


def test_sequencer_orders_and_dedups() -> None:
    d = make_deltas("r", ["a", "b", "c", "d"])  # offsets 0, 1, 3, 4
    seq = DeltaSequencer()
    assert seq.push(d[1]) == []  # early: held back
    assert seq.push(d[3]) == []
    assert seq.push(d[0]) == [d[0], d[1]]  # fills the gap, flushes the contiguous run
    assert seq.push(d[0]) == []  # duplicate
    assert seq.push(d[1]) == []
    assert seq.push(d[2]) == [d[2], d[3]]
    assert seq.finished and seq.next_offset == 6
    assert seq.push(TextDelta("r", 6, 1, "late")) == []  # nothing after the finish


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=4), min_size=1, max_size=12), st.randoms(use_true_random=False),
       st.integers(0, 20))
def test_sequencer_exactly_once_any_order(pieces: list[str], rng: random.Random, dups: int) -> None:
    deltas = make_deltas("r", pieces)
    arrivals = deltas + [rng.choice(deltas) for _ in range(dups)]
    rng.shuffle(arrivals)
    seq = DeltaSequencer()
    released = [x for d in arrivals for x in seq.push(d)]
    assert released == deltas  # every delta once, in offset order, finish last
    assert "".join(x.text for x in released) == "".join(pieces)


async def test_tracker_routes_batches_errors_and_cancels() -> None:
    tr = RequestTracker()
    a, b, c = tr.register("a"), tr.register("b"), tr.register("c")
    with pytest.raises(KeyError):
        tr.register("a")
    da = make_deltas("a", ["x", "y", "z"])
    tr.dispatch(ReplyBatch([da[2], TextDelta("unknown", 0, 1, "?"), da[0]]))
    tr.dispatch(ErrorReply("b", "prompt too long", param="input_tokens"))
    tr.dispatch(ReplyBatch([da[1], da[1]]))
    assert "a" not in tr and "b" not in tr and len(tr) == 1  # finished / failed ones are forgotten
    tr.dispatch(ReplyBatch([TextDelta("a", 4, 1, "late")]))  # ignored after the finish

    got = [ev for batch in [x async for x in a] for ev in batch]
    assert [d.text for d in got] == ["x", "y", "z"] and got[-1].finish_reason == "stop"
    errs = [ev for batch in [x async for x in b] for ev in batch]
    assert len(errs) == 1 and isinstance(errs[0], ErrorReply) and errs[0].param == "input_tokens"

    async def consume() -> list[list]:
        return [x async for x in c]

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.01)
    assert tr.unregister("c") and not tr.unregister("c")
    assert await asyncio.wait_for(task, 1) == []  # a cancelled stream just ends
    tr.dispatch(ReplyBatch(make_deltas("c", ["ignored"])))  # unknown by now: no error


async def test_tracker_buffered_stream_starts_over_unseen() -> None:
    """A non-streaming (buffered) request hands out nothing before its end, however its consumer
    is timed, so an engine-lost error after tokens may still send it again: what the old engine
    id brought is dropped, and the consumer gets the new attempt only."""
    tr = RequestTracker()
    tr.resend = lambda stream, err: (tr.renew(stream, "r~1"), True)[1]
    r = tr.register("r", buffered=True)
    old = make_deltas("r", ["stale", "x"])
    tr.dispatch(ReplyBatch(old[:1]))  # before the consumer first looks
    task = asyncio.create_task(anext(aiter(r)))
    await asyncio.sleep(0.01)
    assert not task.done() and r.started
    tr.dispatch(ErrorReply("r", "engine lost", status=503))
    assert "r" in tr and not r.started and "r" in tr.waiting  # started over, waiting again
    tr.dispatch(ReplyBatch(old[1:]))  # the old id: no longer routed
    new = make_deltas("r~1", ["a", "b"])
    tr.dispatch(ReplyBatch(new[:1]))
    await asyncio.sleep(0.01)
    assert not task.done()
    tr.dispatch(ReplyBatch(new[1:]))
    assert [d.text for d in await asyncio.wait_for(task, 1)] == ["a", "b"]


# ---------------------------------------------------------------------------------------------
# (1) Validation and plain endpoints

CHAT_OK = {"messages": [{"role": "user", "content": "hi"}]}
BAD_REQUESTS = [
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": ["hi"]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0]"),
    ("/v1/chat/completions", {**CHAT_OK, "temperature": 2.5}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT_OK, "temperature": -0.1}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT_OK, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT_OK, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {**CHAT_OK, "top_p": 1.01}, 400, "top_p"),
    ("/v1/chat/completions", {**CHAT_OK, "top_k": -2}, 400, "top_k"),
    ("/v1/chat/completions", {**CHAT_OK, "top_k": 1.5}, 400, "top_k"),
    ("/v1/chat/completions", {**CHAT_OK, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT_OK, "max_tokens": True}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT_OK, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT_OK, "n": 129}, 400, "n"),
    ("/v1/chat/completions", {**CHAT_OK, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {**CHAT_OK, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/chat/completions", {**CHAT_OK, "frequency_penalty": -2.01}, 400, "frequency_penalty"),
    ("/v1/chat/completions", {**CHAT_OK, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/chat/completions", {**CHAT_OK, "min_p": 1.5}, 400, "min_p"),
    ("/v1/chat/completions", {**CHAT_OK, "logit_bias": {"12": 101}}, 400, "logit_bias"),
    ("/v1/chat/completions", {**CHAT_OK, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {**CHAT_OK, "logit_bias": [1, 2]}, 400, "logit_bias"),
    ("/v1/chat/completions", {**CHAT_OK, "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT_OK, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT_OK, "logprobs": 3}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, 400, "echo"),
    ("/v1/chat/completions", {**CHAT_OK, "stop": ["s"] * 17}, 400, "stop"),
    ("/v1/chat/completions", {**CHAT_OK, "stop": [1]}, 400, "stop[0]"),
    ("/v1/chat/completions", {**CHAT_OK, "stop_token_ids": [-1]}, 400, "stop_token_ids[0]"),
    ("/v1/chat/completions", {**CHAT_OK, "ignore_eos": "yes"}, 400, "ignore_eos"),
    ("/v1/chat/completions", {**CHAT_OK, "seed": 2**70}, 400, "seed"),
    ("/v1/chat/completions", {**CHAT_OK, "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ("/v1/chat/completions", {**CHAT_OK, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {**CHAT_OK, "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", [CHAT_OK], 400, None),
    ("/v1/chat/completions", {**CHAT_OK, "model": "other-model"}, 404, "model"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, -2]}, 400, "prompt[1]"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [2**40]}, 400, "prompt[0]"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**30}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "model": 3}, 400, "model"),
]


async def test_validation_errors_are_openai_json(server: LiveServer, down: Downstream) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
        for path, body, status, param in BAD_REQUESTS:
            r = await c.post(path, json=body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, r.text
            assert err["param"] == param and err["message"], (body, err)
            if status == 400:
                assert err["type"] == "invalid_request_error"
        r = await c.post("/v1/chat/completions", json={**CHAT_OK, "model": "nope"})
        assert r.json()["error"]["message"] == "The model `nope` does not exist."

        for raw in (b"{not json", b"", b"[1,", b'{"prompt": 1e400}'):
            r = await c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"

        r = await c.get("/v1/completions")
        assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]
        r = await c.post("/v1/models")
        assert r.status_code == 405 and r.json()["error"]["code"] is None
        r = await c.get("/v1/nope")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"

        # Nothing invalid reached the tokenizers, and the server still serves.
        assert await down.num_requests() == 0
        assert (await c.get("/health")).json() == {"status": "ok"}


async def test_request_translation(server: LiveServer, down: Downstream) -> None:
    """Accepted bodies become the GenerateRequest the tokenizer expects; metadata (`user`) is ignored."""
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
        chat = asyncio.create_task(c.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None}],
            "max_tokens": 5, "max_completion_tokens": 9, "temperature": 0, "top_p": 0.5, "top_k": -1,
            "seed": 42, "stop": "END", "stop_token_ids": [7], "ignore_eos": True, "n": 1, "user": "u",
            "logit_bias": {}, "frequency_penalty": 0}))
        req = await down.next_request()
        assert req.kind == "chat" and req.request_id.startswith("chatcmpl-")
        assert req.reply_to == server.gateway.reply_stream
        assert [(m.role, m.content) for m in req.messages] == [("system", "Be brief."), ("user", "a\nb"),
                                                               ("assistant", "")]
        p = req.params
        assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (9, 0.0, 0.5, 0, 42)
        assert (p.stop, p.stop_token_ids, p.ignore_eos) == (["END"], [7], True)
        assert abs(req.arrival_time - time.time()) < 5
        await down.reply(req.reply_to, make_deltas(req.request_id, ["ok"]))
        assert (await chat).json()["choices"][0]["message"]["content"] == "ok"

        comp = asyncio.create_task(c.post("/v1/completions", json={"prompt": [[1, 2, 3]], "top_k": 4}))
        req = await down.next_request()
        assert req.kind == "completion" and req.request_id.startswith("cmpl-")
        assert req.prompt == [1, 2, 3] and req.messages is None
        assert req.params.max_tokens is None and req.params.top_k == 4  # the tokenizer resolves max_tokens
        await down.reply(req.reply_to, make_deltas(req.request_id, ["!"], finish="length"))
        body = (await comp).json()
        assert body["choices"][0] == {"index": 0, "text": "!", "logprobs": None, "finish_reason": "length"}


async def test_models_health_stats(server: LiveServer, down: Downstream) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
        models = (await c.get("/v1/models")).json()
        assert models["object"] == "list"
        card = models["data"][0]
        assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == (
            MODEL, "model", "rill", MAX_LEN)
        ids = [m.id async for m in oai(server).models.list()]
        assert ids == [MODEL]
        assert (await oai(server).models.retrieve(MODEL)).max_model_len == MAX_LEN  # type: ignore[attr-defined]
        with pytest.raises(openai.NotFoundError) as missing:
            await oai(server).models.retrieve("org/other-model")
        assert missing.value.code == "model_not_found" and "org/other-model" in missing.value.message

        assert (await c.get("/stats")).json() == {"engines": []}  # no scheduler wrote stats yet
        none = await c.get("/tokenizer_info")  # no tokenizer replica beats here
        assert none.status_code == 503 and "tokenizer" in none.json()["error"]["message"]
        s = Streams(server.prefix)
        await down.r.sadd(s.engines_key(), 0, 1)
        await down.r.set(s.stats_key(0), encode(EngineStats(0, num_running=3, num_blocks=100,
                                                            num_free_blocks=40, block_size=16)))
        await down.r.set(s.stats_key(1), encode(EngineStats(1, num_waiting=2)))
        engines = (await c.get("/stats")).json()["engines"]
        assert [e["engine_id"] for e in engines] == [0, 1]
        assert (engines[0]["num_blocks"], engines[0]["num_free_blocks"], engines[0]["num_running"]) == (100, 40, 3)
        assert engines[1]["num_waiting"] == 2

        assert (await c.get("/health")).status_code == 200
        gw = server.gateway
        real = gw.bus.r
        gw.bus.r = aioredis.Redis.from_url("redis://127.0.0.1:1")  # a port nothing listens on
        try:
            r = await c.get("/health")
            assert r.status_code == 503
        finally:
            gw.bus.r = real
        assert (await c.get("/health")).status_code == 200


# ---------------------------------------------------------------------------------------------
# (2) Replies through HTTP: exactly once, in order


async def test_chat_non_streaming_exactly_once(server: LiveServer, down: Downstream) -> None:
    task = asyncio.create_task(oai(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=50))
    req = await down.next_request()
    await send_scrambled(down, req, seed=1)
    resp = await task
    assert resp.id == req.request_id and resp.object == "chat.completion" and resp.model == MODEL
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == EXPECTED
    assert choice.finish_reason == "stop"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (
        7, NUM_TOKENS, 7 + NUM_TOKENS)
    assert req.request_id not in server.gateway.tracker


async def test_chat_streaming_exactly_once(server: LiveServer, down: Downstream) -> None:
    task = asyncio.create_task(oai(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True}))
    req = await down.next_request()
    await send_scrambled(down, req, seed=2)
    stream = await task
    chunks = [c async for c in stream]
    assert all(c.id == req.request_id and c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == EXPECTED
    assert all(c.choices[0].delta.content != "" for c in with_choices[1:])  # empty deltas skipped
    assert [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason] == ["stop"]
    assert with_choices[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NUM_TOKENS
    assert chunks[-1].usage.prompt_tokens == 7


async def test_completion_streaming_and_plain(server: LiveServer, down: Downstream) -> None:
    client = oai(server)
    task = asyncio.create_task(client.completions.create(model=MODEL, prompt="Once", stream=True))
    req = await down.next_request()
    await send_scrambled(down, req, finish="length", seed=3)
    chunks = [c async for c in await task]
    assert all(c.object == "text_completion" and c.id == req.request_id for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == EXPECTED
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])

    task = asyncio.create_task(client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=20))
    req = await down.next_request()
    await send_scrambled(down, req, seed=4)
    resp = await task
    assert resp.object == "text_completion" and resp.choices[0].text == EXPECTED
    assert resp.usage.completion_tokens == NUM_TOKENS


async def test_responses_name_the_engine_that_served_them(server: LiveServer, down: Downstream) -> None:
    """x-rill-engine: the engine the tokenizer routed the request to (Routed), streamed or not;
    absent when no engine was named."""
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
        for body, engine in (({"prompt": "x"}, 3), ({"prompt": "x", "stream": True}, 1), ({"prompt": "x"}, None)):
            post = asyncio.create_task(c.post("/v1/completions", json=body))
            req = await down.next_request()
            if engine is not None:
                await down.routed(req, engine)
            await send_scrambled(down, req, seed=5)
            r = await post
            assert r.status_code == 200 and r.headers.get("x-rill-engine") == (None if engine is None else str(engine))


async def test_stream_is_incremental(server: LiveServer, down: Downstream) -> None:
    """Text reaches the client as it arrives, not at the end; the tail comes in offset order."""
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
        post = c.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True})
        task = asyncio.create_task(post.__aenter__())
        req = await down.next_request()
        d = make_deltas(req.request_id, ["one", " two", " three"])
        await down.reply(req.reply_to, [d[0]])
        resp = await task
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = resp.aiter_lines()
        first = await anext(lines)
        assert json.loads(first[len("data: "):])["choices"][0]["text"] == "one"
        await down.reply(req.reply_to, [d[2], d[1]])
        rest = [line async for line in lines]
        await post.__aexit__(None, None, None)
    events = [line[len("data: "):] for line in rest if line.startswith("data: ")]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == [" two", " three"]
    assert events[-1] == "[DONE]"


async def test_error_reply_becomes_http_error(server: LiveServer, down: Downstream) -> None:
    client = oai(server)
    msg = "This model's maximum context length is 2048 tokens. However, your request has 3000 input tokens."
    task = asyncio.create_task(client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                                       "content": "x"}]))
    req = await down.next_request()
    await down.error(req, msg, param="input_tokens")
    with pytest.raises(openai.BadRequestError) as exc:
        await task
    assert exc.value.status_code == 400
    assert exc.value.body == {"message": msg, "type": "invalid_request_error", "param": "input_tokens",
                              "code": None}

    # Streaming: an error before the first token is still a plain JSON error response.
    task = asyncio.create_task(client.completions.create(model=MODEL, prompt="x", stream=True))
    req = await down.next_request()
    await down.error(req, "too long", param="max_tokens")
    with pytest.raises(openai.BadRequestError):
        await task

    # After streaming began, the error is an SSE event followed by [DONE].
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
        post = asyncio.create_task(c.post("/v1/chat/completions", json={**CHAT_OK, "stream": True}))
        req = await down.next_request()
        await down.reply(req.reply_to, make_deltas(req.request_id, ["a", "b"])[:1])
        await asyncio.sleep(0.05)
        await down.error(req, "engine failed", status=500)
        r = await post
    events = sse_events(r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2]) == {"error": {"message": "engine failed", "type": "invalid_request_error",
                                                "param": None, "code": None}}
    assert json.loads(events[1])["choices"][0]["delta"] == {"content": "a"}


def completion_text(raw: str) -> str:
    return "".join(c.get("text", "") for e in sse_events(raw) if e != "[DONE]" for c in json.loads(e).get("choices", []))


async def test_request_lost_with_its_engine_unseen_is_sent_again_once(server: LiveServer,
                                                                             down: Downstream) -> None:
    """An engine-lost error (503, ENGINE_LOST_PREFIX) before anything was released: the gateway
    sends the request again under a new engine id, aborts the old id, drops what the old id still
    brings, and the client sees only the new answer; likewise a non-streaming request lost after
    tokens (its client saw none of them). Lost twice, lost after a streamed token, or any other
    error: the client gets the error and nothing is sent again."""
    await down.r.sadd(Streams(server.prefix).engines_key(), 0)
    lost = f"{ENGINE_LOST_PREFIX}: engine 1 stopped while it ran this request"
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
        post = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x", "stream": True}))
        req = await down.next_request()
        await down.routed(req, 1)
        await asyncio.sleep(0.1)
        await down.error(req, lost, status=503)
        again = await down.next_request()
        assert again.request_id != req.request_id and (again.prompt, again.reply_to) == (req.prompt, req.reply_to)
        assert (req.avoid_engine, again.avoid_engine) == (-1, 1)  # the tokenizers pick another engine
        assert await down.aborted_ids(0) == [req.request_id]
        await down.reply(req.reply_to, make_deltas(req.request_id, ["stale"], finish="length"))
        await send_scrambled(down, again, seed=3)
        r = await post
        assert r.status_code == 200 and completion_text(r.text) == EXPECTED

        twice = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x"}))
        req = await down.next_request()
        await down.error(req, lost, status=503)
        await down.error(await down.next_request(), lost, status=503)
        r = await twice
        assert r.status_code == 503 and r.json()["error"]["message"] == lost

        started = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x", "stream": True}))
        req = await down.next_request()
        await down.reply(req.reply_to, make_deltas(req.request_id, ["a", "b"])[:1])
        await asyncio.sleep(0.1)
        await down.error(req, lost, status=503)
        r = await started
        assert completion_text(r.text) == "a" and json.loads(sse_events(r.text)[-2])["error"]["message"] == lost

        buffered = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x"}))
        req = await down.next_request()
        await down.reply(req.reply_to, make_deltas(req.request_id, ["a", "b"])[:1])
        await asyncio.sleep(0.1)
        await down.error(req, lost, status=503)
        again = await down.next_request()
        await down.reply(req.reply_to, make_deltas(req.request_id, ["a", "b"])[1:])  # the old id: dropped
        await send_scrambled(down, again, seed=4)
        r = await buffered
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == EXPECTED

        other = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x"}))
        await down.error(await down.next_request(), "the server is overloaded", status=503)
        assert (await other).status_code == 503
    await asyncio.sleep(0.2)
    assert await down.num_requests() == 8  # 2 + 2 + 1 + 2 + 1: the first, second and fourth were sent again
    assert 'rill:requests_resent_total{model_name="test-model"} 3.0' in httpx.get(f"{server.url}/metrics").text


async def test_batched_prompts_fan_out_and_merge(server: LiveServer, down: Downstream) -> None:
    """A list of prompts is one request per prompt; the reply lists prompt i's n choices from index
    i * n (as OpenAI), streamed or not, with the usage summed. One prompt refused fails the batch and
    aborts the others; a batch the admission cap could never take is a 400."""
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
        for stream in (False, True):
            body = {"prompt": ["x", [5, 6]], "n": 2, "stream": stream,
                    **({"stream_options": {"include_usage": True}} if stream else {})}
            post = asyncio.create_task(c.post("/v1/completions", json=body))
            reqs = [await down.next_request() for _ in range(2)]
            ids = [r.request_id for r in reqs]
            assert ids[0].endswith("-0") and ids[1] == ids[0][:-1] + "1" and [r.prompt for r in reqs] == ["x", [5, 6]]
            await down.routed(reqs[0], 1)
            await down.routed(reqs[1], 0)
            for p, req in enumerate(reversed(reqs)):  # the second prompt answers first
                for i in range(2):
                    sample = sample_request_id(req.request_id, i, 2)
                    await down.reply(req.reply_to, make_deltas(sample, [f"{req.prompt}/{i}", "!"], prompt_tokens=3 + p,
                                                               cached_tokens=(2 + p) * (i + 1)))
            r = await post
            assert r.status_code == 200 and r.headers["x-rill-engine"] == "1,0"  # each prompt's engine
            if stream:
                chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
                texts = {i: "".join(ch["text"] for c in chunks for ch in c["choices"] if ch["index"] == i)
                         for i in range(4)}
                usage = chunks[-1]["usage"]
                assert {c["id"] for c in chunks} == {ids[0][:-2]}
            else:
                texts = {ch["index"]: ch["text"] for ch in r.json()["choices"]}
                usage = r.json()["usage"]
            assert texts == {0: "x/0!", 1: "x/1!", 2: "[5, 6]/0!", 3: "[5, 6]/1!"}
            # Cached tokens as each prompt's sample 0 found them (2 and 3), summed over the prompts.
            assert usage == {"prompt_tokens": 7, "completion_tokens": 12, "total_tokens": 19,
                             "prompt_tokens_details": {"cached_tokens": 5}}

        post = asyncio.create_task(c.post("/v1/completions", json={"prompt": ["x", "y"], "stream": True}))
        reqs = [await down.next_request() for _ in range(2)]
        await down.error(reqs[1], "prompt too long", param="prompt")
        r = await post
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert await down.aborted_ids(0) == [reqs[0].request_id]
    with serving(max_waiting_requests=2) as small:
        r = httpx.post(f"{small.url}/v1/completions", json={"prompt": ["a", "b", "c"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "3 prompts" in r.text


def test_published_keys_are_written_again_only_when_gone() -> None:
    """A heartbeat's published key (the tokenizers' /tokenizer_info) is refreshed each beat, not
    rewritten: written at the first beat and again only after the broker lost it."""
    key = f"test-published-{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(REDIS_URL)
    beat = Heartbeat(REDIS_URL, f"{key}:hb", published=[(key, b"info")]).start()
    try:
        assert r.get(key) == b"info" and 0 < r.ttl(key) <= beat.ttl_s
        r.set(key, b"other", ex=1)  # a peer's value (the same, in a deployment): kept, TTL refreshed
        assert beat.beat() and r.get(key) == b"other" and r.ttl(key) > 1
        r.delete(key)  # lost with a broker restart
        assert beat.beat() and r.get(key) == b"info"
    finally:
        beat.stop()
        r.delete(key)
        r.close()


async def test_failed_sample_fails_its_request_at_once(server: LiveServer, down: Downstream) -> None:
    """A non-streaming n=2 request whose sample 0 fails answers 500 without waiting for sample 1,
    aborts the request (so sample 1 stops running), and counts once, as an error; a WebSocket
    request's error frame likewise aborts its other sample."""
    await down.r.sadd(Streams(server.prefix).engines_key(), 0)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
        post = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x", "n": 2}))
        req = await down.next_request()
        await down.reply(req.reply_to, make_deltas(sample_request_id(req.request_id, 1, 2), ["a"], finish=None))
        await down.reply(req.reply_to, make_deltas(sample_request_id(req.request_id, 0, 2), ["b"], finish="error"))
        r = await asyncio.wait_for(post, 5)
        assert r.status_code == 500 and r.json()["error"]["message"] == GENERATION_FAILED
        assert await down.aborted_ids(0) == [req.request_id]
    async with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as ws:  # likewise on the WebSocket
        await ws.send(json.dumps({"type": "completion", "id": "w", "prompt": "x", "n": 2}))
        req = await down.next_request()
        await down.reply(req.reply_to, make_deltas(sample_request_id(req.request_id, 0, 2), ["b"], finish="error"))
        frames = [json.loads(await asyncio.wait_for(ws.recv(), 5)) for _ in range(2)]
        assert frames[0]["type"] == "delta" and frames[1]["type"] == "error"
        assert await down.aborted_ids(0) == [req.request_id]
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'rill:request_success_total{finished_reason="error",model_name="test-model"} 2.0' in metrics
    assert 'rill:request_success_total{finished_reason="abort",model_name="test-model"} 0.0' in metrics


async def test_disconnect_aborts(server: LiveServer, down: Downstream) -> None:
    s = Streams(server.prefix)
    await down.r.sadd(s.engines_key(), 0, 3)  # aborts go to every serving engine
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
        # An SSE client that leaves mid-stream.
        post = c.stream("POST", "/v1/chat/completions", json={**CHAT_OK, "stream": True})
        task = asyncio.create_task(post.__aenter__())
        req = await down.next_request()
        await down.reply(req.reply_to, make_deltas(req.request_id, ["a", "b", "c"])[:1])
        resp = await task
        assert "assistant" in await anext(resp.aiter_lines())
        await post.__aexit__(None, None, None)  # closes the connection before the finish
        assert await down.aborted_ids(0) == [req.request_id]
        assert await down.aborted_ids(3) == [req.request_id]
        assert req.request_id not in server.gateway.tracker

        # A non-streaming client that gives up while waiting.
        with pytest.raises(httpx.ReadTimeout):
            waiting = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x"}, timeout=1.0))
            req2 = await down.next_request()
            await waiting
        assert await down.aborted_ids(0) == [req2.request_id]

        # A request that finished normally is not aborted.
        ok = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x", "stream": True}))
        req3 = await down.next_request()
        await send_scrambled(down, req3, seed=5)
        assert (await ok).status_code == 200
    await asyncio.sleep(0.2)
    assert await down.r.xlen(s.engine_in(0)) == 2


# ---------------------------------------------------------------------------------------------
# (3) WebSocket


async def ws_recv(ws: ClientConnection, timeout: float = 5.0) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def ws_collect(ws: ClientConnection, ids: set, timeout: float = 5.0) -> dict[object, list[dict]]:
    """Frames per id until every id in `ids` got its done or error frame."""
    frames: dict[object, list[dict]] = {}
    open_ids = set(ids)
    while open_ids:
        f = await ws_recv(ws, timeout)
        frames.setdefault(f["id"], []).append(f)
        if f["type"] in ("done", "error"):
            open_ids.discard(f["id"])
    return frames


def ws_url(server: LiveServer) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/ws"


async def test_ws_concurrent_cancel_and_complete(server: LiveServer, down: Downstream) -> None:
    async with connect(ws_url(server)) as ws:
        await ws.send(json.dumps({"type": "chat", "id": "c1", "messages": [{"role": "user", "content": "a"}],
                                  "temperature": 0}))
        await ws.send(json.dumps({"type": "completion", "id": "c2", "prompt": "b", "max_tokens": 30}))
        reqs = {}
        for _ in range(2):
            r = await down.next_request()
            reqs[r.kind] = r
        r1, r2 = reqs["chat"], reqs["completion"]
        assert r1.request_id.endswith("-c1") and r2.request_id.endswith("-c2")
        assert r1.request_id.startswith("ws-") and r1.request_id != "c1"

        d1 = make_deltas(r1.request_id, ["x", "y", "z"])
        await down.reply(r1.reply_to, [d1[0]])
        f = await ws_recv(ws)
        assert f == {"id": "c1", "type": "delta", "text": "x"}

        await ws.send(json.dumps({"type": "cancel", "id": "c1"}))
        assert await down.aborted_ids(0) == [r1.request_id]
        f = await ws_recv(ws)
        assert (f["id"], f["type"], f["finish_reason"]) == ("c1", "done", "abort")
        assert f["usage"]["completion_tokens"] == 1
        await ws.send(json.dumps({"type": "cancel", "id": "c1"}))  # repeated cancel: ignored

        # Late deltas of the cancelled request must not leak; the other one completes exactly once.
        await down.reply(r1.reply_to, d1[1:])
        await send_scrambled(down, r2, seed=6)
        frames = await ws_collect(ws, {"c2"})
        assert set(frames) == {"c2"}
        c2 = frames["c2"]
        assert "".join(f["text"] for f in c2 if f["type"] == "delta") == EXPECTED
        assert c2[-1] == {"id": "c2", "type": "done", "finish_reason": "stop",
                          "usage": {"prompt_tokens": 7, "completion_tokens": NUM_TOKENS,
                                    "total_tokens": 7 + NUM_TOKENS, "prompt_tokens_details": {"cached_tokens": 0}}}
        assert all(f["text"] for f in c2 if f["type"] == "delta")

        # The id is free again after it finished.
        await ws.send(json.dumps({"type": "completion", "id": "c2", "prompt": "again"}))
        r3 = await down.next_request()
        await down.error(r3, "prompt too long", param="input_tokens")
        f = await ws_recv(ws)
        assert (f["id"], f["type"], f["error"]["message"], f["error"]["param"]) == (
            "c2", "error", "prompt too long", "input_tokens")
    assert await down.r.xlen(Streams(server.prefix).engine_in(0)) == 1  # only the explicit cancel


async def test_ws_close_aborts_inflight(server: LiveServer, down: Downstream) -> None:
    async with connect(ws_url(server)) as ws:
        for cid in ("a", "b"):
            await ws.send(json.dumps({"type": "completion", "id": cid, "prompt": "p"}))
        ra, rb = await down.next_request(), await down.next_request()
        await down.reply(ra.reply_to, make_deltas(ra.request_id, ["done"]))  # a finishes first
        assert (await ws_collect(ws, {"a"}))["a"][-1]["finish_reason"] == "stop"
    assert await down.aborted_ids(0) == [rb.request_id]
    assert len(server.gateway.tracker) == 0


async def test_ws_bad_frames(server: LiveServer, down: Downstream) -> None:
    async with connect(ws_url(server)) as ws:
        await ws.send(json.dumps({"type": "chat", "id": "ok", "messages": [{"role": "user", "content": "q"}]}))
        req = await down.next_request()

        bad = [
            ("{nope", None, None),
            ("[1, 2]", None, None),
            (json.dumps({"type": "chat", "messages": []}), None, "id"),
            (json.dumps({"type": "chat", "id": True}), None, "id"),
            (json.dumps({"type": "chat", "id": "x" * 500}), None, "id"),
            (json.dumps({"type": "translate", "id": "t1"}), "t1", "type"),
            (json.dumps({"id": "t2"}), "t2", "type"),
            (json.dumps({"type": "chat", "id": "ok", "messages": [{"role": "user", "content": "q"}]}), "ok", "id"),
            (json.dumps({"type": "chat", "id": "t3", "messages": [{"role": "user", "content": "q"}],
                         "temperature": 9}), "t3", "temperature"),
            (json.dumps({"type": "completion", "id": 4, "prompt": ["a", "b"]}), 4, "prompt"),
            (json.dumps({"type": "completion", "id": "t5", "prompt": "x", "model": "zzz"}), "t5", "model"),
            (json.dumps({"type": "completion", "id": "t6", "prompt": "x", "echo": True, "max_tokens": 0}), "t6",
             "max_tokens"),
            (json.dumps({"type": "completion", "id": "t7", "prompt": "x", "use_beam_search": True}), "t7",
             "use_beam_search"),
        ]
        for frame, cid, param in bad:
            await ws.send(frame)
            f = await ws_recv(ws)
            assert f["type"] == "error" and f["id"] == cid, (frame, f)
            assert f["error"]["message"] and f["error"]["param"] == param, (frame, f)
        await ws.send(b'{"type": "cancel", "id": "nobody"}')  # binary frame, unknown id: ignored

        # The socket and the first request are unaffected; nothing invalid reached the tokenizers.
        await send_scrambled(down, req, seed=7)
        frames = await ws_collect(ws, {"ok"})
        assert "".join(f["text"] for f in frames["ok"] if f["type"] == "delta") == EXPECTED
        assert frames["ok"][-1]["type"] == "done"
        assert await down.num_requests() == 1


async def test_ws_integer_ids_and_many_requests(server: LiveServer, down: Downstream) -> None:
    """Many concurrent requests on one socket, replies interleaved across them in shared batches."""
    n = 12
    async with connect(ws_url(server)) as ws:
        for i in range(n):
            await ws.send(json.dumps({"type": "completion", "id": i, "prompt": f"p{i}"}))
        reqs = [await down.next_request() for _ in range(n)]
        by_id = {int(r.request_id.rsplit("-", 1)[1]): r for r in reqs}
        rng = random.Random(8)
        allds = [d for i, r in by_id.items() for d in make_deltas(r.request_id, [f"<{i}>", "a", "b", f"</{i}>"])]
        allds += rng.sample(allds, 10)
        rng.shuffle(allds)
        for k in range(0, len(allds), 7):
            await down.reply(reqs[0].reply_to, allds[k:k + 7])
        frames = await ws_collect(ws, set(range(n)))
    for i in range(n):
        assert "".join(f["text"] for f in frames[i] if f["type"] == "delta") == f"<{i}>ab</{i}>"
        assert [f["type"] for f in frames[i]].count("done") == 1


async def test_requests_lost_together_are_all_sent_again_and_aborted(server: LiveServer,
                                                                   down: Downstream) -> None:
    """A restarted scheduler answers all it held at once: every request is sent again and every
    lost id aborted. (Each abort used to read the engine list on its own: 128 at once ran out of
    broker connections, and those aborts were never sent.)"""
    await down.r.sadd(Streams(server.prefix).engines_key(), 0)
    await asyncio.sleep(1.0)  # a watch round has seen engine 0
    n, lost = 150, f"{ENGINE_LOST_PREFIX}: its scheduler stopped and started again"
    async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=httpx.Limits(max_connections=n)) as c:
        posts = [asyncio.create_task(c.post("/v1/completions", json={"prompt": "x"})) for _ in range(n)]
        reqs = [await down.next_request() for _ in range(n)]
        pipe = down.r.pipeline(transaction=False)
        for req in reqs:
            pipe.xadd(req.reply_to, {FIELD: encode(ErrorReply(req.request_id, lost, status=503))})
        await pipe.execute()
        again = [await down.next_request() for _ in range(n)]
        aborted: set[str] = set()
        while len(aborted) < n:
            aborted |= set(await down.aborted_ids(0))
        assert aborted == {req.request_id for req in reqs}
        for req in again:
            await down.reply(req.reply_to, make_deltas(req.request_id, ["y"]))
        assert [(await p).status_code for p in posts] == [200] * n


async def test_a_cluster_failover_fails_only_what_its_moved_masters_held() -> None:
    """A promoted replica may lack its master's last writes: the gateway fails the requests of
    an engine whose streams' master changed, and those not routed yet, but not another engine's;
    all of them when its own streams moved, or a single broker restarted."""
    gw = Gateway(redis_url="unused", prefix="p", model_name="m", max_model_len=64)
    s = Streams("p")
    streams = {rid: gw.tracker.register(rid) for rid in ("on0", "on1", "unrouted", "on0b")}
    streams["on0"].engine, streams["on0b"].engine, streams["on1"].engine = 0, 0, 1
    before = {gw.requests_stream: "A", gw.reply_stream: "B", s.engine_in(0): "A", s.engine_in(1): "C"}
    gw._masters = before
    gw._lost_writes({**before, s.engine_in(2): "D"})  # a key first seen now has not moved
    assert len(gw.tracker) == 4
    gw._lost_writes({**before, s.engine_in(1): "D"})
    assert sorted(st.request_id for st in gw.tracker.streams()) == ["on0", "on0b"]
    errors = [ev for batch in [x async for x in streams["on1"]] for ev in batch]
    assert [(e.status, e.message) for e in errors] == [(503, BROKER_FAILED_OVER)]
    gw._lost_writes({**before, gw.reply_stream: "D"})
    assert len(gw.tracker) == 0
    x = gw.tracker.register("x")
    gw._lost_writes({})  # one broker, restarted
    assert len(gw.tracker) == 0
    assert [e.message for batch in [b async for b in x] for e in batch] == [BROKER_RESTARTED]


async def test_shutdown_deletes_reply_stream(down: Downstream) -> None:
    srv = LiveServer(down.streams.prefix)
    srv.start()
    reply = srv.gateway.reply_stream
    async with httpx.AsyncClient(base_url=srv.url, timeout=10) as c:
        task = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x"}))
        req = await down.next_request()
        await down.reply(req.reply_to, make_deltas(req.request_id, ["y"]))
        assert (await task).json()["choices"][0]["text"] == "y"
    assert await down.r.exists(reply) == 1
    await asyncio.to_thread(srv.stop)
    assert await down.r.exists(reply) == 0
