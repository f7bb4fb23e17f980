"""Replicas, crashes and outages: the whole stack as separate processes, on a broker this module
starts itself (so it can restart it), with 3 tokenizers, 3 detokenizers and 2 gateways sharing
one port. The stack-level tests run in file order and each leaves the stack serving.

Fast tests of the bus helpers (exactly-once forwarding, safe trimming, NOGROUP) come first and
use the shared test server.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import httpx
import msgspec
import pytest
import redis

from rill.services.cli import build_parser
from rill.services.gateway.gateway import ENGINE_RETRY_AFTER_S
from rill.services.launcher import build_children
from rill.shared.broker import EmbeddedBroker, free_port
from rill.shared.bus import CLAIM_IDLE_MS, FIELD, Bus
from rill.shared.schema import EngineStats, ErrorReply
from rill.shared.streams import DETOKENIZER_GROUP, SCHEDULER_GROUP, TOKENIZER_GROUP, Streams

# ---------------------------------------------------------------------------------------------
# Bus helpers (no stack)


def test_ack_and_send_forwards_each_entry_once(redis_url: str, prefix: str) -> None:
    """Two replicas holding the same entry (a claim raced a slow replica): only one forwards."""
    bus = Bus(redis_url, prefix)
    src, dest = bus.streams.requests("g"), bus.streams.reply("g")
    try:
        bus.ensure_group(src, TOKENIZER_GROUP)
        bus.r.xadd(src, {FIELD: b"x"})
        (entry_id, _), = bus.read_group(src, TOKENIZER_GROUP, "slow", block_ms=None)
        claimed = bus.claim(src, TOKENIZER_GROUP, "fast", idle_ms=0)
        assert [[eid for eid, _ in batch] for batch in claimed] == [[entry_id]]
        msg = ErrorReply(request_id="r", message="m")
        assert bus.ack_and_send_many(src, TOKENIZER_GROUP, [(entry_id, [(dest, msg)])]) == [True]
        assert bus.ack_and_send_many(src, TOKENIZER_GROUP, [(entry_id, [(dest, msg)])]) == [False]
        assert bus.r.xlen(dest) == 1
        assert bus.r.xpending(src, TOKENIZER_GROUP)["pending"] == 0
    finally:
        bus.r.delete(src, dest)
        bus.close()


def test_trim_consumed_keeps_pending_and_unread(redis_url: str, prefix: str) -> None:
    bus = Bus(redis_url, prefix)
    s = bus.streams.detok(0)
    try:
        bus.ensure_group(s, DETOKENIZER_GROUP)
        ids = [bus.r.xadd(s, {FIELD: str(i).encode()}) for i in range(1000)]
        read = bus.read_group(s, DETOKENIZER_GROUP, "c", block_ms=None, count=700)
        bus.ack(s, DETOKENIZER_GROUP, [eid for eid, _ in read[:400] + read[401:]])  # entry 400 stays pending
        bus.trim_consumed(s)
        left = [eid for eid, _ in bus.r.xrange(s)]
        assert ids[400] in left and set(ids[700:]) <= set(left)  # the pending one and every unread one
        assert len(left) < 700  # most of what was acked is gone
        bus.ack(s, DETOKENIZER_GROUP, [ids[400]])
        bus.trim_consumed(s)
        assert len(bus.r.xrange(s)) < 450 and set(ids[700:]) <= {eid for eid, _ in bus.r.xrange(s)}
    finally:
        bus.r.delete(s)
        bus.close()


def test_read_group_recreates_a_lost_group(redis_url: str, prefix: str) -> None:
    bus = Bus(redis_url, prefix)
    s = bus.streams.requests("g")
    try:
        bus.r.delete(s)  # what a restarted broker without persistence looks like
        assert bus.read_group(s, TOKENIZER_GROUP, "c", block_ms=None) == []
        bus.r.xadd(s, {FIELD: b"after"})
        assert [p for _, p in bus.read_group(s, TOKENIZER_GROUP, "c", block_ms=None)] == [b"after"]
    finally:
        bus.r.delete(s)
        bus.close()


def test_serve_builds_gateway_replicas_on_one_port() -> None:
    ns = build_parser().parse_args(["serve", "--redis-url", "redis://x", "--gateway-replicas", "3",
                                    "--tokenizer-replicas", "2", "--port", "8123"])
    kids = build_children(ns, "/m")
    gateways = [c for c in kids if c.kind == "gateway"]
    assert [c.name for c in gateways] == ["gateway-0", "gateway-1", "gateway-2"]
    for c in gateways:
        assert "--reuse-port" in c.argv and c.argv[c.argv.index("--port") + 1] == "8123"
    assert sum(c.kind == "tokenizer" for c in kids) == 2
    one = build_children(build_parser().parse_args(["serve", "--redis-url", "redis://x"]), "/m")
    assert [c.name for c in one if c.kind == "gateway"] == ["gateway"]
    assert not any("--reuse-port" in c.argv for c in one)
    with pytest.raises(SystemExit):
        build_children(argparse.Namespace(**{**vars(ns), "gateway_replicas": 0}), "/m")


# ---------------------------------------------------------------------------------------------
# The stack

REPLICAS = {"tokenizer": 3, "detokenizer": 3, "gateway": 2}


@dataclass
class Stack:
    model_dir: str
    broker: EmbeddedBroker
    prefix: str
    port: int
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def streams(self) -> Streams:
        return Streams(self.prefix)

    @functools.cached_property
    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.broker.url)  # the same port across broker restarts

    @property
    def requests_streams(self) -> list[str]:
        """The requests streams of the stack's gateways (killed ones stay listed, their streams
        stay readable)."""
        return sorted(self.streams.requests_for(m.decode()) for m in self.redis.smembers(self.streams.gateways_key()))

    def start(self, name: str) -> None:
        kind = name.split("-")[0]
        argv = [sys.executable, "-m", "rill.services.cli", "service", kind, self.model_dir,
                "--redis-url", self.broker.url, "--prefix", self.prefix, "--replica-name", name,
                "--dtype", "float32", "--quantization", "none", "--block-size", "16", "--max-num-batched-tokens", "512",
                "--max-num-seqs", "64", "--kv-cache-memory", "160MiB", "--max-model-len", "512",
                "--host", "127.0.0.1", "--port", str(self.port), "--reuse-port"]
        self.procs[name] = subprocess.Popen(argv, env=dict(os.environ, RILL_WORKER_THREADS="2",
                                                           PYTHONUNBUFFERED="1"))

    def signal(self, name: str, sig: int) -> None:
        self.procs[name].send_signal(sig)
        if sig == signal.SIGKILL:
            self.procs[name].wait(10)

    def _stopped_blocked(self, name: str) -> bool:
        """SIGSTOP a replica; keep it stopped if its XREADGROUP is parked in the broker (CLIENT LIST
        shows its connection blocked): the broker then hands it the next entry, which it holds."""
        self.procs[name].send_signal(signal.SIGSTOP)
        time.sleep(0.05)  # a command it was sending lands first
        if any(c.get("name") == name and "b" in c["flags"] and c["cmd"] == "xreadgroup"
               for c in self.redis.client_list()):
            return True
        self.procs[name].send_signal(signal.SIGCONT)
        return False

    def stop_holding(self, name: str, stream: str | list[str], group: str, timeout: float = 30.0) -> None:
        """Stop a replica so that it sits on unacked work: caught between a read and its ack (a
        busy replica), or stopped while parked in a read, which gets it the next entry unless
        its BLOCK (POLL_MS) runs out first (an idle one); else resumed and tried again."""
        deadline = time.monotonic() + timeout
        while True:
            if self.pending(stream, group).get(name):
                self.procs[name].send_signal(signal.SIGSTOP)
                time.sleep(0.05)  # an ack it was sending lands first
                if self.pending(stream, group).get(name):
                    return
                self.procs[name].send_signal(signal.SIGCONT)
            elif self._stopped_blocked(name):
                until = time.monotonic() + 0.7
                while time.monotonic() < until:
                    if self.pending(stream, group).get(name):
                        return
                    time.sleep(0.02)
                self.procs[name].send_signal(signal.SIGCONT)
            assert time.monotonic() < deadline, f"{name} never took an entry"
            time.sleep(0.01)

    def dead(self) -> dict[str, int | None]:
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    def health(self) -> int:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    def wait_health(self, status: int, timeout: float) -> float:
        start = time.monotonic()
        while self.health() != status:
            assert time.monotonic() - start < timeout, f"/health did not become {status} in {timeout}s"
            time.sleep(0.2)
        return time.monotonic() - start

    def stats(self) -> EngineStats:
        raw = self.redis.get(self.streams.stats_key(0))
        assert raw is not None
        return msgspec.msgpack.decode(raw, type=EngineStats)

    def wait_stats(self, pred: Callable[[EngineStats], bool], timeout: float, what: str) -> EngineStats:
        deadline = time.monotonic() + timeout
        while True:
            st = self.stats()
            if pred(st):
                return st
            assert time.monotonic() < deadline, f"{what} (stats: {st})"
            time.sleep(0.1)

    def pending(self, streams: str | list[str], group: str) -> dict[str, int]:
        """Entries each consumer holds unacked, over the streams."""
        held: dict[str, int] = {}
        for stream in [streams] if isinstance(streams, str) else streams:
            for c in self.redis.xpending(stream, group)["consumers"]:
                held[c["name"].decode()] = held.get(c["name"].decode(), 0) + c["pending"]
        return held

    def restart_broker(self, downtime: float) -> None:
        """A new, empty server on the same port (no persistence: every stream and group is gone)."""
        port = self.broker.port
        self.broker.stop()
        time.sleep(downtime)
        self.broker = EmbeddedBroker(port).start()


@pytest.fixture(scope="module")
def stack(smollm2_dir: str) -> Iterator[Stack]:
    broker = EmbeddedBroker(free_port()).start()
    st = Stack(smollm2_dir, broker, f"rillft-{os.getpid()}", free_port())
    names = ["worker", "scheduler"] + [f"{kind}-{i}" for kind, n in REPLICAS.items() for i in range(n)]
    try:
        for name in names:
            st.start(name)
        deadline = time.monotonic() + 300
        while st.health() != 200:
            assert not st.dead(), f"services died during start-up: {st.dead()}"
            assert time.monotonic() < deadline, "stack did not become ready in time"
            time.sleep(0.5)
        # Both gateways up (each beats its heartbeat key once started), and both have seen the
        # engine live: they look every WATCH_S (0.5 s).
        while len(list(st.redis.scan_iter(match=f"{st.prefix}:hb:gateway:*"))) < REPLICAS["gateway"]:
            assert time.monotonic() < deadline, "gateways did not start"
            time.sleep(0.2)
        time.sleep(1.0)
        yield st
    finally:
        for p in st.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for p in st.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        st.broker.stop()


# ---------------------------------------------------------------------------------------------
# A streaming client that records exactly what the client saw


@dataclass
class Outcome:
    status: int = 0
    gateway: str = ""
    retry_after: str | None = None
    chunks: list[str] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None
    usage: dict | None = None
    ended_at: float = 0.0

    @property
    def text(self) -> str:
        return "".join(self.chunks)


async def stream_completion(client: httpx.AsyncClient, prompt: str, max_tokens: int,
                            on_chunk: Callable[[Outcome], None] | None = None, **extra: object) -> Outcome:
    out = Outcome()
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            out.status = resp.status_code
            out.gateway = resp.headers.get("x-rill-gateway", "")
            out.retry_after = resp.headers.get("retry-after")
            if resp.status_code != 200:
                out.error = json.loads(await resp.aread())["error"]["message"]
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                obj = json.loads(line[6:])
                if "error" in obj:
                    out.error = obj["error"]["message"]
                    continue
                if obj.get("usage"):
                    out.usage = obj["usage"]
                for choice in obj["choices"]:
                    if choice["text"]:
                        out.chunks.append(choice["text"])
                    if choice["finish_reason"]:
                        out.finish = choice["finish_reason"]
                if on_chunk is not None and out.chunks:
                    on_chunk(out)
    except httpx.HTTPError as exc:
        out.error = f"connection failed: {exc!r}"
    finally:
        out.ended_at = time.monotonic()
    return out


def client_for(stack: Stack, timeout: float = 120.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=stack.url, timeout=timeout,
                             limits=httpx.Limits(max_connections=200, max_keepalive_connections=0))


async def started(outcomes: list[Outcome], n: int, timeout: float = 120.0) -> None:
    """Wait until n of the streams have shown text."""
    deadline = time.monotonic() + timeout
    while sum(bool(o.chunks) for o in outcomes) < n:
        assert time.monotonic() < deadline, "streams did not start"
        await asyncio.sleep(0.05)


def run(coro: Awaitable) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


TOPICS = ["the sea", "a mountain", "a robot", "coffee", "trains", "winter", "music", "a cat", "the moon",
          "gardens", "chess", "rain", "a library", "volcanoes", "bread", "a friend", "the desert", "birds",
          "a city", "snow", "a river", "clocks", "a ship", "stars", "a forest", "tea", "a bridge", "honey",
          "an island", "a storm", "paper", "a lamp"]
PROMPTS = [f"A short story about {t}:" for t in TOPICS]  # under one KV block: no prefix-cache reuse


# ---------------------------------------------------------------------------------------------
# Acceptance


def test_replicas_die_mid_stream_nothing_lost_or_duplicated(stack: Stack) -> None:
    """32 greedy streams; one tokenizer and one detokenizer are SIGKILLed holding unacked work,
    another of each stalls long enough to have its work claimed and then resumes (so that work
    is done twice). Every stream must equal the fault-free run, chunk for chunk."""
    max_tokens = 80

    async def load(faults: Callable[[list[Outcome]], Awaitable[None]] | None) -> list[Outcome]:
        outcomes = [Outcome() for _ in PROMPTS]
        async with client_for(stack) as client:
            async def one(i: int) -> None:
                await asyncio.sleep(0.1 * i)  # arrivals spread over 3 s, the same in both runs
                outcomes[i] = await stream_completion(client, PROMPTS[i], max_tokens,
                                                      on_chunk=lambda o, i=i: outcomes.__setitem__(i, o))
            tasks = [asyncio.create_task(one(i)) for i in range(len(PROMPTS))]
            if faults is not None:
                # Short requests one after another while the faults wait for stalled replicas, so
                # that new requests and steps keep coming however soon the compared ones end (a fast
                # engine could finish them before a detokenizer stalled holding a step).
                filling = asyncio.Event()
                filling.set()

                async def filler() -> None:
                    while filling.is_set():
                        fillers.append(await stream_completion(client, "A list of colours:", 8))

                fill = asyncio.create_task(filler())
                try:
                    await faults(outcomes)
                finally:
                    filling.clear()
                    await fill
            await asyncio.gather(*tasks)
        return outcomes

    fillers: list[Outcome] = []

    reference = run(load(None))
    assert all(o.finish == "length" and o.error is None for o in reference), [o.error for o in reference]

    s = stack.streams
    stalled = ("tokenizer-1", "tokenizer-2", "detokenizer-1", "detokenizer-2")
    seen: dict[str, int] = dict.fromkeys(stalled, 0)  # most entries each stalled replica held at once
    held: dict[str, int] = {}

    async def watch_pending() -> None:
        while True:
            held.clear()
            held.update(stack.pending(s.detok(0), DETOKENIZER_GROUP) | stack.pending(stack.requests_streams, TOKENIZER_GROUP))
            for name in stalled:
                seen[name] = max(seen[name], held.get(name, 0))
            await asyncio.sleep(0.05)

    async def faults(outcomes: list[Outcome]) -> None:
        watcher = asyncio.create_task(watch_pending())
        try:
            # While requests arrive, two tokenizers stall each holding one; later, mid-stream, two
            # detokenizers stall each holding a step.
            await asyncio.gather(*[asyncio.to_thread(stack.stop_holding, name, stack.requests_streams, TOKENIZER_GROUP)
                                   for name in ("tokenizer-1", "tokenizer-2")])
            await started(outcomes, 8)
            await asyncio.gather(*[asyncio.to_thread(stack.stop_holding, name, s.detok(0), DETOKENIZER_GROUP)
                                   for name in ("detokenizer-1", "detokenizer-2")])
            deadline = time.monotonic() + 60
            # Each stalled replica held work, and the live ones claimed it after CLAIM_IDLE_MS.
            while not (all(seen.values()) and not any(held.get(n) for n in stalled)):
                assert time.monotonic() < deadline, f"stalled replicas' work was not claimed: {seen} {held}"
                await asyncio.sleep(0.1)
        finally:
            watcher.cancel()
        stack.signal("tokenizer-1", signal.SIGKILL)
        stack.signal("detokenizer-1", signal.SIGKILL)
        stack.signal("tokenizer-2", signal.SIGCONT)  # it now redoes what was claimed from it
        stack.signal("detokenizer-2", signal.SIGCONT)

    # Stats are published after each step's outputs are sent, so the reference run's last
    # finish can reach the client before it is counted: wait for the engine to be idle.
    before = stack.wait_stats(lambda st: st.num_running == 0 and st.num_free_blocks == st.num_blocks, 10,
                              "the reference load did not finish")
    faulty = run(load(faults))
    assert fillers and all(f.error is None and f.finish == "length" for f in fillers), [f.error for f in fillers]
    for ref, got, prompt in zip(reference, faulty, PROMPTS, strict=True):
        assert got.error is None, (prompt, got.error)
        assert got.finish == "length", prompt
        assert got.chunks == ref.chunks, (prompt, got.chunks, ref.chunks)  # no delta missing or repeated
        assert got.usage == ref.usage
    dead = stack.dead()
    assert set(dead) == {"tokenizer-1", "detokenizer-1"}, dead
    after = stack.wait_stats(lambda st: st.num_running == 0 and st.num_free_blocks == st.num_blocks, 10,
                             "KV blocks not all free after the load")
    # Redone requests reached the engine once: a second copy would have run (and finished) too.
    assert after.finished_requests - before.finished_requests == len(PROMPTS) + len(fillers)
    assert after.aborted_requests == before.aborted_requests


def test_dead_gateway_requests_are_aborted(stack: Stack) -> None:
    """Two gateways share the port; one is SIGKILLed with long streams in flight: the engine
    aborts exactly its requests within seconds, while the other gateway's streams go on."""
    redis_client = stack.redis

    async def scenario() -> tuple[dict[str, list[int]], float, float]:
        outcomes = [Outcome() for _ in range(14)]
        clients = [client_for(stack) for _ in outcomes]  # one connection each, spread by the kernel
        try:
            async def one(i: int) -> None:
                outcomes[i] = await stream_completion(clients[i], PROMPTS[i], 480, ignore_eos=True,
                                                      on_chunk=lambda o, i=i: outcomes.__setitem__(i, o))
            tasks = [asyncio.create_task(one(i)) for i in range(len(outcomes))]
            await started(outcomes, len(outcomes))
            by_gateway: dict[str, list[int]] = {}
            for i, o in enumerate(outcomes):
                by_gateway.setdefault(o.gateway, []).append(i)
            assert len(by_gateway) == 2, f"connections were not spread over both gateways: {by_gateway}"
            victim = min(by_gateway, key=lambda g: len(by_gateway[g]))
            survivors = [i for g, ids in by_gateway.items() if g != victim for i in ids]
            killed_at = time.monotonic()
            stack.signal(victim.rsplit("-", 1)[0], signal.SIGKILL)  # the id is "<replica name>-<suffix>"
            st = await asyncio.to_thread(stack.wait_stats, lambda st: st.num_running == len(survivors), 15,
                                         "the dead gateway's requests were not aborted")
            reaped = time.monotonic() - killed_at
            assert all(outcomes[i].error is None and outcomes[i].finish is None for i in survivors)
            reply = stack.streams.reply(victim)
            ttl = redis_client.ttl(reply)
            assert ttl == -2 or 0 < ttl <= 60, f"the dead gateway's reply stream never expires (ttl {ttl})"
            assert not redis_client.sismember(stack.streams.gateways_key(), reply)
            for t in tasks:  # the survivors' clients go away: their requests are aborted too
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            assert st.num_running == len(survivors)
            return by_gateway, reaped, killed_at
        finally:
            for c in clients:
                await c.aclose()

    by_gateway, reaped, _ = run(scenario())
    assert reaped < 12, reaped
    stack.wait_stats(lambda st: st.num_running == 0 and st.num_waiting == 0 and st.num_free_blocks == st.num_blocks,
                     15, "requests of the closed clients were not aborted")
    assert stack.health() == 200  # the other gateway still answers on the shared port


def test_health_needs_a_live_detokenizer(stack: Stack) -> None:
    """Every detokenizer replica frozen (SIGSTOP: its heartbeat stops): /health turns 503 naming
    the role; resumed, it is 200 again."""
    frozen = [n for n, p in stack.procs.items() if n.startswith("detokenizer") and p.poll() is None]
    assert frozen
    for name in frozen:
        stack.signal(name, signal.SIGSTOP)
    try:
        stack.wait_health(503, 15)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{stack.url}/health", timeout=2)
        assert "detokenizer" in json.loads(err.value.read())["reason"]
    finally:
        for name in frozen:
            stack.signal(name, signal.SIGCONT)
    stack.wait_health(200, 15)


def test_worker_death_fails_requests_then_recovers(stack: Stack) -> None:
    async def in_flight() -> tuple[list[Outcome], float]:
        outcomes = [Outcome() for _ in range(6)]
        async with client_for(stack) as client:
            async def one(i: int) -> None:
                outcomes[i] = await stream_completion(client, PROMPTS[i], 400, ignore_eos=True,
                                                      on_chunk=lambda o, i=i: outcomes.__setitem__(i, o))
            tasks = [asyncio.create_task(one(i)) for i in range(len(outcomes))]
            await started(outcomes, len(outcomes))
            killed_at = time.monotonic()
            stack.signal("worker", signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
        return outcomes, killed_at

    outcomes, killed_at = run(in_flight())
    for o in outcomes:
        assert o.finish is None and o.error is not None and "engine is not available" in o.error, o.error
        assert o.ended_at - killed_at < 10, f"the error came {o.ended_at - killed_at:.1f}s after the kill"
    assert stack.health() == 503
    refused = run(_one_completion(stack))
    assert refused.status == 503 and "engine is not available" in (refused.error or ""), refused
    assert refused.retry_after == str(ENGINE_RETRY_AFTER_S)  # clients that honour it come back later

    stack.start("worker")
    stack.wait_health(200, 180)
    ok = _completion_honouring_retry_after(stack)
    assert ok.error is None and ok.finish == "length", ok
    stack.wait_stats(lambda st: st.num_running == 0 and st.num_free_blocks == st.num_blocks, 10, "blocks leaked")


def test_scheduler_restarted_at_once_fails_what_it_held(stack: Stack) -> None:
    """A scheduler SIGKILLed and started again at once (as Kubernetes restarts a container) is
    back before the gateways' heartbeat grace runs out, so no gateway sees the engine missing:
    the new scheduler answers the requests the dead one held, each with a clear error, and
    the engine serves again. Without its record they would wait for the progress deadline."""
    async def in_flight() -> tuple[list[Outcome], float]:
        outcomes = [Outcome() for _ in range(4)]
        async with client_for(stack) as client:
            async def one(i: int) -> None:
                outcomes[i] = await stream_completion(client, PROMPTS[i], 400, ignore_eos=True, n=1 + i % 2,
                                                      on_chunk=lambda o, i=i: outcomes.__setitem__(i, o))
            tasks = [asyncio.create_task(one(i)) for i in range(len(outcomes))]
            await started(outcomes, len(outcomes))
            killed_at = time.monotonic()
            stack.signal("scheduler", signal.SIGKILL)
            stack.start("scheduler")
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
        return outcomes, killed_at

    outcomes, killed_at = run(in_flight())
    for o in outcomes:
        assert o.finish is None and o.error is not None and "scheduler stopped and started again" in o.error, o
        assert o.ended_at - killed_at < 10, f"the error came {o.ended_at - killed_at:.1f}s after the kill"
    stack.wait_health(200, 60)
    ok = _completion_honouring_retry_after(stack)
    assert ok.error is None and ok.finish == "length", ok
    stack.wait_stats(lambda st: st.num_running == 0 and st.num_free_blocks == st.num_blocks, 10, "blocks leaked")
    assert not stack.redis.hlen(stack.streams.held_key(0)), "requests left on record"


def test_garbage_on_every_stream_loses_nothing(stack: Stack) -> None:
    """Undecodable, mistyped and wrong-field entries on every stream (requests, engine input, plan,
    result, detok, the gateway's replies) while requests stream: each service drops them (the
    scheduler also makes the worker start over and recomputes); every request completes in full
    and every service stays up."""
    async def load() -> list[Outcome]:
        outcomes = [Outcome() for _ in range(4)]
        async with client_for(stack) as client:
            async def one(i: int) -> None:
                outcomes[i] = await stream_completion(client, PROMPTS[i], 48, ignore_eos=True,
                                                      on_chunk=lambda o, i=i: outcomes.__setitem__(i, o))
            tasks = [asyncio.create_task(one(i)) for i in range(len(outcomes))]
            await started(outcomes, len(outcomes))
            st = stack.streams
            replies = [k.decode() for k in stack.redis.scan_iter(match=f"{stack.prefix}:reply:*")]
            streams = [*stack.requests_streams, st.engine_in(0), st.plan(0), st.result(0), st.detok(0), *replies]
            for junk in ({b"m": b"\xc1 not msgpack"}, {b"m": b""}, {b"m": b"\x92\x01"},
                         {b"m": b"\x81\xa2_t\xa5nope!"}, {b"other": b"1"}):
                for name in streams:
                    stack.redis.xadd(name, junk)
                await asyncio.sleep(0.3)
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
        return outcomes

    for o in run(load()):
        assert o.error is None and o.finish == "length" and o.usage and o.usage["completion_tokens"] == 48, o
    dead = stack.dead()  # (replicas an earlier test of this module killed on purpose may be in it)
    assert "scheduler" not in dead and "worker" not in dead, dead
    stack.wait_stats(lambda st: st.num_running == 0 and st.num_free_blocks == st.num_blocks, 10, "blocks leaked")


async def _one_completion(stack: Stack, max_tokens: int = 4) -> Outcome:
    async with client_for(stack, timeout=60) as client:
        return await stream_completion(client, "The capital of France is", max_tokens)


def _completion_honouring_retry_after(stack: Stack) -> Outcome:
    """One completion once /health is back, as a client honouring Retry-After sends it: /health
    answered from one gateway, and another may see the engine back one watch (WATCH_S) later."""
    out = run(_one_completion(stack))
    if out.status == 503 and out.retry_after:
        time.sleep(float(out.retry_after))
        out = run(_one_completion(stack))
    return out


def test_broker_restart_mid_load(stack: Stack) -> None:
    """Restart the broker under load: requests in flight end (complete, or a clear error), and
    the stack serves new requests within 10 s of the broker being back, with every service alive."""

    async def scenario() -> tuple[list[Outcome], float, float]:
        outcomes = [Outcome() for _ in range(8)]
        async with client_for(stack, timeout=60) as client:
            async def one(i: int) -> None:
                outcomes[i] = await stream_completion(client, PROMPTS[i], 60, ignore_eos=True,
                                                      on_chunk=lambda o, i=i: outcomes.__setitem__(i, o))
            tasks = [asyncio.create_task(one(i)) for i in range(len(outcomes))]
            await started(outcomes, len(outcomes))
            await asyncio.to_thread(stack.restart_broker, 2.0)  # down for 2 s
            back_at = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*tasks), 20)  # nothing hangs
            while True:
                ok = await stream_completion(client, "The capital of France is", 4)
                if ok.error is None and ok.finish == "length":
                    return outcomes, back_at, time.monotonic()
                assert time.monotonic() - back_at < 10, f"not serving 10s after the restart: {ok.error}"
                await asyncio.sleep(0.25)

    dead_before = set(stack.dead())  # replicas earlier tests killed
    outcomes, back_at, served_at = run(scenario())
    for o in outcomes:
        assert o.finish == "length" or (o.error and ("broker" in o.error or "engine" in o.error)), o
    assert served_at - back_at < 10
    assert set(stack.dead()) == dead_before, "a service died with the broker restart"


def test_thousand_requests_leave_streams_bounded(stack: Stack) -> None:
    """After 1,000 requests every stream is under its cap, consumed entries were trimmed away,
    nothing is pending longer than the claim timeout, and reply streams expire."""
    n = 1000

    async def load() -> list[int]:
        sem = asyncio.Semaphore(48)
        async with client_for(stack, timeout=120) as client:
            async def one(i: int) -> int:
                async with sem:
                    # One-token prompts keep the engine's share small: this is about the streams.
                    r = await client.post("/v1/completions", json={"prompt": [100 + i], "temperature": 0,
                                                                   "max_tokens": 1 + i % 2})
                    return r.status_code
            return await asyncio.gather(*[one(i) for i in range(n)])

    codes = run(load())
    assert codes.count(200) == n, {c: codes.count(c) for c in set(codes)}
    r = stack.redis
    s = stack.streams
    # Every gateway's requests stream that still exists (a killed gateway's expires).
    groups = {**dict.fromkeys(stack.requests_streams, TOKENIZER_GROUP), s.detok(0): DETOKENIZER_GROUP,
              s.engine_in(0): SCHEDULER_GROUP}
    deadline = time.monotonic() + 15
    while True:  # trimming runs every few seconds
        lengths = {k.decode(): r.xlen(k) for k in r.scan_iter(match=f"{s.prefix}:*", _type="stream")}
        groups = {g: group for g, group in groups.items() if g in lengths}
        if all(lengths[g] < 250 for g in groups) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for name, length in lengths.items():
        cap = s.cap(name)
        assert cap is not None, name
        assert length <= cap, (name, length, cap)
    for stream, group in groups.items():  # 1,000+ entries went through each: only a tail remains
        assert lengths[stream] < 250, (stream, lengths[stream])
        stale = r.xpending_range(stream, group, "-", "+", 10, idle=CLAIM_IDLE_MS)
        assert not stale, (stream, stale)
    for name in lengths:
        if name.startswith((f"{s.prefix}:reply:", f"{s.prefix}:requests:")):
            assert 0 < r.ttl(name) <= 60, name  # refreshed while its gateway lives, then it expires
