"""The engine's record, in the broker, of the requests its scheduler holds: a scheduler started
again after a crash answers each with an error at once.

The scheduler acks a request's input when it admits it; from then on the request lives only in
its memory. A scheduler that dies and is started again (a container restarted by Kubernetes or
compose) within the gateways' heartbeat grace never looks missing to them, so without this its
requests would wait for the gateway's progress deadline with nothing said.

One hash per engine (Streams.held_key): sample request id -> reply stream and client request id.
Kept current as two more commands of the scheduler's per-step exchange, no round trip of its
own: HSET of the requests admitted since the last exchange goes before the outbox (a request is
on record before its input is acked), HDEL of those gone after it (it leaves the record only once
its last output is sent). Each write renews the hash's expiry, so the record of an engine id that
never comes back leaves the broker on its own; a live engine's record holds only while it writes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from rill.services.scheduler.request import Request
from rill.shared.bus import Bus
from rill.shared.resp import Command
from rill.shared.schema import ENGINE_LOST_PREFIX, ErrorReply

log = logging.getLogger("rill.scheduler")

SCHEDULER_RESTARTED = (f"{ENGINE_LOST_PREFIX}: its scheduler stopped and started again while this request "
                       "was in flight; the request was not completed, please retry")
# Longer than any request waits between two changes of its engine's record (each admission or end
# renews it); a request running alone past this is no longer answered if its scheduler dies, and
# the gateway's progress deadline ends it instead.
HELD_TTL_S = 3600


class HeldRequests:
    """What this scheduler has on record, and the commands that bring the record up to date."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.recorded: set[str] = set()

    def commands(self, requests: Mapping[str, Request],
                 parked: Mapping[str, Request] | None = None) -> tuple[list[Command], list[Command]]:
        """(HSET of the requests not on record yet, HDEL of those no longer held): the first
        goes before the outbox, the second after it. A parked request (its KV on its way to or
        from another engine) is off the record: if this engine dies, the other one answers for
        it, or serves it."""
        held = requests.keys() - parked.keys() if parked else requests.keys()
        added = held - self.recorded
        removed = self.recorded - held
        before: list[Command] = []
        after: list[Command] = []
        if added:
            fields: list[str] = []
            for rid in added:
                req = requests[rid]
                fields += [rid, f"{req.reply_to}\n{req.group_id or rid}"]
            before += [("HSET", self.key, *fields), ("EXPIRE", self.key, HELD_TTL_S)]
            self.recorded |= added
        if removed:
            after += [("HDEL", self.key, *removed), ("EXPIRE", self.key, HELD_TTL_S)]
            self.recorded -= removed
        return before, after

    def answer_left_over(self, bus: Bus) -> int:
        """At start: fail every request on record that this scheduler did not put there (an
        earlier one died holding it) and take it off; how many client requests were answered.
        Only live gateways are written to (a dead one's reply stream would come back with no
        expiry). The requests this process put there (a loop started over after a broker error
        has failed them already) leave at the next exchange, as any request that is gone."""
        left: list[str] = []
        clients: dict[str, str] = {}  # client request id -> reply stream (n > 1: one answer)
        for rid, value in bus.r.hgetall(self.key).items():
            rid = rid.decode() if isinstance(rid, bytes) else rid
            if rid not in self.recorded:
                reply_to, _, client_id = (value.decode() if isinstance(value, bytes) else value).partition("\n")
                left.append(rid)
                clients[client_id] = reply_to
        if not left:
            return 0
        streams = sorted(set(clients.values()))
        beats = bus.mget([bus.streams.heartbeat("gateway", s) for s in streams])
        live = {s for s, beat in zip(streams, beats, strict=True) if beat is not None}
        bus.send_many([(reply_to, ErrorReply.of(client_id, SCHEDULER_RESTARTED, 503))
                       for client_id, reply_to in clients.items() if reply_to in live])
        bus.r.hdel(self.key, *left)
        log.warning("the engine's last scheduler stopped holding %d requests: answered each with an error", len(clients))
        return len(clients)
