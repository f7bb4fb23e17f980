#!/usr/bin/env python
"""Soak run: `rill serve` under mixed valid, invalid and slow traffic for a bounded time, while
tokenizer and detokenizer replicas are SIGKILLed at random moments.

Starts a password-protected embedded broker and `rill serve` (2 tokenizer and 2 detokenizer
replicas, a short header timeout so slow clients cycle), then for --duration seconds keeps
--concurrency clients busy, each picking at random:

  stream     a greedy streamed completion with `ignore_eos` and `logprobs`: every token arrives
             with its logprob, so the client counts tokens and finds lost or repeated deltas
             (received - max_tokens) whatever the text
  full       the same, not streamed
  invalid    a body the gateway must refuse with a 4xx (400-digit number, JSON nested 5,000
             deep, text/plain, a negative max_tokens, an unknown field, not JSON)
  slow       a slowloris connection trickling header lines; the gateway must cut it

A killer SIGKILLs a serving tokenizer or detokenizer replica every --kill-every seconds on
average (never the last of its kind; the supervisor restarts it). Prints requests by kind and
outcome, lost and duplicated deltas (must be 0), and the RSS of every process and the broker's
memory at start, middle and end. The first half includes warm-up (the worker's allocator and
caches settle); from middle to end no process may grow by more than GROWTH_BOUND. Exit status 1
on a lost or duplicated delta, a hung request, growth past the bound, or a dead server.

    .venv/bin/python scripts/soak.py                  # 10 minutes
    .venv/bin/python scripts/soak.py --duration 150
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import time
from collections import Counter

import httpx
import psutil
import redis
from chaos import Killer, rill_serve  # scripts/chaos.py: the replica killer, `rill serve` up and down

from rill.services.supervisor import children_of
from rill.shared.broker import EmbeddedBroker, free_port
from rill.shared.model_files import resolve_model

TOPICS = ["the sea", "a mountain", "a robot", "coffee", "trains", "winter", "music", "a cat", "the moon",
          "gardens", "chess", "rain", "a library", "volcanoes", "bread", "a friend"]
INVALID: list[tuple[str, bytes, str]] = [  # (name, body, content type)
    ("huge number", b'{"prompt": "x", "max_tokens": 4, "temperature": 1' + b"0" * 400 + b"}", "application/json"),
    ("deep nesting", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "application/json"),
    ("text/plain", b'{"prompt": "x", "max_tokens": 4}', "text/plain"),
    ("negative max_tokens", b'{"prompt": "x", "max_tokens": -1}', "application/json"),
    ("unknown field", b'{"prompt": "x", "max_tokens": 4, "no_such_field": 1}', "application/json"),
    ("not JSON", b"prompt=x", "application/json"),
]
KINDS = [("stream", 0.55), ("full", 0.15), ("invalid", 0.2), ("slow", 0.1)]
GROWTH_BOUND = (1.10, 16.0)  # middle -> end: at most x1.10 + 16 MiB per process (and the broker)


def grown(mem: list[dict[str, float]]) -> list[str]:
    """Processes (by replica name) that grew past GROWTH_BOUND from the middle to the end sample."""
    factor, slack = GROWTH_BOUND
    return [name for name, end in mem[-1].items() if name in mem[1] and end > mem[1][name] * factor + slack]


class Soak:
    def __init__(self, base: str, port: int, max_tokens: int, timeout: float, header_timeout: float,
                 rng: random.Random) -> None:
        self.base, self.port, self.max_tokens, self.timeout = base, port, max_tokens, timeout
        self.header_timeout = header_timeout
        self.rng = rng
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.lost_deltas = 0
        self.dup_deltas = 0
        self.errors: Counter[str] = Counter()

    def body(self, stream: bool) -> dict:
        topic = self.rng.choice(TOPICS)
        return {"prompt": f"A short story about {topic}:", "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "stream": stream}

    async def client_loop(self, client: httpx.AsyncClient, until: float) -> None:
        names, weights = zip(*KINDS, strict=True)
        while time.monotonic() < until:
            kind = self.rng.choices(names, weights)[0]
            try:
                outcome = await asyncio.wait_for(getattr(self, kind)(client), self.timeout)
            except TimeoutError:
                outcome = "hung"
            except httpx.HTTPError as exc:
                outcome = f"connection error ({type(exc).__name__})"
            self.outcomes[(kind, outcome)] += 1

    def _tokens(self, got: int, status: str) -> str:
        """Count lost or repeated deltas of a request that finished."""
        if got < self.max_tokens:
            self.lost_deltas += self.max_tokens - got
        elif got > self.max_tokens:
            self.dup_deltas += got - self.max_tokens
        return status

    async def stream(self, client: httpx.AsyncClient) -> str:
        got, finish = 0, None
        async with client.stream("POST", "/v1/completions", json=self.body(True)) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return f"HTTP {resp.status_code}"
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    self.errors[obj["error"]["message"][:70]] += 1
                    return "error event"
                choice = obj["choices"][0]
                got += len((choice.get("logprobs") or {}).get("tokens") or [])
                finish = choice["finish_reason"] or finish
        return self._tokens(got, "completed") if finish else "no finish"

    async def full(self, client: httpx.AsyncClient) -> str:
        resp = await client.post("/v1/completions", json=self.body(False))
        if resp.status_code != 200:
            self.errors[resp.json()["error"]["message"][:70]] += 1
            return f"HTTP {resp.status_code}"
        return self._tokens(len(resp.json()["choices"][0]["logprobs"]["tokens"]), "completed")

    async def invalid(self, client: httpx.AsyncClient) -> str:
        name, body, ctype = self.rng.choice(INVALID)
        resp = await client.post("/v1/completions", content=body, headers={"content-type": ctype})
        if 400 <= resp.status_code < 500 and "error" in resp.json():
            return "refused (4xx)"
        self.errors[f"{name}: HTTP {resp.status_code}"] += 1
        return f"HTTP {resp.status_code}"

    async def slow(self, client: httpx.AsyncClient) -> str:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        try:
            for i in range(int(self.header_timeout * 4) + 8):  # one line every 0.5 s, never the end
                await asyncio.sleep(0.5)
                if reader.at_eof():
                    return "cut by the server"
                writer.write(b"X-Slow-%d: x\r\n" % i)
                await writer.drain()
                try:
                    if await asyncio.wait_for(reader.read(1), 0.01) == b"":
                        return "cut by the server"
                except TimeoutError:
                    pass
            return "not cut"
        except ConnectionError:
            return "cut by the server"
        finally:
            writer.close()


def memory(serve_pid: int, broker: EmbeddedBroker) -> dict[str, float]:
    """MiB: RSS of rill serve and of each child (named by replica), the broker's RSS and used_memory."""
    out: dict[str, float] = {}
    procs = {serve_pid: "rill serve", **children_of(serve_pid)}
    for pid, cmd in procs.items():
        args = cmd.split()
        name = args[args.index("--replica-name") + 1] if "--replica-name" in args else cmd
        try:
            out[name] = psutil.Process(pid).memory_info().rss / 2**20
        except psutil.Error:
            continue
    assert broker.proc is not None
    out["broker (RSS)"] = psutil.Process(broker.proc.pid).memory_info().rss / 2**20
    out["broker (used_memory)"] = redis.Redis.from_url(broker.url).info("memory")["used_memory"] / 2**20
    return out


def print_tables(soak: Soak, mem: list[dict[str, float]], kills: dict[str, int], elapsed: float) -> None:
    print(f"\nsoak: {elapsed:.0f}s; SIGKILLs: " + (", ".join(f"{k} x{n}" for k, n in sorted(kills.items())) or "none"))
    print("\n| kind | outcome | requests |\n|---|---|---:|")
    for (kind, outcome), n in sorted(soak.outcomes.items()):
        print(f"| {kind} | {outcome} | {n} |")
    print(f"| all | | {sum(soak.outcomes.values())} |")
    print(f"\nlost deltas: {soak.lost_deltas}   duplicated deltas: {soak.dup_deltas}")
    for message, n in soak.errors.most_common(8):
        print(f"  error: {message} ({n})")
    print("\n| process | start MiB | middle MiB | end MiB |\n|---|---:|---:|---:|")
    for name in sorted(set().union(*mem), key=lambda k: (k.startswith("broker"), k)):
        cells = " | ".join(f"{m[name]:.1f}" if name in m else "-" for m in mem)
        print(f"| {name} | {cells} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 10 minutes)")
    ap.add_argument("--concurrency", type=int, default=8, help="clients at once")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--kill-every", type=float, default=15.0, help="mean seconds between replica kills")
    ap.add_argument("--header-timeout", type=float, default=2.0, help="the gateway's --header-timeout")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="a request still open then is hung")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", default="soak-serve.log", help="where rill serve's logs go")
    ns = ap.parse_args()

    rng = random.Random(ns.seed)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with EmbeddedBroker(password=secrets.token_urlsafe(16)) as broker, open(ns.log, "w") as log:
        args = ["--dtype", ns.dtype, "--max-model-len", "512", "--kv-cache-memory", "128MiB", "--max-num-seqs", "32",
                "--tokenizer-replicas", "2", "--detokenizer-replicas", "2",
                "--header-timeout", str(ns.header_timeout), "--progress-timeout", "60"]
        with rill_serve(str(resolve_model(ns.model)), broker.url, "soak", port, args, log, stop_timeout=60) as serve:
            mem = [memory(serve.pid, broker)]
            with Killer(serve.pid, ["tokenizer", "detokenizer"], ns.kill_every, rng, broker.url, "soak", port) as killer:
                soak = Soak(base, port, ns.max_tokens, ns.request_timeout, ns.header_timeout, rng)
                start = time.monotonic()

                async def run() -> None:
                    limits = httpx.Limits(max_connections=ns.concurrency * 2, max_keepalive_connections=0)
                    async with httpx.AsyncClient(base_url=base, timeout=ns.request_timeout, limits=limits) as client:
                        until = start + ns.duration
                        tasks = [asyncio.create_task(soak.client_loop(client, until)) for _ in range(ns.concurrency)]
                        await asyncio.sleep(ns.duration / 2)
                        mem.append(await asyncio.to_thread(memory, serve.pid, broker))
                        await asyncio.gather(*tasks)

                asyncio.run(run())
                killer.stop.set()
                elapsed = time.monotonic() - start
                time.sleep(2.0)  # let the last aborts and trims land before the final sample
                mem.append(memory(serve.pid, broker))
                alive = serve.poll() is None
                print_tables(soak, mem, killer.kills, elapsed)
                expected = {"completed", "refused (4xx)", "cut by the server"}
                odd = {k: n for k, n in soak.outcomes.items() if k[1] not in expected}
                over = grown(mem)
                print(f"\nrill serve still running: {alive}; other outcomes: {sum(odd.values())}; "
                      f"grew past x{GROWTH_BOUND[0]} + {GROWTH_BOUND[1]:g} MiB from middle to end: {over or 'none'}")
                if soak.lost_deltas or soak.dup_deltas or not alive or over or any(k[1] == "hung" for k in odd):
                    raise SystemExit(1)


if __name__ == "__main__":
    main()
