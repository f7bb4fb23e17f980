"""What an engine tells the routers about its prefix cache: the short hashes of its cached blocks,
as a snapshot and then the changes since, on the engine's prefix stream (format and reader:
shared/prefix_stream.py).

What is published: the short hash (first SHORT_HASH_BYTES bytes) of every block in the KV cache
manager's `cached` map (full blocks registered under their chained hash, owned or still reusable
in the free queue), at most one per KV block and at most MAX_ENTRIES (the newest).

When: at most every SUMMARY_REFRESH_S and only when the cache's contents changed
(KVCacheManager.cache_version), as one more command in the scheduler's per-step exchange (no
round trip of its own). The changes come from the hashes the cache manager lists as they gain or
lose their block (`KVCacheManager.changed`), so an entry costs what changed, not the cache's
size. A snapshot instead when the loop (re)started, when the changes since the last snapshot add
up to more words than a snapshot holds (a router joining then reads at most about two snapshots'
worth) or to MAX_CHANGE_ENTRIES entries (the stream's bound), or when SNAPSHOT_S has passed (a
broker that lost entries heals).
"""

from __future__ import annotations

import time
import uuid
from itertools import islice

from rill.services.scheduler.kv_cache_manager import KVCacheManager
from rill.shared.block_hash import SUMMARY_REFRESH_S, pack_summary
from rill.shared.prefix_stream import MAX_CHANGE_ENTRIES, changes_command, snapshot_command
from rill.shared.resp import Command

MAX_ENTRIES = 1 << 16  # 512 KiB: bounds a huge GPU cache's snapshot (newest registrations kept)
SNAPSHOT_S = 30.0
MIN_SNAPSHOT_WORDS = 1024  # changes up to this many words never force a snapshot of a small cache


def newest_hashes(kv: KVCacheManager, max_entries: int = MAX_ENTRIES) -> list[bytes]:
    """What a snapshot of this cache holds: at most max_entries hashes, the newest registrations
    (dict order), newest last."""
    return list(kv.cached)[-max_entries:]


def summary_bytes(kv: KVCacheManager, max_entries: int = MAX_ENTRIES) -> bytes:
    """The short hashes of a snapshot of this cache, packed."""
    return pack_summary(newest_hashes(kv, max_entries))


class PrefixSummary:
    """Decides when the engine's prefix stream gets an entry, and which, and builds its XADD."""

    def __init__(self, key: str, min_interval_s: float = SUMMARY_REFRESH_S,
                 max_entries: int = MAX_ENTRIES) -> None:
        self.key = key
        self.min_interval_s = min_interval_s
        self.max_entries = max_entries
        self.reset()

    def reset(self) -> None:
        """Start again with a snapshot at the next chance (a new loop, maybe a new broker)."""
        self._seen: tuple[int, int] | None = None  # (id of the cache manager, its cache_version)
        self._written_at = float("-inf")
        self._published: dict[bytes, None] = {}  # full hashes, oldest published first
        self._gen = uuid.uuid4().hex[:12].encode()
        self._seq = 0
        self._snapshot_at = float("-inf")
        self._changed_words = 0  # words in the changes since the last snapshot
        self._changes_since = 0  # entries since the last snapshot

    def command(self, kv: KVCacheManager, now: float | None = None) -> Command | None:
        """The XADD that brings the published cache up to date, or None when it is current or
        was written less than min_interval_s ago."""
        now = time.monotonic() if now is None else now
        state = (id(kv), kv.cache_version)
        if state == self._seen or now - self._written_at < self.min_interval_s:
            return None
        fresh = self._seen is None or self._seen[0] != id(kv) or kv.changed is None
        self._seen, self._written_at = state, now
        if not fresh and now - self._snapshot_at < SNAPSHOT_S:
            added, removed = self._changes(kv)
            if not added and not removed:
                return None
            changed = self._changed_words + len(added) + len(removed)
            room = self._changes_since < MAX_CHANGE_ENTRIES
            if room and changed <= max(len(self._published), MIN_SNAPSHOT_WORDS):
                self._seq, self._changed_words = self._seq + 1, changed
                self._changes_since += 1
                return changes_command(self.key, self._gen, self._seq, pack_summary(added), pack_summary(removed))
        kv.changed = []  # from now on the manager lists what changes
        self._published = dict.fromkeys(newest_hashes(kv, self.max_entries))
        self._seq, self._snapshot_at, self._changed_words, self._changes_since = self._seq + 1, now, 0, 0
        return snapshot_command(self.key, self._gen, self._seq, pack_summary(list(self._published)))

    def _changes(self, kv: KVCacheManager) -> tuple[list[bytes], list[bytes]]:
        """The hashes to add and remove since the last entry (from the manager's list), and the
        oldest published ones that fall beyond max_entries."""
        assert kv.changed is not None
        touched, kv.changed = dict.fromkeys(kv.changed), []
        published = self._published
        added = [h for h in touched if h in kv.cached and h not in published]
        removed = [h for h in touched if h not in kv.cached and h in published]
        for h in removed:
            del published[h]
        published.update(dict.fromkeys(added))
        over = len(published) - self.max_entries
        if over > 0:
            oldest = list(islice(published, over))
            for h in oldest:
                del published[h]
            removed += oldest
        return added, removed
