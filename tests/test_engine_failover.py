"""One engine dies among live ones: two engines (scheduler + worker each), a tokenizer, a
detokenizer and a gateway as separate processes; engine 1's scheduler and worker are SIGKILLed
with requests running on both engines. Engine 1's requests must end with a clear error within
10 s (or, if no token of theirs was out yet, be sent again and finish on engine 0), engine 0's must
finish untouched, new requests must succeed on engine 0, and engine 1, restarted, must serve
again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

import httpx
import msgspec
import pytest
import redis
from service_stack import ServiceStack, fast_flags, rill_executable

from rill.shared.broker import free_port
from rill.shared.schema import EngineStats, ErrorReply, TokenizedRequest, encode, engine_input_decoder

# Request i of a batch asks for first + i tokens: the engines' input streams tell which got it.
LONG, SHORT, AFTER_RESTART = 48, 8, 16
DETECT_S = 10.0  # the bound from the kill to the error


@dataclass
class Outcome:
    max_tokens: int = 0
    chunks: list[str] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None
    completion_tokens: int = 0
    ended_at: float = 0.0
    engine: int | None = None  # the gateway's x-rill-engine header


async def stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> Outcome:
    out = Outcome(max_tokens=max_tokens)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                out.error = json.loads(await resp.aread())["error"]["message"]
                return out
            out.engine = int(resp.headers["x-rill-engine"])
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    out.error = obj["error"]["message"]
                    continue
                if obj.get("usage"):
                    out.completion_tokens = obj["usage"]["completion_tokens"]
                for choice in obj["choices"]:
                    out.chunks.append(choice["text"])
                    out.finish = choice["finish_reason"] or out.finish
    except httpx.HTTPError as exc:
        out.error = f"connection failed: {exc!r}"
    finally:
        out.ended_at = time.monotonic()
    return out


SEEN: dict[tuple[str, int], set[int]] = {}


def routed(stack: ServiceStack, engine: int) -> set[int]:
    """max_tokens of the requests the tokenizer sent to an engine, from its input stream
    (remembered, since the scheduler trims what it has read)."""
    seen = SEEN.setdefault((stack.prefix, engine), set())
    for _, fields in stack.redis.xrange(stack.streams.engine_in(engine)):
        msg = engine_input_decoder.decode(fields[b"m"])
        if isinstance(msg, TokenizedRequest):
            seen.add(msg.params.max_tokens)
    return set(seen)


def running(stack: ServiceStack, engine: int) -> int:
    raw = stack.redis.get(stack.streams.stats_key(engine))
    return 0 if raw is None else msgspec.msgpack.decode(raw, type=EngineStats).num_running


def wait_engine(stack: ServiceStack, engine: int, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not stack.redis.exists(stack.streams.stats_key(engine)):
        assert stack.alive(), "a service died during start-up"
        assert time.monotonic() < deadline, f"engine {engine} did not start"
        time.sleep(0.2)


def test_sigkill_one_of_two_engines(redis_url: str, smollm2_dir: str) -> None:
    prefix = f"rillfailover-{os.getpid()}-{time.time_ns() % 10**8}"
    port = free_port()
    flags = fast_flags(smollm2_dir, redis_url, prefix, port)
    commands = {name: [*rill_executable(), "service", name.split("-")[0], *flags, "--replica-name", name]
                for name in ("tokenizer", "detokenizer", "gateway")}
    for e in (0, 1):
        for kind in ("worker", "scheduler"):
            commands[f"{kind}-{e}"] = [*rill_executable(), "service", kind, *flags, "--engine-id", str(e)]
    env = dict(os.environ, RILL_WORKER_THREADS="1", PYTHONUNBUFFERED="1")
    stack = ServiceStack(redis_url, prefix, port, commands, env=env).start()
    try:
        wait_engine(stack, 1)

        async def load(prompts: list[str], first: int, kill: bool) -> tuple[list[Outcome], float]:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
                tasks = [asyncio.create_task(stream(client, p, first + i)) for i, p in enumerate(prompts)]
                killed_at = 0.0
                if kill:  # as soon as both engines run requests
                    while not (running(stack, 0) and running(stack, 1)):
                        assert not all(t.done() for t in tasks), "the engines never ran at once"
                        await asyncio.sleep(0.02)
                    for name in ("scheduler-1", "worker-1"):
                        stack.procs[name].send_signal(signal.SIGKILL)
                    killed_at = time.monotonic()
                return list(await asyncio.gather(*tasks)), killed_at

        prompts = [f"Story number {i} begins like this:" for i in range(6)]
        outcomes, killed_at = asyncio.run(load(prompts, LONG, kill=True))
        on = {e: routed(stack, e) for e in (0, 1)}
        lost = 0
        for o in outcomes:
            assert o.max_tokens in on[0] | on[1], o
            if o.engine is not None:  # named in the response: the engine that ran it last
                assert o.max_tokens in on[o.engine], o
                assert o.error is not None or o.engine == 0 or o.ended_at < killed_at, o
            if o.max_tokens in on[1] and o.ended_at > killed_at:  # not finished before the kill
                lost += 1
                if o.error is None:  # no token out yet: the gateway sent it again, to engine 0
                    assert o.max_tokens in on[0] and o.completion_tokens == o.max_tokens, o
                    continue
                assert "engine 1" in o.error, o
                assert o.ended_at - killed_at <= DETECT_S, f"failed {o.ended_at - killed_at:.1f} s after the kill"
            else:
                assert o.error is None and o.finish == "length" and o.completion_tokens == o.max_tokens, o
        assert lost and len(on[0]) >= 1, (on, outcomes)

        # New requests go to the live engine, and succeed, even when the dead engine's last stats
        # (its key outlives it) say it is idle, as they do when an idle engine dies.
        stack.redis.set(stack.streams.stats_key(1), encode(EngineStats(engine_id=1)))
        time.sleep(0.5)  # the tokenizer re-reads loads every 0.25 s
        before = routed(stack, 1)
        fresh, _ = asyncio.run(load(prompts[:2], SHORT, kill=False))
        for o in fresh:
            assert o.error is None and o.finish == "length" and o.max_tokens in routed(stack, 0), o
            assert o.engine == 0, o
        assert routed(stack, 1) == before

        # Engine 1 restarted: it is routed to again.
        stack.redis.delete(stack.streams.stats_key(1))
        for name in ("worker-1", "scheduler-1"):
            stack.procs[name] = subprocess.Popen(commands[name], env=env)
        wait_engine(stack, 1)
        again, _ = asyncio.run(load(prompts[:2], AFTER_RESTART, kill=False))
        assert all(o.error is None and o.finish == "length" for o in again), again
        assert {o.max_tokens for o in again} & routed(stack, 1), "the restarted engine got no request"
    finally:
        stack.stop()


def test_tokenizer_names_the_engine_unless_it_hands_requests_on(redis_url: str, prefix: str,
                                                                 smollm2_dir: str) -> None:
    """The gateway learns each request's engine (Routed) from the tokenizer, except for a prefill
    engine: it hands the request to a decode engine, so it is not where the request ends. A
    routing failure answers its request, and leaves the replica's loop alone."""
    from rill.services.tokenizer.router import Router
    from rill.services.tokenizer.service import Tokenizer, handle
    from rill.shared.bus import Bus
    from rill.shared.request_params import SamplingParams
    from rill.shared.schema import GenerateRequest, Routed

    bus = Bus(redis_url, prefix)
    tokenizer = Tokenizer(smollm2_dir, 2048)
    s = bus.streams
    try:
        bus.r.sadd(s.engines_key(), 0)
        for role in ("both", "prefill"):
            bus.r.set(s.stats_key(0), encode(EngineStats(engine_id=0, role=role)))
            req = GenerateRequest(request_id=f"r-{role}", reply_to="gw", kind="completion", prompt="Hi",
                                  params=SamplingParams(max_tokens=4), arrival_time=time.time())
            sends = handle(bus, tokenizer, Router(bus), encode(req))
            assert sends[0][0] == s.engine_in(0) and isinstance(sends[0][1], TokenizedRequest)
            notes = [(stream, msg) for stream, msg in sends if isinstance(msg, Routed)]
            assert notes == ([("gw", Routed(request_id=req.request_id, engine=0))] if role == "both" else [])
        # A routing bug answers its request with a 500 and leaves the read loop running; a
        # broker error goes up to the loop, which rides it out and redoes the entry.
        class Broken(Router):
            exc: Exception = RuntimeError()

            def pick(self, *args: object, **kwargs: object) -> int:
                raise self.exc

        broken = Broken(bus)
        broken.exc = RuntimeError("bug")
        ((stream, error),) = handle(bus, tokenizer, broken, encode(req))
        assert stream == "gw" and isinstance(error, ErrorReply) and error.status == 500
        assert "routing failed: bug" in error.message
        broken.exc = redis.ConnectionError("gone")
        with pytest.raises(redis.ConnectionError):
            handle(bus, tokenizer, broken, encode(req))
    finally:
        bus.r.delete(s.engines_key(), s.stats_key(0))
        bus.close()
