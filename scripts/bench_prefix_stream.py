"""What a cache-aware router pays to keep up with the engines' prefix caches: following each
engine's prefix stream (shared/prefix_stream.py: a snapshot, then the changes) against re-reading
every engine's whole summary whenever it changed (the design before it, rebuilt here as the
baseline: one SET of the packed short hashes per publish, one MGET and a parse per refresh).

Engines are stand-ins holding `--entries` cached blocks; before each refresh every engine's cache
loses its `--churn` oldest blocks and registers as many new ones (what an engine serving
churn x block_size tokens per refresh interval does once its cache is full). Both designs run on
the same caches against a real Redis; per refresh it prints the bytes the router read, the
router's time (read and apply or parse) and the schedulers' time (build the entry and write it).

    .venv/bin/python scripts/bench_prefix_stream.py --engines 16 --entries 65536 --churn 160
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from array import array

import redis

from rill.services.scheduler.prefix_summary import PrefixSummary, summary_bytes
from rill.shared.block_hash import pack_summary
from rill.shared.prefix_stream import PrefixView
from rill.shared.streams import Streams


class StandInCache:
    """What PrefixSummary reads of a KVCacheManager: `cached` (hash -> block), its version and
    the list of hashes that changed."""

    def __init__(self, entries: int) -> None:
        self.cached: dict[bytes, int] = {os.urandom(16): i for i in range(entries)}
        self.cache_version = 0
        self.changed: list[bytes] | None = None

    def churn(self, n: int) -> None:
        gone, new = list(self.cached)[:n], [os.urandom(16) for _ in range(n)]
        for h in gone:  # evict the oldest registrations, register new ones
            del self.cached[h]
        self.cached.update(dict.fromkeys(new, 0))
        if self.changed is not None:
            self.changed += gone + new
        self.cache_version += 1


def run(r: redis.Redis, prefix: str, engines: int, entries: int, churn: int, refreshes: int) -> dict[str, list[float]]:
    caches = [StandInCache(entries) for _ in range(engines)]
    stream_keys = [Streams(prefix).prefix_stream(e) for e in range(engines)]
    value_keys = [f"{prefix}:{{engine:{e}}}:summary" for e in range(engines)]
    publishers = [PrefixSummary(k, min_interval_s=0) for k in stream_keys]
    views = [PrefixView() for _ in range(engines)]
    parsed: list[frozenset[int]] = [frozenset()] * engines
    raw: list[bytes | None] = [None] * engines
    out: dict[str, list[float]] = {k: [] for k in ("stream_kib", "stream_ms", "stream_pub_ms",
                                                   "whole_kib", "whole_ms", "whole_pub_ms")}
    for i in range(refreshes):
        if i:
            for c in caches:
                c.churn(churn)
        # The schedulers: one entry on each stream, one SET of each whole summary.
        t = time.perf_counter()
        pipe = r.pipeline(transaction=False)
        for c, p in zip(caches, publishers, strict=True):
            command = p.command(c, now=float(i))  # type: ignore[arg-type]
            if command is not None:
                pipe.execute_command(*command)
        pipe.execute()
        out["stream_pub_ms"].append((time.perf_counter() - t) * 1e3 / engines)
        t = time.perf_counter()
        r.mset({k: summary_bytes(c) for k, c in zip(value_keys, caches, strict=True)})  # type: ignore[arg-type]
        out["whole_pub_ms"].append((time.perf_counter() - t) * 1e3 / engines)
        # A router following the streams.
        t = time.perf_counter()
        pipe = r.pipeline(transaction=False)
        for k, v in zip(stream_keys, views, strict=True):
            pipe.xrange(k, v.start_from(float(i)), "+")
        replies = pipe.execute()
        for v, reply in zip(views, replies, strict=True):
            assert v.apply(reply)
        out["stream_ms"].append((time.perf_counter() - t) * 1e3)
        out["stream_kib"].append(sum(len(b) for reply in replies for _, f in reply for b in f.values()) / 1024)
        # A router re-reading every summary that changed.
        t = time.perf_counter()
        values = r.mget(value_keys)
        for e, value in enumerate(values):
            if value != raw[e]:
                raw[e], parsed[e] = value, frozenset(array("Q", value or b""))
        out["whole_ms"].append((time.perf_counter() - t) * 1e3)
        out["whole_kib"].append(sum(len(v or b"") for v in values) / 1024)
        for e, c in enumerate(caches):  # both routers hold exactly the engine's cache
            want = set(array("Q", pack_summary(list(c.cached))))
            assert views[e].words == want and parsed[e] == want, f"engine {e} diverged at refresh {i}"
    r.delete(*stream_keys, *value_keys)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--engines", type=int, default=16)
    ap.add_argument("--entries", type=int, default=65536, help="cached blocks per engine (65,536: the cap)")
    ap.add_argument("--churn", type=int, default=160, help="blocks each engine replaces between refreshes")
    ap.add_argument("--refreshes", type=int, default=40)
    args = ap.parse_args()
    r = redis.Redis.from_url(args.redis_url)
    out = run(r, f"bench-prefix-{os.getpid()}", args.engines, args.entries, args.churn, args.refreshes)
    steady = {k: v[1:] for k, v in out.items()}  # the first refresh reads snapshots in both
    print(f"{args.engines} engines x {args.entries} cached blocks, {args.churn} replaced per engine per refresh, "
          f"{args.refreshes - 1} refreshes (medians; the first, a snapshot read in both, apart)")
    print(f"{'router reads':<22}{'KiB read':>10}{'router ms':>11}{'scheduler ms':>14}{'first KiB':>11}{'first ms':>10}")
    for name, label in (("whole", "whole summaries"), ("stream", "prefix streams")):
        print(f"{label:<22}{statistics.median(steady[name + '_kib']):>10.1f}{statistics.median(steady[name + '_ms']):>11.2f}"
              f"{statistics.median(steady[name + '_pub_ms']):>14.2f}{out[name + '_kib'][0]:>11.1f}{out[name + '_ms'][0]:>10.2f}")
    ratio = statistics.median(steady["whole_ms"]) / statistics.median(steady["stream_ms"])
    print(f"streams: {statistics.median(steady['whole_kib']) / statistics.median(steady['stream_kib']):.0f}x fewer bytes, "
          f"{ratio:.1f}x less router time per refresh")


if __name__ == "__main__":
    main()
