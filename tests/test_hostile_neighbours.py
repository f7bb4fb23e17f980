"""`rill serve` under hostile neighbours, on a broker this module starts (so it can fill it and
read its pending lists after the server is gone): a request whose replies are trimmed before the
gateway read them ends with a 504 within the progress deadline and its KV blocks are freed; a
full broker gives new requests a 503 and kills nothing; SIGTERM drains (tests in file order,
the drain last: it stops the server)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import msgspec
import psutil
import pytest
import redis
from service_stack import extra_gateway

from rill.services.gateway.drain import DRAIN_ERROR
from rill.services.supervisor import children_of
from rill.shared.broker import EmbeddedBroker, free_port
from rill.shared.schema import EngineStats
from rill.shared.streams import Streams

# Only a second gateway, started for the deadline test, has it: on a busy 2-core machine, 16
# concurrent first tokens (the drain test) can take longer than a short deadline.
PROGRESS_TIMEOUT_S = 6.0
SHUTDOWN_TIMEOUT_S = 10.0
SHORT, LONG = 3, 800  # tokens: a short stream ends within the shutdown timeout, a long one cannot


@dataclass
class Served:
    proc: subprocess.Popen[str]
    broker: EmbeddedBroker
    prefix: str
    port: int
    log: list[str]
    model_dir: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.broker.url)

    def stats(self) -> EngineStats:
        raw = self.redis.get(Streams(self.prefix).stats_key(0))
        assert raw is not None
        return msgspec.msgpack.decode(raw, type=EngineStats)

    def wait_stats(self, pred, timeout: float, what: str) -> EngineStats:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not pred(st := self.stats()):
            assert time.monotonic() < deadline, f"{what} (stats: {st})"
            time.sleep(0.05)
        return st

    def child(self, kind: str) -> int:
        return next(p for p, c in children_of(self.proc.pid).items() if f" service {kind} " in c)


@pytest.fixture(scope="module")
def served(smollm2_dir: str) -> Iterator[Served]:
    broker = EmbeddedBroker(free_port()).start()
    prefix, port = f"rillhn-{os.getpid()}", free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rill.services.cli", "serve", smollm2_dir, "--redis-url", broker.url,
         "--prefix", prefix, "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "64MiB",
         "--max-model-len", "1024", "--max-num-seqs", "16", "--max-num-batched-tokens", "256",
         "--no-enable-prefix-caching",
         "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # Torch ops only: no native kernel build (minutes when the sources changed) in the way.
        env=dict(os.environ, PYTHONUNBUFFERED="1", RILL_WORKER_THREADS="2", RILL_NATIVE_KERNELS="0"))
    log: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in iter(proc.stdout.readline, ""):  # type: ignore[union-attr]
            log.append(line)
            if "ready at" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(300) and proc.poll() is None, "".join(log[-30:])
        # Warm the worker up (its first steps are the slowest).
        for _ in range(2):
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=long_request(4), timeout=120)
        yield Served(proc, broker, prefix, port, log, smollm2_dir)
    finally:
        if proc.poll() is None:
            for pid in children_of(proc.pid):
                with_suppressed(os.kill, pid, signal.SIGCONT)
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        broker.stop()


def with_suppressed(fn, *args) -> None:  # type: ignore[no-untyped-def]
    try:
        fn(*args)
    except OSError:
        pass


def long_request(max_tokens: int) -> dict:
    return {"prompt": "Count from one: one, two, three,", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


@pytest.fixture
def deadline_gateway(served: Served) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A second gateway on the stack with a short --progress-timeout: (process, its URL)."""
    with extra_gateway(served.model_dir, served.broker.url, served.prefix, "gateway-deadline", "--max-model-len",
                       "1024", "--progress-timeout", str(PROGRESS_TIMEOUT_S)) as both:
        yield both


def test_trimmed_replies_end_in_504_and_free_the_blocks(
        served: Served, deadline_gateway: tuple[subprocess.Popen[bytes], str]) -> None:
    gateway, url = deadline_gateway[0].pid, deadline_gateway[1]
    start = served.wait_stats(lambda s: s.num_running == 0, 30, "engine not idle")
    reply = next(m.decode() for m in served.redis.smembers(Streams(served.prefix).gateways_key())
                 if b"gateway-deadline" in m)
    result: dict[str, object] = {}

    def call() -> None:
        resp = httpx.post(f"{url}/v1/completions", json=long_request(800), timeout=60)
        result.update(status=resp.status_code, body=resp.json(), at=time.monotonic())

    caller = threading.Thread(target=call)
    caller.start()
    served.wait_stats(lambda s: s.num_running == 1 and s.decode_tokens > start.decode_tokens, 60,
                      "request did not start")
    # Freeze the gateway, delete the replies that arrive meanwhile, let it go: a gap it can never
    # fill. Two at least: the first may already sit in the socket of the XREAD it had parked.
    r = served.redis
    os.kill(gateway, signal.SIGSTOP)
    try:
        last = (r.xrevrange(reply, count=1) or [(b"0-0", {})])[0][0]
        deadline = time.monotonic() + 20
        while len(fresh := [e[0] for e in r.xrange(reply, min=b"(" + last)]) < 2:
            assert time.monotonic() < deadline, "no replies while the gateway was stopped"
            time.sleep(0.02)
        assert r.xdel(reply, *fresh) == len(fresh)
    finally:
        os.kill(gateway, signal.SIGCONT)
    resumed = time.monotonic()
    caller.join(PROGRESS_TIMEOUT_S + 10)
    assert result.get("status") == 504, (result, served.stats(), "".join(served.log[-15:]))
    assert result["at"] - resumed < PROGRESS_TIMEOUT_S + 1.5, result["at"] - resumed  # type: ignore[operator]
    served.wait_stats(lambda s: s.num_running == 0 and s.num_free_blocks == start.num_free_blocks, 10,
                      "the aborted request's blocks were not freed")


def test_full_broker_gives_503_and_kills_nothing(served: Served) -> None:
    r = served.redis
    before = children_of(served.proc.pid)
    used = r.info("memory")["used_memory"]
    r.config_set("maxmemory", used // 2)  # far below what it holds: every write is refused
    try:
        resp = httpx.post(f"{served.url}/v1/completions", json=long_request(4), timeout=30)
        assert resp.status_code == 503 and "full" in resp.json()["error"]["message"], resp.text
        time.sleep(1.5)  # every service meets refused writes meanwhile (heartbeats, stats)
    finally:
        r.config_set("maxmemory", served.broker.maxmemory)
    resp = httpx.post(f"{served.url}/v1/completions", json=long_request(4), timeout=60)
    assert resp.status_code == 200, resp.text
    assert children_of(served.proc.pid).keys() == before.keys(), "a service died or was restarted"
    assert served.proc.poll() is None


async def _stream(client: httpx.AsyncClient, max_tokens: int,
                  started: list[int]) -> tuple[int, str | None, str | None, float]:
    """(max_tokens, finish reason, error message, end time) of one streamed completion; appends
    to `started` at its first text."""
    finish = error = None
    seen = False
    async with client.stream("POST", "/v1/completions", json={**long_request(max_tokens), "stream": True}) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                error = obj["error"]["message"]
                continue
            if obj["choices"][0]["text"] and not seen:
                seen = True
                started.append(max_tokens)
            finish = obj["choices"][0]["finish_reason"] or finish
    return max_tokens, finish, error, time.monotonic()


def test_sigterm_drains_then_exits_clean(served: Served) -> None:
    pids = [served.proc.pid, *children_of(served.proc.pid)]
    started: list[int] = []

    async def drain() -> tuple[list[tuple[int, str | None, str | None, float]], int, float]:
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
            tasks = [asyncio.create_task(_stream(client, SHORT if i % 2 else LONG, started)) for i in range(16)]
            deadline = time.monotonic() + 120
            while len(started) < 16:
                assert time.monotonic() < deadline and not any(t.done() for t in tasks), "streams did not start"
                await asyncio.sleep(0.05)
            served.proc.send_signal(signal.SIGTERM)
            sigterm_at = time.monotonic()
            await asyncio.sleep(0.5)
            health = (await client.get("/health")).status_code  # still listening, out of rotation
            return list(await asyncio.gather(*tasks)), health, sigterm_at

    outcomes, health, sigterm_at = asyncio.run(drain())
    assert health == 503
    short = [o for o in outcomes if o[0] == SHORT]
    long = [o for o in outcomes if o[0] == LONG]
    # The short ones were still running at SIGTERM and finish; the long ones end with the drain
    # error once the shutdown timeout has passed.
    assert all(o[1] == "length" and o[2] is None for o in short), outcomes
    assert any(o[3] > sigterm_at for o in short), "no request was in flight at SIGTERM"
    assert all(o[2] == DRAIN_ERROR and o[3] - sigterm_at >= SHUTDOWN_TIMEOUT_S for o in long), outcomes
    assert served.proc.wait(SHUTDOWN_TIMEOUT_S + 30) == 0, "".join(served.log[-30:])
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    r = served.redis
    pending = {}
    for key in r.scan_iter(match=f"{served.prefix}:*", _type="stream"):
        for group in r.xinfo_groups(key):
            if group["pending"]:
                pending[(key.decode(), group["name"].decode())] = group["pending"]
    assert not pending, pending
