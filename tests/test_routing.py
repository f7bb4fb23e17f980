"""Data-parallel routing (services/tokenizer/router.py) against a real Redis: stats, heartbeats
and prefix streams written by hand for fake engines; the prefix stream's publisher and reader
(services/scheduler/prefix_summary.py, shared/prefix_stream.py); and a real scheduler's stream."""

from __future__ import annotations

import subprocess
import sys
import time
from array import array
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_plan_timing
from test_plan_timing import slow_engine, submit

from rill.services.scheduler import prefix_summary
from rill.services.scheduler.kv_cache_manager import KVCacheManager
from rill.services.scheduler.prefix_summary import SNAPSHOT_S, PrefixSummary, summary_bytes
from rill.services.tokenizer.router import BALANCE_ABS, Router
from rill.shared.block_hash import (
    SHORT_HASH_BYTES,
    SUMMARY_REFRESH_S,
    block_hashes,
    pack_summary,
    short_words,
)
from rill.shared.bus import Bus
from rill.shared.config import EngineArgs
from rill.shared.heartbeat import engine_beat_keys
from rill.shared.prefix_stream import ADDED, REMOVED, SNAPSHOT, PrefixView, changes_command, snapshot_command
from rill.shared.schema import EngineStats, encode

BS = 16
SYSTEM = list(range(100, 100 + 4 * BS))  # four full blocks
PROMPT = SYSTEM + list(range(500, 500 + 2 * BS + 3))  # six full blocks and a tail


@pytest.fixture
def bus(redis_url: str, prefix: str) -> Iterator[Bus]:
    b = Bus(redis_url, prefix)
    yield b
    keys = list(b.r.scan_iter(f"{prefix}:*"))
    if keys:
        b.r.delete(*keys)
    b.close()


def engine(bus: Bus, e: int, load: int = 0, cached: list[int] | None = None, alive: bool = True,
           role: str = "both", salt: str | None = None) -> None:
    """A fake engine: listed, stats with `load` waiting requests, a summary of the first blocks of
    `cached` (token ids, under a cache salt), and both heartbeats unless dead."""
    s = bus.streams
    bus.r.sadd(s.engines_key(), e)
    bus.r.set(s.stats_key(e), encode(EngineStats(e, role=role, num_waiting=load, block_size=BS)))
    bus.r.execute_command(*snapshot_command(s.prefix_stream(e), b"test", 1, pack_summary(block_hashes(cached or [], BS, salt=salt))))
    for key in engine_beat_keys(s, [e]):
        if alive:
            bus.r.set(key, b"1", ex=60)
        else:
            bus.r.delete(key)


def test_summary_round_trips_short_hashes() -> None:
    hashes = block_hashes(PROMPT, BS)
    assert pack_summary(hashes) == b"".join(h[:SHORT_HASH_BYTES] for h in hashes)
    words = [int.from_bytes(h[:SHORT_HASH_BYTES], sys.byteorder) for h in hashes]
    assert short_words(hashes) == words
    kv = KVCacheManager(64, BS)
    kv.allocate("a", len(PROMPT))
    kv.register_full_blocks("a", hashes, len(PROMPT))
    assert len(summary_bytes(kv)) == 6 * SHORT_HASH_BYTES
    assert len(summary_bytes(kv, max_entries=2)) == 2 * SHORT_HASH_BYTES


def fields(command: tuple) -> dict:
    """The fields of an XADD command, as redis-py parses an entry's."""
    i = command.index("*") + 1
    return {k: (str(v).encode() if isinstance(v, int) else v)
            for k, v in zip(command[i::2], command[i + 1::2], strict=True)}


def words_of(blob: bytes) -> set[int]:
    return set(array("Q", blob))


def test_the_stream_gets_a_snapshot_then_changes_only_when_changed_and_not_too_often() -> None:
    kv, summary = KVCacheManager(64, BS), PrefixSummary("k", min_interval_s=0.25)
    first = summary.command(kv, now=10.0)
    assert first is not None and fields(first)[SNAPSHOT] == b"" and "MAXLEN" in first
    assert summary.command(kv, now=20.0) is None  # unchanged
    hashes = block_hashes(PROMPT, BS)
    kv.allocate("a", len(PROMPT))
    kv.register_full_blocks("a", hashes, len(PROMPT))
    added = summary.command(kv, now=20.1)
    assert added is not None and "MAXLEN" not in added
    assert words_of(fields(added)[ADDED]) == set(short_words(hashes)) and fields(added)[REMOVED] == b""
    kv.free("a")
    kv.allocate("b", 64 * BS)  # evicts every cached block
    assert summary.command(kv, now=20.2) is None  # too soon
    removed = summary.command(kv, now=20.4)
    assert removed is not None and words_of(fields(removed)[REMOVED]) == set(short_words(hashes))
    assert [fields(c)[b"n"] for c in (first, added, removed)] == [b"1", b"2", b"3"]
    kv.free("b")
    kv.allocate("c", len(PROMPT))
    kv.register_full_blocks("c", hashes, len(PROMPT))
    late = summary.command(kv, now=20.4 + SNAPSHOT_S)  # a snapshot now and then, whatever changed
    assert late is not None and words_of(fields(late)[SNAPSHOT]) == set(short_words(hashes))
    summary.reset()  # a new loop: a snapshot of a new generation
    again = summary.command(kv, now=21.0 + SNAPSHOT_S)
    assert again is not None and SNAPSHOT in fields(again) and fields(again)[b"g"] != fields(late)[b"g"]


@pytest.mark.parametrize(("cap", "min_words", "max_changes"), [(64, 8, 256), (20, 8, 256), (64, 10**6, 6)])
def test_a_router_following_the_stream_holds_what_the_cache_holds(bus: Bus, monkeypatch: pytest.MonkeyPatch,
                                                                  cap: int, min_words: int, max_changes: int) -> None:
    """Prompts come and go in a small cache (evictions, a snapshot forced by many changes or by
    many entries): a router reading every entry as it comes, and one that joins at the end and
    reads the whole stream, both hold exactly the cache's short hashes; with a cap below the
    cache's size, at most that many of them, the newest prompt's among them."""
    monkeypatch.setattr(prefix_summary, "MIN_SNAPSHOT_WORDS", min_words)
    monkeypatch.setattr(prefix_summary, "MAX_CHANGE_ENTRIES", max_changes)
    key = bus.streams.prefix_stream(0)
    kv, summary, follower = KVCacheManager(24, BS), PrefixSummary(key, min_interval_s=0, max_entries=cap), PrefixView()
    kinds = []
    for i in range(40):
        prompt = SYSTEM + list(range(1000 * i, 1000 * i + (i % 5 + 1) * BS))
        kv.allocate(f"r{i}", len(prompt))
        kv.register_full_blocks(f"r{i}", block_hashes(prompt, BS), len(prompt))
        kv.free(f"r{i}")
        command = summary.command(kv, now=float(i))
        assert command is not None
        kinds.append(SNAPSHOT in fields(command))
        bus.r.execute_command(*command)
        assert bus.r.xlen(key) <= 1 + max_changes <= (bus.streams.cap(key) or 0)
        assert follower.apply(bus.r.xrange(key, follower.start_from(float(i)), "+"))
        cached = set(array("Q", summary_bytes(kv)))
        if cap >= kv.num_blocks:
            assert follower.words == cached
        else:
            newest = set(short_words(block_hashes(prompt, BS))[4:])  # after SYSTEM: registered last
            assert newest <= follower.words <= cached and len(follower.words) <= cap
    assert kinds[0] and any(kinds[1:]) and not all(kinds[1:])
    late = PrefixView()
    assert late.apply(bus.r.xrange(key, late.start_from(0.0), "+")) and late.words == follower.words
    assert bus.r.xlen(key) == kinds[::-1].index(True) + 1  # the last snapshot and the changes since


def test_an_entry_that_does_not_follow_on_sends_the_reader_back_to_the_snapshot() -> None:
    view = PrefixView()
    snap = {b"g": b"a", b"n": b"1", SNAPSHOT: bytes(array("Q", [1, 2]))}
    assert view.apply([(b"1-0", snap)]) and view.words == {1, 2}
    step = {b"g": b"a", b"n": b"2", ADDED: bytes(array("Q", [3])), REMOVED: bytes(array("Q", [1]))}
    assert view.apply([(b"1-1", step)]) and view.words == {2, 3}
    assert not view.apply([(b"1-2", {**step, b"n": b"4"})])  # entry 3 was lost
    assert view.start_from(0.0) == "-"
    assert not PrefixView().apply([(b"1-1", step)])  # a whole stream must start with its snapshot
    other = {**step, b"g": b"b", b"n": b"3"}
    view.apply([(b"1-0", snap), (b"1-1", step)])
    assert not view.apply([(b"2-0", other)])  # another generation's changes
    assert view.apply([]) and view.words == set()  # a whole stream that is empty: nothing cached


def test_the_benchmark_checks_both_designs_hold_every_cache(redis_url: str) -> None:
    """scripts/bench_prefix_stream.py (small): its run asserts that the stream's follower and the
    whole-summary baseline both hold exactly each churning cache, refresh after refresh."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_prefix_stream.py"
    out = subprocess.run([sys.executable, str(script), "--redis-url", redis_url, "--engines", "3",
                          "--entries", "300", "--churn", "8", "--refreshes", "5"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "prefix streams" in out and "fewer bytes" in out, out


def test_cache_aware_picks_the_longest_cached_prefix(bus: Bus) -> None:
    engine(bus, 0, load=1, cached=SYSTEM)
    engine(bus, 1, load=2, cached=PROMPT)  # the whole conversation so far
    engine(bus, 2, load=0)
    router = Router(bus, "cache-aware")
    assert router.pick(PROMPT) == 1
    assert router.pick(SYSTEM + [7] * 40) == 0  # 0 and 1 tie on 4 blocks: the less loaded one
    assert router.pick(list(range(900, 1000))) == 2  # no match anywhere: least-loaded


def test_a_salted_prompt_goes_where_its_salt_cached_it(bus: Bus) -> None:
    engine(bus, 0, load=1, cached=PROMPT)
    engine(bus, 1, load=2, cached=PROMPT, salt="tenant-1")
    engine(bus, 2, load=0)
    router = Router(bus, "cache-aware")
    assert router.pick(PROMPT) == 0 and router.pick(PROMPT, salt="tenant-1") == 1
    assert router.pick(PROMPT, salt="tenant-2") == 2  # cached nowhere under that salt: least-loaded


def test_a_router_sees_changes_at_its_next_refresh_and_survives_an_unreadable_stream(bus: Bus) -> None:
    engine(bus, 0, load=1)
    engine(bus, 1, load=2)
    router = Router(bus, "cache-aware")
    assert router.pick(PROMPT) == 0  # nothing cached anywhere: least-loaded
    s = bus.streams
    bus.r.execute_command(*changes_command(s.prefix_stream(1), b"test", 2, pack_summary(block_hashes(PROMPT, BS)), b""))
    bus.r.set(s.prefix_stream(0), b"an older scheduler's summary")  # not a stream: read as no cache
    time.sleep(SUMMARY_REFRESH_S)
    assert router.pick(PROMPT) == 1
    assert router.engines[0].cached == set()


def test_malformed_stream_entries_route_as_no_cache_and_never_raise(bus: Bus, caplog: pytest.LogCaptureFixture) -> None:
    """The broker is not trusted: junk on an engine's prefix stream (a number that is no number,
    words of odd length) costs that engine its cache-aware picks, not the tokenizer its loop."""
    engine(bus, 0, load=0)
    engine(bus, 1, load=1, cached=PROMPT)
    engine(bus, 2, load=2, cached=PROMPT)
    s = bus.streams
    bus.r.xadd(s.prefix_stream(1), {b"g": b"test", b"n": b"not a number", b"a": b"abc"})
    bus.r.xadd(s.prefix_stream(2), {b"g": b"x", b"n": b"1", b"s": b"odd length"}, maxlen=1)
    router = Router(bus, "cache-aware")
    assert router.pick(PROMPT) == 0  # neither holder can be read: least-loaded
    assert router.engines[1].cached == router.engines[2].cached == set()
    assert sum("cannot be followed" in r.message for r in caplog.records) == 2
    assert not PrefixView().apply([(b"1-0", {b"n": b"1", b"s": b"odd"})])
    following = PrefixView()  # junk arriving first in a read, after entries that did follow on
    assert following.apply([(b"1-0", {b"g": b"x", b"n": b"1", b"s": array("Q", [7]).tobytes()})])
    assert not following.apply([(b"2-0", {b"g": b"x", b"n": b"not a number"})]) and following.last_id is None


def test_ties_go_to_the_least_loaded(bus: Bus) -> None:
    engine(bus, 0, load=3, cached=SYSTEM)
    engine(bus, 1, load=1, cached=SYSTEM)
    assert Router(bus, "cache-aware").pick(PROMPT) == 1


def test_an_overloaded_cache_holder_yields_to_the_least_loaded(bus: Bus) -> None:
    engine(bus, 0, load=BALANCE_ABS + 1, cached=PROMPT)
    engine(bus, 1, load=1)
    assert Router(bus, "cache-aware").pick(PROMPT) == 0  # not more than BALANCE_ABS above: the cache wins
    engine(bus, 0, load=BALANCE_ABS + 2, cached=PROMPT)
    assert Router(bus, "cache-aware").pick(PROMPT) == 1  # BALANCE_ABS + 1 above, and over 1.5 x


def test_a_burst_of_one_prefix_follows_its_first_request_until_overloaded(bus: Bus) -> None:
    """Within one refresh, what this router sent counts as cached there (it soon will be)."""
    engine(bus, 0)
    engine(bus, 1)
    router = Router(bus, "cache-aware")
    picks = [router.pick(PROMPT) for _ in range(2 * (BALANCE_ABS + 1))]
    # Then engine 1 holds it too and is less loaded, until the two tie.
    assert picks == [0] * (BALANCE_ABS + 1) + [1] * (BALANCE_ABS + 1)


def test_dead_engines_are_skipped(bus: Bus) -> None:
    engine(bus, 0, cached=PROMPT, alive=False)
    engine(bus, 1, load=3)
    for policy in ("cache-aware", "least-loaded", "round-robin"):
        assert {Router(bus, policy).pick(PROMPT) for _ in range(3)} == {1}


def test_a_request_sent_again_avoids_the_engine_that_lost_it(bus: Bus) -> None:
    """A restarted engine can look alive, idle and holding the prompt to a router that read it
    before the restart: a re-send names the engine that lost it, and goes elsewhere if it can."""
    engine(bus, 0, cached=PROMPT)
    engine(bus, 1, load=3)
    for policy in ("cache-aware", "least-loaded", "round-robin"):
        router = Router(bus, policy)
        assert router.pick(PROMPT) == 0
        assert {router.pick(PROMPT, avoid=0) for _ in range(3)} == {1}
    bus.r.delete(bus.streams.stats_key(1), *engine_beat_keys(bus.streams, [1]))
    assert Router(bus, "cache-aware").pick(PROMPT, avoid=0) == 0  # no other candidate: it waits there


def test_decode_engines_take_no_prompts(bus: Bus) -> None:
    engine(bus, 0, cached=PROMPT, role="decode")
    engine(bus, 1, load=3, role="prefill")
    assert Router(bus, "cache-aware").pick(PROMPT) == 1


def test_round_robin_cycles_live_engines(bus: Bus) -> None:
    for e in range(3):
        engine(bus, e, load=10 * e)
    router = Router(bus, "round-robin")
    assert [router.pick() for _ in range(5)] == [0, 1, 2, 0, 1]


def test_least_loaded_ignores_the_cache(bus: Bus) -> None:
    engine(bus, 0, load=2, cached=PROMPT)
    engine(bus, 1, load=1)
    assert Router(bus, "least-loaded").pick(PROMPT) == 1


def test_a_real_scheduler_publishes_its_served_prompt_blocks(redis_url: str, prefix: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler (real, over the broker; the worker a stand-in) serves a prompt: its prefix
    stream then holds the short hash of each of the prompt's full blocks."""
    monkeypatch.setattr(test_plan_timing, "STEP_S", 0.01)
    args = EngineArgs(model_dir="unused", max_num_seqs=8, max_num_batched_tokens=64, block_size=BS)
    with slow_engine(redis_url, prefix, args) as (client, _, _):
        submit(client, "a", 3 * BS + 3)  # token ids 3, 4, ...: three full blocks (+ 200 tokens: max_model_len)
        want = set(short_words(block_hashes(list(range(3, 3 + 3 * BS + 3)), BS)))
        deadline = time.monotonic() + 20
        view = PrefixView()
        while time.monotonic() < deadline:
            assert view.apply(client.r.xrange(client.streams.prefix_stream(0), view.start_from(time.monotonic()), "+"))
            if want <= view.words:
                break
            time.sleep(0.05)
        assert len(want) == 3 and want <= view.words


def test_serve_starts_data_parallel_engines_and_hands_the_tokenizer_its_policy() -> None:
    from rill.services.cli import build_parser
    from rill.services.launcher import build_children, engine_roles

    ns = build_parser().parse_args(["serve", "--data-parallel-size", "2", "--routing", "round-robin"])
    assert engine_roles(ns) == [(0, "both"), (1, "both")]
    kids = {k.name: k for k in build_children(ns, "/model")}
    assert {"worker-0-both", "scheduler-0-both", "worker-1-both", "scheduler-1-both"} <= set(kids)
    parsed = build_parser().parse_args(kids["tokenizer-0"].argv[3:])  # after `python -m rill.services.cli`
    assert parsed.name == "tokenizer" and parsed.routing == "round-robin"
    with pytest.raises(SystemExit):
        engine_roles(build_parser().parse_args(["serve", "--dp-size", "2", "--prefill-engines", "1",
                                                "--decode-engines", "1"]))
