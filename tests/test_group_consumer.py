"""serve_streams: one consumer group over a changing set of streams (one per gateway, one per
engine), against a real broker."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from rill.shared.bus import FIELD, Bus, Entry
from rill.shared.group_consumer import serve_streams
from rill.shared.lifecycle import StopFlag
from rill.shared.resp import Command

GROUP = "g"


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_streams_join_and_leave_and_handlers_never_overlap(redis_url: str, prefix: str) -> None:
    bus = Bus(redis_url, prefix)
    a, b = bus.streams.detok(0), bus.streams.detok(1)
    listed: list[str] = [a]
    handled: dict[str, list[bytes]] = {a: [], b: []}
    active, most = [0], [0]

    def handle(rbus: Bus, stream: str, entries: list[Entry]) -> list[Command]:
        active[0] += 1
        most[0] = max(most[0], active[0])
        time.sleep(0.01)  # long enough for another stream's thread to try to overlap
        handled[stream] += [payload for _, payload in entries]
        active[0] -= 1
        return [Bus.xack(stream, GROUP, [entry_id for entry_id, _ in entries])]

    stop = StopFlag(install=False)
    thread = threading.Thread(target=serve_streams, daemon=True,
                              args=(redis_url, prefix, GROUP, "c", lambda _bus: list(listed), handle, stop))
    thread.start()
    try:
        for i in range(20):
            bus.r.xadd(a, {FIELD: b"a%d" % i})
            bus.r.xadd(b, {FIELD: b"b%d" % i})
        wait_for(lambda: len(handled[a]) == 20, "the listed stream was not read")
        time.sleep(0.7)
        assert handled[b] == [], "a stream nobody listed was read"

        listed.append(b)  # an engine (or gateway) appears: its backlog is read from the start
        wait_for(lambda: len(handled[b]) == 20, "a newly listed stream was not read")
        assert handled[a] == [b"a%d" % i for i in range(20)] and handled[b] == [b"b%d" % i for i in range(20)]
        assert most[0] == 1, "handlers ran at the same time"

        listed.remove(a)  # it leaves the list: its reader stops, later entries wait for another reader
        wait_for(lambda: f"read:{a}" not in {t.name for t in threading.enumerate()}, "the reader of a kept reading")
        bus.r.xadd(a, {FIELD: b"late"})
        bus.r.xadd(b, {FIELD: b"b20"})
        wait_for(lambda: len(handled[b]) == 21, "b stopped being read")
        assert b"late" not in handled[a]
        assert bus.r.xpending(a, GROUP)["pending"] == 0 and bus.r.xpending(b, GROUP)["pending"] == 0
    finally:
        stop.set()
        thread.join(10)
        bus.close()
    assert not thread.is_alive()


def test_an_entry_the_handler_fails_on_is_dropped_and_the_rest_served(redis_url: str, prefix: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A handler bug on one entry (handlers answer bad input themselves) neither ends the reader
    nor, redone forever, stalls the entries behind it: the batch is handled again one entry at a
    time and the entry that fails alone is logged and acked."""
    bus = Bus(redis_url, prefix)
    stream = bus.streams.detok(0)
    handled: list[bytes] = []
    tries: list[int] = []

    def handle(rbus: Bus, stream_: str, entries: list[Entry]) -> list[Command]:
        tries.append(len(entries))
        if any(payload == b"poison" for _, payload in entries):
            raise ValueError("a handler bug")
        handled.extend(payload for _, payload in entries)
        return [Bus.xack(stream_, GROUP, [entry_id for entry_id, _ in entries])]

    for i in range(10):  # in the stream before the reader starts: one batch holds them all
        bus.r.xadd(stream, {FIELD: b"poison" if i == 4 else b"e%d" % i})
    poison_id = bus.r.xrange(stream)[4][0].decode()
    stop = StopFlag(install=False)
    thread = threading.Thread(target=serve_streams, daemon=True,
                              args=(redis_url, prefix, GROUP, "c", lambda _bus: [stream], handle, stop))
    with caplog.at_level(logging.ERROR, logger="rill.bus"):
        thread.start()
        try:
            wait_for(lambda: len(handled) == 9, "the entries beside the failing one were not served")
            bus.r.xadd(stream, {FIELD: b"later"})
            wait_for(lambda: handled[-1:] == [b"later"], "the reader stopped after the failure")
            assert handled == [b"e%d" % i for i in range(10) if i != 4] + [b"later"]
            assert tries[0] == 10 and tries[1:11] == [1] * 10, tries
            # The handler's ack goes out after it returns: wait for it rather than race it.
            wait_for(lambda: bus.r.xpending(stream, GROUP)["pending"] == 0, "an entry was left unacknowledged")
        finally:
            stop.set()
            thread.join(10)
            bus.close()
    dropped = [r for r in caplog.records if "dropping entry" in r.getMessage()]
    assert len(dropped) == 1 and poison_id in dropped[0].getMessage() and dropped[0].exc_info
