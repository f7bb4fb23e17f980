"""The scheduler's record of the requests it holds (services/scheduler/held_requests.py), on a
real broker: it follows the held requests, and a scheduler started after one that died answers
what that one left, once per client request, to live gateways only."""

from __future__ import annotations

import msgspec

from rill.services.scheduler.held_requests import HELD_TTL_S, SCHEDULER_RESTARTED, HeldRequests
from rill.services.scheduler.request import Request
from rill.services.scheduler.service import SchedulerService
from rill.shared.bus import Bus
from rill.shared.config import EngineArgs
from rill.shared.lifecycle import StopFlag
from rill.shared.request_params import SamplingParams
from rill.shared.schema import ErrorReply


def held(rid: str, reply_to: str, group: str = "") -> Request:
    return Request(request_id=rid, reply_to=reply_to, prompt_token_ids=[1, 2], params=SamplingParams(),
                   eos_token_ids=frozenset(), arrival_time=0.0, max_tokens=4, group_id=group)


def test_record_follows_the_requests_and_the_next_scheduler_answers_the_rest(redis_url: str, prefix: str) -> None:
    bus = Bus(redis_url, prefix, name="test")
    key = bus.streams.held_key(0)
    live, dead = bus.streams.reply("gw-live"), bus.streams.reply("gw-dead")
    bus.r.set(bus.streams.heartbeat("gateway", live), b"1", ex=60)
    reqs = {r.request_id: r for r in (held("a", live), held("b-0", live, "b"), held("b-1", live, "b"),
                                      held("c", dead))}
    old = HeldRequests(key)
    before, after = old.commands(reqs)
    assert before and not after
    bus.exchange(before)
    assert 0 < bus.r.ttl(key) <= HELD_TTL_S  # an engine id that never comes back leaves no record behind
    assert old.commands(reqs) == ([], [])  # nothing changed, nothing sent
    del reqs["a"]
    before, after = old.commands(reqs)
    assert not before and after
    bus.exchange(after)
    assert sorted(bus.r.hkeys(key)) == [b"b-0", b"b-1", b"c"]
    parked = {"c": reqs["c"]}  # its KV went to a decode engine, which now answers for it
    expire = ("EXPIRE", key, HELD_TTL_S)
    assert old.commands(reqs, parked) == ([], [("HDEL", key, "c"), expire])
    assert old.commands(reqs, {}) == ([("HSET", key, "c", f"{dead}\nc"), expire], [])

    new = HeldRequests(key)  # the old scheduler died; its successor already holds "d"
    bus.exchange(new.commands({"d": held("d", live)})[0])
    assert new.answer_left_over(bus) == 2  # "b" (two samples, one client request) and "c"
    replies = [msgspec.msgpack.decode(f[b"m"], type=ErrorReply) for _, f in bus.r.xrange(live)]
    assert [(r.request_id, r.status, r.message) for r in replies] == [("b", 503, SCHEDULER_RESTARTED)]
    assert not bus.r.exists(dead), "a dead gateway's reply stream was written"
    assert bus.r.hkeys(key) == [b"d"]
    assert new.answer_left_over(bus) == 0  # its own requests are not left over
    bus.close()


def test_a_starting_scheduler_withdraws_what_its_predecessor_published(redis_url: str, prefix: str) -> None:
    """The last scheduler's stats (its load) and prefix summary (its cache) would draw requests,
    resent ones too, to an engine whose new scheduler is not ready: they are gone before it is,
    and before the requests it left are answered (the gateways send those again at once)."""
    bus = Bus(redis_url, prefix, name="test")
    s = bus.streams
    bus.r.set(s.stats_key(0), b"old stats")
    bus.r.set(s.prefix_stream(0), b"old summary")
    live = s.reply("gw-live")
    bus.r.set(s.heartbeat("gateway", live), b"1", ex=60)
    bus.exchange(HeldRequests(s.held_key(0)).commands({"a": held("a", live)})[0])
    published_at_answer: list[int] = []
    send_many = bus.send_many
    bus.send_many = lambda sends: (published_at_answer.append(bus.r.exists(s.stats_key(0), s.prefix_stream(0))),
                                   send_many(sends))[1]  # type: ignore[method-assign]
    stop = StopFlag(install=False)
    stop.set()  # no worker here: run() returns from the handshake at once
    SchedulerService(bus, EngineArgs(model_dir="unused"), stop).run()
    assert not bus.r.exists(s.stats_key(0), s.prefix_stream(0))
    assert published_at_answer == [0] and bus.r.xlen(live) == 1
    bus.close()
