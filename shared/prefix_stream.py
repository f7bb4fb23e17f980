"""An engine's prefix cache as the cache-aware routers see it: a Redis stream per engine
(Streams.prefix_stream) holding one snapshot of the short hashes of its cached blocks, then the
changes since.

The scheduler publishes (services/scheduler/prefix_summary.py decides when and which kind); the
routers follow (services/tokenizer/router.py, through PrefixView). Every entry carries the
publisher's generation `g` (new whenever the scheduler's loop starts) and its number `n`, and either
  s     a snapshot: every short hash the cache holds, as 8-byte words (block_hash.pack_summary),
        written with MAXLEN 1 so the stream starts again from it; or
  a, r  the words added to and removed from the cache since entry n - 1.
A router that knows nothing reads the whole stream (the snapshot and the changes after it), then
only the entries past the last one it applied. An entry that does not follow on (another
generation, a skipped number: a trimmed or lost entry) sends it back to the whole stream, as does
RESYNC_S: a stream begun again under a lower id (a failover to a master whose clock is behind)
cannot hide a new snapshot from it for longer.

Why changes and not whole snapshots re-read: every router reads every engine each refresh, so
re-reading snapshots (up to MAX_ENTRIES words each) grew with engines x cache size on every
replica (scripts/bench_prefix_stream.py measures both); the changes grow with the engines'
traffic. vLLM, Dynamo and llm-d publish KV-cache events the same way.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rill.shared.resp import Command

GEN, SEQ, SNAPSHOT, ADDED, REMOVED = b"g", b"n", b"s", b"a", b"r"
RESYNC_S = 30.0  # a router reads each engine's whole stream at least this often
MAX_CHANGE_ENTRIES = 256  # then a snapshot: a stream holds at most 1 + this many entries


def snapshot_command(key: str, gen: bytes, seq: int, words: bytes) -> Command:
    """Entry `seq` of generation `gen`: every packed short hash the cache holds; the entries
    before it go (MAXLEN 1)."""
    return ("XADD", key, "MAXLEN", "1", "*", GEN, gen, SEQ, seq, SNAPSHOT, words)


def changes_command(key: str, gen: bytes, seq: int, added: bytes, removed: bytes) -> Command:
    """Entry `seq` of generation `gen`: the packed short hashes added and removed since seq - 1."""
    return ("XADD", key, "*", GEN, gen, SEQ, seq, ADDED, added, REMOVED, removed)


@dataclass
class PrefixView:
    """What one router knows of one engine's cache, kept current from the engine's stream."""

    words: set[int] = field(default_factory=set)
    last_id: bytes | None = None  # None: read the stream from its start
    gen: bytes = b""
    seq: int = 0
    read_whole_at: float = float("-inf")

    def start_from(self, now: float) -> str:
        """The XRANGE start of the next read (the whole stream when due: RESYNC_S)."""
        if self.last_id is None or now - self.read_whole_at >= RESYNC_S:
            self.last_id, self.read_whole_at = None, now
            return "-"
        return "(" + self.last_id.decode()

    def apply(self, entries: Sequence[tuple[bytes, dict[bytes, Any]]]) -> bool:
        """Apply an XRANGE reply (as redis-py parses it); False when an entry does not follow on
        from what was applied: the stream must then be read from its start. A whole stream
        that is empty is an empty cache (the engine has published nothing yet, or has left)."""
        if self.last_id is None and not entries:
            self.words = set()
        for entry_id, fields in entries:
            try:  # the broker is not trusted: a malformed entry is one that does not follow on
                gen, seq = fields.get(GEN, b""), int(fields.get(SEQ, -1))
                snapshot = array("Q", fields[SNAPSHOT]) if SNAPSHOT in fields else None
                added, removed = array("Q", fields.get(ADDED, b"")), array("Q", fields.get(REMOVED, b""))
                follows = snapshot is not None or (self.last_id is not None and gen == self.gen
                                                   and seq == self.seq + 1)
            except (TypeError, ValueError):
                follows = False
            if not follows:
                self.last_id = None
                return False
            if snapshot is not None:
                self.words = set(snapshot)
            else:
                self.words.difference_update(removed)
                self.words.update(added)
            self.last_id, self.gen, self.seq = entry_id, gen, seq
        return True
