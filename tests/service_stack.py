"""Rill's services as separate OS processes against the test Redis (for the deployment and
client tests): start them from given command lines, wait until they serve, restart one, stop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import openai

from rill.shared.broker import free_port
from rill.shared.bus import connect
from rill.shared.schema import EngineStats
from rill.shared.streams import Streams

SERVICES = ("worker", "scheduler", "tokenizer", "detokenizer", "gateway")


def healthy(base_url: str) -> bool:
    """Whether a gateway's /health answers 200."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def rill_executable() -> list[str]:
    """The `rill` console script of this environment (what the image's ENTRYPOINT runs)."""
    script = Path(sys.executable).with_name("rill")
    return [str(script)] if script.exists() else [sys.executable, "-m", "rill.services.cli"]


def fast_flags(model_dir: str, redis_url: str, prefix: str, port: int) -> list[str]:
    """Settings that make a test stack start and answer quickly on a small CPU."""
    return [model_dir, "--redis-url", redis_url, *stack_flags(prefix, port)]


def stack_flags(prefix: str, port: int) -> list[str]:
    """fast_flags without the model and the broker (for commands that already name them). Float
    weights (a converted .gguf would otherwise serve its blocks): outputs are checked against
    transformers' float model."""
    return ["--prefix", prefix, "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32", "--quantization", "none",
            "--kv-cache-memory", "128MiB", "--max-model-len", "2048", "--max-num-batched-tokens", "256",
            "--max-num-seqs", "16"]


async def count_chats(base_url: str, api_key: str = "none", counts: tuple[int, ...] = (3, 4, 5, 6)) -> list[Any]:
    """Concurrent short greedy chats ("Count to N.") through the OpenAI client: what the
    deployment tests send to a freshly started stack."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0)
    try:
        model = (await client.models.list()).data[0].id
        return await asyncio.gather(*[client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Count to {n}."}], temperature=0,
            max_tokens=6) for n in counts])
    finally:
        await client.close()


class SentRequests:
    """Reads what the gateways of a prefix queue for the tokenizers (each gateway has its own
    requests stream), in order per gateway; for tests that play the tokenizer themselves."""

    def __init__(self, r: Any, streams: Streams) -> None:
        self.r, self.streams = r, streams  # an asyncio redis client
        self.last: dict[str, bytes] = {}

    async def names(self) -> list[str]:
        return sorted(self.streams.requests_for(m.decode()) for m in await self.r.smembers(self.streams.gateways_key()))

    async def next(self, timeout: float = 5.0) -> bytes:
        """The payload of the next entry any gateway queued (the gateways started already)."""
        resp = await self.r.xread({name: self.last.get(name, b"0-0") for name in await self.names()}, count=1,
                                  block=int(timeout * 1000))
        assert resp, "the gateway sent no request"
        stream, [(entry_id, fields)] = resp[0]
        self.last[stream.decode()] = entry_id
        return fields[b"m"]

    async def count(self) -> int:
        return sum([await self.r.xlen(name) for name in await self.names()])


@dataclass
class ServiceStack:
    redis_url: str
    prefix: str
    port: int
    commands: dict[str, list[str]]  # process name -> argv
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ, RILL_WORKER_THREADS="2",
                                                             PYTHONUNBUFFERED="1"))
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.redis = connect(self.redis_url)
        self.streams = Streams(self.prefix)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws"

    def launch(self) -> ServiceStack:
        """Start the processes without waiting for them (wait_ready does), so that several
        stacks can start side by side."""
        for name, argv in self.commands.items():
            self.procs[name] = subprocess.Popen(argv, env=self.env)
        return self

    def start(self, timeout: float = 240.0) -> ServiceStack:
        self.launch()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 240.0) -> None:
        """Until the engine has published stats and the gateway's /health says 200."""
        deadline = time.monotonic() + timeout
        while True:
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            assert not dead, f"services died during start-up: {dead}"
            assert time.monotonic() < deadline, "the stack did not become ready in time"
            if self.redis.exists(self.streams.stats_key(0)) and healthy(self.base_url):
                return
            time.sleep(0.3)

    def __enter__(self) -> ServiceStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def restart(self, name: str, timeout: float = 120.0) -> None:
        """Stop one process (its connections drop) and start it again with the same command."""
        proc = self.procs[name]
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self.procs[name] = subprocess.Popen(self.commands[name], env=self.env)
        self.wait_ready(timeout)

    def requests_streams(self) -> list[str]:
        """Every listed gateway's requests stream (one gateway: one stream)."""
        return sorted(self.streams.requests_for(m.decode()) for m in self.redis.smembers(self.streams.gateways_key()))

    def sent_requests(self) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """The entries the gateways queued for the tokenizers, oldest first."""
        entries = [e for stream in self.requests_streams() for e in self.redis.xrange(stream)]
        return sorted(entries, key=lambda e: tuple(int(x) for x in e[0].split(b"-")))

    def stats(self) -> EngineStats:
        raw = self.redis.get(self.streams.stats_key(0))
        assert raw is not None
        return msgspec.msgpack.decode(raw, type=EngineStats)

    def wait_idle(self, timeout: float = 30.0) -> EngineStats:
        deadline = time.monotonic() + timeout
        while True:
            st = self.stats()
            if (st.num_running == 0 and st.num_waiting == 0) or time.monotonic() > deadline:
                return st
            time.sleep(0.1)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def standard_stack(redis_url: str, model_dir: str, prefix: str, port: int,
                   flags: list[str] | None = None) -> ServiceStack:
    """One process per service, started the way `rill service NAME` is deployed; `flags` (the
    model first) replace fast_flags."""
    flags = flags if flags is not None else fast_flags(model_dir, redis_url, prefix, port)
    return ServiceStack(redis_url, prefix, port, {
        name: [*rill_executable(), "service", name, *flags, "--replica-name", f"{name}-0"] for name in SERVICES})


def fresh_stack(redis_url: str, model_dir: str, tag: str, extra: list[str] | None = None) -> ServiceStack:
    """A standard stack on its own prefix and port, with fast_flags plus `extra` (later flags win)."""
    prefix, port = f"rill{tag}-{os.getpid()}-{time.time_ns() % 10**8}", free_port()
    return standard_stack(redis_url, model_dir, prefix, port,
                          [*fast_flags(model_dir, redis_url, prefix, port), *(extra or [])])


def openai_client(stack: ServiceStack, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=timeout)


@contextlib.contextmanager
def extra_gateway(model_dir: str, redis_url: str, prefix: str, name: str, *flags: str,
                  timeout: float = 60.0) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Another gateway on a running stack, with its own flags: (process, its URL), once /health answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rill.services.cli", "service", "gateway", model_dir, "--redis-url",
                             redis_url, "--prefix", prefix, "--port", str(port), "--host", "127.0.0.1",
                             "--replica-name", name, *flags], env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, f"the gateway {name} did not start"
            if healthy(url):
                break
            time.sleep(0.2)
        yield proc, url
    finally:
        proc.terminate()
        proc.wait(30)
