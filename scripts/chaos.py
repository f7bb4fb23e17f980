#!/usr/bin/env python
"""Chaos run: a streaming load against `rill serve` while replicas are SIGKILLed at random moments.

Starts a broker and `rill serve` with several tokenizer, detokenizer and gateway replicas, runs
a set of greedy streaming requests once without faults (the reference), then runs the same set
again, round after round for --duration seconds, while a killer SIGKILLs a random replica every
few seconds (the supervisor restarts it). Prints one table:

  requests     requests sent during the chaos phase
  completed    ended with a finish reason
  failed       ended with a clear error (an error event, an HTTP error, or the connection of a
               killed gateway dropping: the client knows it failed)
  lost         neither, within --request-timeout: the request hung
  dup deltas   tokens a completed stream showed more than once (repeats)
  missing      tokens a completed stream generated but did not show
  diverged     completed streams that showed each token once but not the reference's text.
               The server runs with RILL_BATCH_INVARIANT=1 (a greedy request's text does not
               depend on what shares its steps), so this is a fault; with --no-batch-invariant,
               another greedy path (a batch of another size rounds differently, a near-tie flips)

Each chunk carries its tokens (`logprobs`) and the stream ends with its usage, so a stream's
delivered tokens are counted against the tokens the engine generated; a stream without usage (its
gateway died after the finish) is compared chunk by chunk with the reference instead.

    .venv/bin/python scripts/chaos.py --duration 60
    .venv/bin/python scripts/chaos.py --data-parallel-size 2 --routing cache-aware --preamble-words 60 \
        --kinds tokenizer,detokenizer,gateway,scheduler,worker   # engines killed among live ones
    .venv/bin/python scripts/chaos.py --redis-cluster --data-parallel-size 2 \
        --kinds tokenizer,detokenizer,gateway,reshard   # on a local Redis Cluster, slots moving too

On a Redis Cluster (3 masters, 3 replicas, `--redis-cluster`), the kind `reshard` moves the slot
of a random engine's or gateway's streams to another master (a fourth, empty one to begin with),
key by key, as `valkey-cli --cluster reshard` does: a reshard loses nothing, so it fails nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
import redis
from redis.crc import key_slot

from rill.services.supervisor import children_of
from rill.shared.broker import EmbeddedBroker, free_port
from rill.shared.bus import connect
from rill.shared.heartbeat import engine_ids
from rill.shared.local_cluster import LocalCluster
from rill.shared.model_files import resolve_model
from rill.shared.streams import DETOKENIZER_GROUP, TOKENIZER_GROUP, Streams

TOPICS = ["the sea", "a mountain", "a robot", "coffee", "trains", "winter", "music", "a cat", "the moon",
          "gardens", "chess", "rain", "a library", "volcanoes", "bread", "a friend", "the desert", "birds",
          "a city", "snow", "a river", "clocks", "a ship", "stars"]


@dataclass
class Outcome:
    text: str = ""
    tokens: list[str] = field(default_factory=list)  # what its chunks' logprobs named, in order
    finish: str | None = None
    error: str | None = None
    lost: bool = False
    generated: int | None = None  # usage.completion_tokens


async def stream(client: httpx.AsyncClient, prompt: str, max_tokens: int, timeout: float) -> Outcome:
    out = Outcome()
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "logprobs": 1,
            "stream_options": {"include_usage": True}}

    async def read() -> None:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    return
                if not line.startswith("data: "):
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    out.error = obj["error"]["message"]
                    continue
                if obj.get("usage"):
                    out.generated = obj["usage"]["completion_tokens"]
                for choice in obj["choices"]:
                    out.text += choice["text"]
                    out.tokens += (choice.get("logprobs") or {}).get("tokens") or []
                    if choice["finish_reason"]:
                        out.finish = choice["finish_reason"]

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        out.lost = out.finish is None and out.error is None
    except httpx.HTTPError as exc:
        out.error = f"connection failed: {type(exc).__name__}"
    return out


async def run_set(base_url: str, prompts: list[str], max_tokens: int, concurrency: int,
                  timeout: float) -> list[Outcome]:
    sem = asyncio.Semaphore(concurrency)
    # No keep-alive: every request opens its own connection, so the kernel spreads them over
    # the gateway replicas sharing the port.
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        async def one(p: str) -> Outcome:
            async with sem:
                return await stream(client, p, max_tokens, timeout)
        return await asyncio.gather(*[one(p) for p in prompts])


def listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on `port` (from /proc/net/tcp*)."""
    out: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                out.add(f[9])
    return out


def holds_socket(pid: int, inodes: set[str]) -> bool:
    try:
        return any(os.readlink(fd)[8:-1] in inodes for fd in Path(f"/proc/{pid}/fd").iterdir()
                   if os.readlink(fd).startswith("socket:"))
    except OSError:
        return False


ENGINE_KINDS = ("worker", "scheduler")  # one process each: killed even when it is the last


class Killer(threading.Thread):
    """SIGKILLs a random serving replica of the given kinds every `every` seconds on average.

    Only replicas that serve are candidates (a tokenizer or detokenizer whose consumer polled
    the broker in the last 2 s, a gateway that listens, a worker or scheduler that heartbeats):
    killing one that still loads tests nothing. Never the last serving replica of its kind, except
    the engine's (there is one of each): the point is that the survivors take over."""

    def __init__(self, serve_pid: int, kinds: list[str], every: float, rng: random.Random,
                 redis_url: str, prefix: str, port: int) -> None:
        super().__init__(daemon=True)
        self.serve_pid, self.kinds, self.every, self.rng = serve_pid, kinds, every, rng
        self.r = connect(redis_url)
        self.streams = Streams(prefix)
        self.port = port
        self.stop = threading.Event()
        self.kills: dict[str, int] = {}

    def __enter__(self) -> Killer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()

    def serving(self, pid: int, kind: str, cmd: str) -> bool:
        args = cmd.split()
        if kind in ("tokenizer", "detokenizer"):
            name = args[args.index("--replica-name") + 1]
            s = self.streams
            try:
                if kind == "tokenizer":
                    group, streams = TOKENIZER_GROUP, [s.requests_for(m.decode()) for m in self.r.smembers(s.gateways_key())]
                else:
                    group, streams = DETOKENIZER_GROUP, [s.detok(e) for e in engine_ids(self.r.smembers(s.engines_key()))]
                consumers = [c for stream in streams for c in self.r.xinfo_consumers(stream, group)]
            except redis.RedisError:
                return False
            return any(c["name"].decode() == name and c["idle"] < 2000 for c in consumers)
        if kind == "gateway":
            return holds_socket(pid, listening_inodes(self.port))
        if kind in ENGINE_KINDS:
            at = [i for i, a in enumerate(args) if a == "--engine-id"]  # the last one wins, as in argparse
            engine = int(args[at[-1] + 1]) if at else 0
            return bool(self.r.exists(self.streams.heartbeat(kind, engine)))
        return True

    def run(self) -> None:
        while not self.stop.wait(self.rng.uniform(0.3, 1.7) * self.every):
            ready: dict[str, list[int]] = {}
            for pid, cmd in children_of(self.serve_pid).items():
                for kind in self.kinds:
                    if f" service {kind} " in cmd and self.serving(pid, kind, cmd):
                        ready.setdefault(kind, []).append(pid)
            victims = [(pid, kind) for kind, pids in ready.items() if len(pids) > 1 or kind in ENGINE_KINDS
                       for pid in pids]
            if not victims:
                continue
            pid, kind = self.rng.choice(victims)
            try:
                os.kill(pid, signal.SIGKILL)
                self.kills[kind] = self.kills.get(kind, 0) + 1
            except ProcessLookupError:
                pass


class Resharder(threading.Thread):
    """Moves the slot of a random engine's or gateway's streams to another master every `every`
    seconds on average, key by key, among the masters of the moment (one added empty first)."""

    def __init__(self, cluster: LocalCluster, every: float, rng: random.Random, prefix: str) -> None:
        super().__init__(daemon=True)
        self.cluster, self.every, self.rng = cluster, every, rng
        cluster.add_master()
        self.r = connect(cluster.url)
        self.streams = Streams(prefix)
        self.stop = threading.Event()
        self.moves = 0

    def __enter__(self) -> Resharder:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join()

    def run(self) -> None:
        s = self.streams
        while not self.stop.wait(self.rng.uniform(0.3, 1.7) * self.every):
            gateways = [m.decode() for m in self.r.smembers(s.gateways_key())]
            keys = [s.engine_in(e) for e in engine_ids(self.r.smembers(s.engines_key()))]
            keys += [stream for g in gateways for stream in (s.requests_for(g), g)]
            slot = key_slot(self.rng.choice(keys).encode())
            to = self.rng.choice([m for m in self.cluster.live_masters() if m is not self.cluster.master(slot)])
            self.cluster.move_slot(slot, to, keys_per_step=1, pause_s=0.01)
            self.moves += 1


def compare(ref: Outcome, got: Outcome) -> tuple[int, int, bool]:
    """(repeated tokens, missing tokens, diverged) of a completed stream against its reference,
    token by token (how the text was cut into chunks may differ after a replica's restart).
    With its usage: the tokens its chunks carried against those generated; every token shown once
    and other tokens (or text) is another greedy path. Without: token by token, where a stream that ends on
    a replacement diverged and in any other every insertion is a repeat, every deletion a loss."""
    if got.generated is not None:
        extra = len(got.tokens) - got.generated
        return max(extra, 0), max(-extra, 0), extra == 0 and (got.tokens, got.text) != (ref.tokens, ref.text)
    ops = difflib.SequenceMatcher(a=ref.tokens, b=got.tokens, autojunk=False).get_opcodes()
    if ops and ops[-1][0] == "replace":
        return 0, 0, True
    dup = missing = 0
    for op, i1, i2, j1, j2 in ops:
        if op in ("insert", "replace"):
            dup += j2 - j1
        if op in ("delete", "replace"):
            missing += i2 - i1
    return dup, missing, False


def wait_ready(proc: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "ready at" in line:
            return
        if not line and proc.poll() is not None:
            raise SystemExit(f"rill serve exited with code {proc.returncode}")
    raise SystemExit("rill serve did not become ready in time")


@contextmanager
def rill_serve(model: str, broker_url: str, prefix: str, port: int, args: list[str], log: IO[str],
               stop_timeout: float = 30.0, invariant: bool = False) -> Iterator[subprocess.Popen[str]]:
    """`rill serve` on the broker, ready to serve; SIGTERMed (then killed) on the way out."""
    serve = subprocess.Popen(
        [sys.executable, "-m", "rill.services.cli", "serve", model, "--redis-url", broker_url,
         "--prefix", prefix, "--host", "127.0.0.1", "--port", str(port), *args],
        stdout=subprocess.PIPE, stderr=log, text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1", RILL_BATCH_INVARIANT="1" if invariant else "0"))
    try:
        wait_ready(serve, 600)
        time.sleep(1.0)  # every gateway replica has seen the engine live
        yield serve
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(stop_timeout)
        except subprocess.TimeoutExpired:
            serve.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of chaos (rounds of the request set)")
    ap.add_argument("--requests", type=int, default=16, help="requests per round")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kill-every", type=float, default=4.0, help="mean seconds between kills")
    ap.add_argument("--kinds", default="tokenizer,detokenizer,gateway",
                    help="which replicas to kill (comma-separated; worker and scheduler work too; "
                         "reshard, with --redis-cluster, moves slots)")
    ap.add_argument("--redis-cluster", action="store_true",
                    help="serve on a local Redis Cluster (3 masters, 3 replicas) instead of one broker")
    ap.add_argument("--tokenizer-replicas", type=int, default=3)
    ap.add_argument("--detokenizer-replicas", type=int, default=3)
    ap.add_argument("--gateway-replicas", type=int, default=2)
    ap.add_argument("--data-parallel-size", type=int, default=1,
                    help="engines; with 2 or more, a killed engine's requests fail and new ones go to the others")
    ap.add_argument("--routing", default=None, help="rill serve's --routing (its default if not given)")
    ap.add_argument("--preamble-words", type=int, default=0,
                    help="words of one text every prompt starts with: shared prefix blocks for cache-aware routing")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                    help="serve with RILL_BATCH_INVARIANT=1, so that a diverged stream is a fault")
    ap.add_argument("--log", default="chaos-serve.log", help="where rill serve's logs go")
    ns = ap.parse_args()
    kinds = ns.kinds.split(",")
    if "reshard" in kinds and not ns.redis_cluster:
        ap.error("--kinds reshard moves a Redis Cluster's slots: give --redis-cluster")

    rng = random.Random(ns.seed)
    model = str(resolve_model(ns.model))
    preamble = " ".join(TOPICS[i * 7 % len(TOPICS)].split()[-1] for i in range(ns.preamble_words))
    prompts = [f"{preamble + chr(10) if preamble else ''}A short story about {TOPICS[i % len(TOPICS)]} "
               f"(part {i // len(TOPICS) + 1}):" for i in range(ns.requests)]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with LocalCluster(3, 1) if ns.redis_cluster else EmbeddedBroker() as broker, open(ns.log, "w") as log:
        args = ["--dtype", ns.dtype, "--max-model-len", "512", "--kv-cache-memory", "256MiB", "--max-num-seqs", "64",
                "--tokenizer-replicas", str(ns.tokenizer_replicas),
                "--detokenizer-replicas", str(ns.detokenizer_replicas),
                "--gateway-replicas", str(ns.gateway_replicas), "--data-parallel-size", str(ns.data_parallel_size)]
        args += ["--routing", ns.routing] if ns.routing else []
        with rill_serve(model, broker.url, "chaos", port, args, log, invariant=ns.batch_invariant) as serve:
            t0 = time.monotonic()
            reference = asyncio.run(run_set(base, prompts, ns.max_tokens, ns.concurrency, ns.request_timeout))
            bad = [o for o in reference if o.finish is None]
            if bad:
                raise SystemExit(f"the fault-free run failed: {bad[0]}")
            print(f"reference run: {len(prompts)} requests in {time.monotonic() - t0:.1f}s", flush=True)

            with Killer(serve.pid, [k for k in kinds if k != "reshard"], ns.kill_every, rng, broker.url, "chaos",
                        port) as killer, \
                    (Resharder(broker, ns.kill_every, rng, "chaos") if "reshard" in kinds else contextlib.nullcontext()) \
                    as resharder:
                rows = {"requests": 0, "completed": 0, "failed": 0, "lost": 0, "dup deltas": 0, "missing": 0,
                        "diverged": 0}
                errors: dict[str, int] = {}
                start = time.monotonic()
                rounds = 0
                while time.monotonic() - start < ns.duration:
                    got = asyncio.run(run_set(base, prompts, ns.max_tokens, ns.concurrency, ns.request_timeout))
                    rounds += 1
                    for ref, out in zip(reference, got, strict=True):
                        rows["requests"] += 1
                        if out.lost:
                            rows["lost"] += 1
                        elif out.finish is not None and out.error is None:
                            rows["completed"] += 1
                            dup, missing, diverged = compare(ref, out)
                            rows["dup deltas"] += dup
                            rows["missing"] += missing
                            rows["diverged"] += diverged
                        else:
                            rows["failed"] += 1
                            key = (out.error or "no finish").split(":")[0][:60]
                            errors[key] = errors.get(key, 0) + 1
                killer.stop.set()
                elapsed = time.monotonic() - start
                print(f"\nchaos: {rounds} rounds in {elapsed:.0f}s; SIGKILLs: "
                      + ", ".join(f"{k} x{n}" for k, n in sorted(killer.kills.items()))
                      + (f"; slots moved: {resharder.moves}" if resharder is not None else ""))
                width = max(len(k) for k in rows)
                print("+" + "-" * (width + 2) + "+" + "-" * 10 + "+")
                for k, v in rows.items():
                    print(f"| {k:<{width}} | {v:>8} |")
                print("+" + "-" * (width + 2) + "+" + "-" * 10 + "+")
                for key, n in sorted(errors.items(), key=lambda kv: -kv[1]):
                    print(f"  failed with: {key} ({n})")
                alive = serve.poll() is None
                print(f"rill serve still running: {alive}")
                if rows["lost"] or rows["dup deltas"] or rows["missing"] or not alive:
                    raise SystemExit(1)


if __name__ == "__main__":
    main()
