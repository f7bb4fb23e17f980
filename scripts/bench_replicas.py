#!/usr/bin/env python3
"""What one more replica costs: start-to-ready time and memory per service kind, one run.

Starts `rill service KIND` as its own process for KIND in tokenizer, detokenizer and gateway
(what an autoscaler adds under load), against a broker (--redis-url, else an embedded one),
and measures from the spawn until it serves: the replica's heartbeat for tokenizer and
detokenizer (written once the tokenizer is loaded, just before the read loop), GET /v1/models
for the gateway. Then one /tokenize through the gateway (a chat with tools, so the template
runs) and RSS again. A reference row loads transformers' AutoTokenizer the way replicas did
before (--no-reference skips it). Each process's RSS and peak RSS come from /proc; "torch" says
whether a libtorch library is mapped in it.

    .venv/bin/python scripts/bench_replicas.py [MODEL] [--redis-url URL] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import redis

from rill.shared.model_files import resolve_model
from rill.shared.streams import Streams

KINDS = ("tokenizer", "detokenizer", "gateway")
CHAT = {"messages": [{"role": "user", "content": "What's the weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]}


def cpu_line() -> str:
    info = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f in flags]
    amx = "" if "amx_tile" in flags else ", no AMX"
    return f"{model}, {len(os.sched_getaffinity(0))} cores usable, {' '.join(isa)}{amx}"


def proc_mem(pid: int) -> tuple[float, float, bool]:
    """(RSS MiB, peak RSS MiB, libtorch mapped) of a live process."""
    status = {k: v for k, _, v in (ln.partition(":") for ln in Path(f"/proc/{pid}/status").read_text().splitlines())}
    kib = lambda key: int(status[key].split()[0]) / 1024  # noqa: E731
    maps = Path(f"/proc/{pid}/maps").read_text()
    return kib("VmRSS"), kib("VmHWM"), "libtorch" in maps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read()


class Replica:
    def __init__(self, kind: str, model_dir: str, redis_url: str, prefix: str, port: int) -> None:
        self.kind, self.port = kind, port
        self.name = f"bench-{kind}-{uuid.uuid4().hex[:6]}"
        env = dict(os.environ, RILL_REDIS_URL=redis_url, RILL_LOG_LEVEL="WARNING")
        argv = [sys.executable, "-P", "-m", "rill.services.cli", "service", kind, model_dir, "--prefix", prefix,
                "--replica-name", self.name, "--port", str(port), "--max-model-len", "2048"]
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def ready(self, r: redis.Redis, streams: Streams) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.kind} exited: {self.proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
        if self.kind == "gateway":
            try:
                http(f"http://127.0.0.1:{self.port}/v1/models")
                return True
            except OSError:
                return False
        return bool(r.exists(streams.heartbeat(self.kind, self.name)))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_one(kind: str, model_dir: str, redis_url: str, prefix: str, r: redis.Redis) -> tuple[Replica, float]:
    rep = Replica(kind, model_dir, redis_url, prefix, free_port())
    streams = Streams(prefix)
    deadline = time.monotonic() + 120
    while not rep.ready(r, streams):
        if time.monotonic() > deadline:
            rep.stop()
            raise RuntimeError(f"{kind} was not ready in 120 s")
        time.sleep(0.01)
    return rep, time.perf_counter() - rep.start


def reference(model_dir: str) -> tuple[float, float, bool]:
    """(seconds, peak MiB, torch imported) of loading transformers' AutoTokenizer in a fresh process."""
    code = ("import resource, sys, time\nt = time.perf_counter()\nfrom transformers import AutoTokenizer\n"
            f"AutoTokenizer.from_pretrained({model_dir!r})\n"
            "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "
            "'torch' in sys.modules)\n")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
    _, peak, torch = out.stdout.split()
    return time.perf_counter() - start, float(peak), torch == "True"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    ap.add_argument("--repeat", type=int, default=3, help="starts per kind (the median is shown)")
    ap.add_argument("--no-reference", action="store_true", help="skip the transformers reference row")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    model_dir = str(resolve_model(args.model))

    broker = None
    url = args.redis_url
    if not url:
        from rill.shared.broker import EmbeddedBroker

        broker = EmbeddedBroker().start()
        url = broker.url
    r = redis.Redis.from_url(url)
    prefix = f"bench-replicas-{uuid.uuid4().hex[:8]}"
    rows: dict[str, dict[str, object]] = {}
    try:
        times: dict[str, list[float]] = {k: [] for k in KINDS}
        for i in range(args.repeat):
            live: dict[str, Replica] = {}
            try:
                for kind in KINDS:  # one at a time: each start gets the CPUs to itself
                    live[kind], took = start_one(kind, model_dir, url, prefix, r)
                    times[kind].append(took)
                if i == args.repeat - 1:  # memory from the last round: ready, then after one request
                    ready_mem = {k: proc_mem(p.proc.pid) for k, p in live.items()}
                    http(f"http://127.0.0.1:{live['gateway'].port}/tokenize", CHAT)
                    time.sleep(0.2)
                    for kind, rep in live.items():
                        rss, peak, torch = proc_mem(rep.proc.pid)
                        rows[kind] = {"ready_s": statistics.median(times[kind]), "rss_ready_mib": ready_mem[kind][0],
                                      "rss_mib": rss, "peak_mib": peak, "torch": torch or ready_mem[kind][2]}
            finally:
                for rep in live.values():
                    rep.stop()
        if not args.no_reference:
            took, peak, torch = reference(model_dir)
            rows["reference: transformers AutoTokenizer"] = {"ready_s": took, "rss_ready_mib": None,
                                                             "rss_mib": None, "peak_mib": peak, "torch": torch}
    finally:
        keys = list(r.scan_iter(match=f"{prefix}:*"))
        if keys:
            r.delete(*keys)
        r.close()
        if broker is not None:
            broker.stop()

    print(f"CPU: {cpu_line()}")
    print(f"model: {model_dir}  (start-to-ready: median of {args.repeat} starts)")
    print(f"{'kind':<40} {'ready s':>8} {'RSS ready':>10} {'RSS after':>10} {'peak RSS':>9} {'torch':>6}")
    fmt = lambda v: "-" if v is None else f"{v:.0f} MiB"  # noqa: E731
    for kind, row in rows.items():
        print(f"{kind:<40} {row['ready_s']:>8.2f} {fmt(row['rss_ready_mib']):>10} {fmt(row['rss_mib']):>10} "
              f"{fmt(row['peak_mib']):>9} {'yes' if row['torch'] else 'no':>6}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_line(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
