"""Data-parallel routing (services/tokenizer/router.py) against a real Redis: stats, heartbeats
and prefix summaries written by hand for fake engines; and a real scheduler's summary."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import pytest
import test_plan_timing
from test_plan_timing import slow_engine, submit

from rill.services.scheduler.kv_cache_manager import KVCacheManager
from rill.services.scheduler.prefix_summary import PrefixSummary, summary_bytes
from rill.services.tokenizer.router import BALANCE_ABS, Router
from rill.shared.block_hash import SHORT_HASH_BYTES, block_hashes, pack_summary, parse_summary, short_words
from rill.shared.bus import Bus
from rill.shared.config import EngineArgs
from rill.shared.heartbeat import engine_beat_keys
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
           role: str = "both") -> None:
    """A fake engine: listed, stats with `load` waiting requests, a summary of the first blocks of
    `cached` (token ids), and both heartbeats unless dead."""
    s = bus.streams
    bus.r.sadd(s.engines_key(), e)
    bus.r.set(s.stats_key(e), encode(EngineStats(e, role=role, num_waiting=load, block_size=BS)))
    bus.r.set(s.prefix_summary_key(e), pack_summary(block_hashes(cached or [], BS)))
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
    assert parse_summary(pack_summary(hashes[::-1])) == set(words)
    assert parse_summary(None) == parse_summary(b"") == frozenset()
    kv = KVCacheManager(64, BS)
    kv.allocate("a", len(PROMPT))
    kv.register_full_blocks("a", hashes, len(PROMPT))
    assert len(summary_bytes(kv)) == 6 * SHORT_HASH_BYTES
    assert len(summary_bytes(kv, max_entries=2)) == 2 * SHORT_HASH_BYTES


def test_summary_is_rewritten_only_when_changed_and_not_too_often() -> None:
    kv, summary = KVCacheManager(64, BS), PrefixSummary("k", min_interval_s=0.25)
    assert summary.command(kv, now=10.0) == ("SET", "k", b"")
    assert summary.command(kv, now=20.0) is None  # unchanged
    kv.allocate("a", len(PROMPT))
    kv.register_full_blocks("a", block_hashes(PROMPT, BS), len(PROMPT))
    assert summary.command(kv, now=20.1) is not None
    kv.free("a")
    kv.allocate("b", 64 * BS)  # evicts every cached block
    assert summary.command(kv, now=20.2) is None  # too soon
    assert summary.command(kv, now=20.4) == ("SET", "k", b"")


def test_cache_aware_picks_the_longest_cached_prefix(bus: Bus) -> None:
    engine(bus, 0, load=1, cached=SYSTEM)
    engine(bus, 1, load=2, cached=PROMPT)  # the whole conversation so far
    engine(bus, 2, load=0)
    router = Router(bus, "cache-aware")
    assert router.pick(PROMPT) == 1
    assert router.pick(SYSTEM + [7] * 40) == 0  # 0 and 1 tie on 4 blocks: the less loaded one
    assert router.pick(list(range(900, 1000))) == 2  # no match anywhere: least-loaded


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
    """A scheduler (real, over the broker; the worker a stand-in) serves a prompt: its summary
    then holds the short hash of each of the prompt's full blocks."""
    monkeypatch.setattr(test_plan_timing, "STEP_S", 0.01)
    args = EngineArgs(model_dir="unused", max_num_seqs=8, max_num_batched_tokens=64, block_size=BS)
    with slow_engine(redis_url, prefix, args) as (client, _, _):
        submit(client, "a", 3 * BS + 3)  # token ids 3, 4, ...: three full blocks (+ 200 tokens: max_model_len)
        want = set(short_words(block_hashes(list(range(3, 3 + 3 * BS + 3)), BS)))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            got = parse_summary(client.r.get(client.streams.prefix_summary_key(0)))
            if want <= got:
                break
            time.sleep(0.05)
        assert len(want) == 3 and want <= got


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
