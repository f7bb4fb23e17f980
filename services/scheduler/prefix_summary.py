"""What an engine tells the routers about its prefix cache: the short hashes of its cached blocks.

Format (shared/block_hash.py pack_summary / parse_summary): one Redis string per engine
(Streams.prefix_summary_key), the concatenated first SHORT_HASH_BYTES bytes of the hash of every block in the KV cache manager's `cached` map (full
blocks registered under their chained hash, owned or still reusable in the free queue), in
no order. At most one entry per KV block, so the value is bounded by num_blocks x 8 bytes, and
by MAX_ENTRIES beyond that.

Update rule: rewritten whole when the cache's contents changed (KVCacheManager.cache_version)
and at least SUMMARY_REFRESH_S after the last write, as one more command in the scheduler's
per-step exchange (no round trip of its own). A whole snapshot rather than SADD/SREM deltas:
the routers read every engine's summary whole at each refresh anyway (in the same MGET as the
stats and heartbeats, no extra round trip on their side, where a Redis set would need SMEMBERS
or a membership query per request), a snapshot heals itself after a broker restart or a lost
write, and it costs the scheduler a join over at most num_blocks hashes a few times a second
(scripts/benchmarks.md) instead of a journal kept in the cache's allocation paths.
"""

from __future__ import annotations

import time

from rill.services.scheduler.kv_cache_manager import KVCacheManager
from rill.shared.block_hash import SUMMARY_REFRESH_S, pack_summary
from rill.shared.resp import Command

MAX_ENTRIES = 1 << 16  # 512 KiB: bounds a huge GPU cache's summary (newest registrations kept)


def summary_bytes(kv: KVCacheManager, max_entries: int = MAX_ENTRIES) -> bytes:
    """The summary value of this cache: short hashes, newest registrations last (dict order)."""
    hashes = list(kv.cached)
    if len(hashes) > max_entries:
        hashes = hashes[-max_entries:]
    return pack_summary(hashes)


class PrefixSummary:
    """Decides when the engine's summary is rewritten, and builds the command that does it."""

    def __init__(self, key: str, min_interval_s: float = SUMMARY_REFRESH_S) -> None:
        self.key = key
        self.min_interval_s = min_interval_s
        self._seen: tuple[int, int] | None = None  # (id of the cache manager, its cache_version)
        self._written_at = float("-inf")

    def reset(self) -> None:
        """Write at the next chance whatever the cache holds (a new loop, maybe a new broker)."""
        self._seen, self._written_at = None, float("-inf")

    def command(self, kv: KVCacheManager, now: float | None = None) -> Command | None:
        """The SET that brings the published summary up to date, or None when it is current or
        was written less than min_interval_s ago."""
        now = time.monotonic() if now is None else now
        state = (id(kv), kv.cache_version)
        if state == self._seen or now - self._written_at < self.min_interval_s:
            return None
        self._seen, self._written_at = state, now
        return ("SET", self.key, summary_bytes(kv))
