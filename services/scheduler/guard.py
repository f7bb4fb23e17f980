"""Fault handling around the scheduler's loop, kept apart from the scheduling code.

- Heartbeat: `hb:scheduler:{engine}`, beaten by a thread, which also keeps the engine in the
  engines set (so it is listed again right after a broker restart).
- Worker loss: while a step is out, the worker's heartbeat is watched; once it has been gone
  for GRACE_S, every request fails with a clear 503 error and the scheduler carries on without
  a worker. Requests that arrive meanwhile fail the same way within seconds; the restarted
  worker's WorkerReady makes the scheduler start over with it (see SchedulerService).
- Dead gateways: requests whose gateway (its reply stream) announced itself and then stopped
  beating are aborted, freeing their KV blocks, each with an error reply (a gateway that only
  looked dead passes it on); the dead gateway's reply stream is left to expire. One that beats
  and announces itself again is alive again.
- Broker restarts: the broker's run_id is compared every second; a new one raises
  BrokerRestarted, so the loop starts over (the restarted broker lost plans, results, groups).
- Trimming: entries of the engine's input stream that were read and acked are trimmed away.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from rill.services.scheduler.request import Request
from rill.services.scheduler.scheduler import Scheduler
from rill.shared.bus import BrokerRestarted, Bus
from rill.shared.heartbeat import REPLY_TTL_S, Absence, Heartbeat
from rill.shared.schema import ENGINE_LOST_PREFIX

log = logging.getLogger("rill.scheduler.guard")

WORKER_CHECK_S = 0.5
GATEWAY_CHECK_S = 1.0
BROKER_CHECK_S = 1.0
TRIM_EVERY_S = 2.0
WORKER_LOST = (f"{ENGINE_LOST_PREFIX}: its worker stopped (no heartbeat); "
               "the request was not completed, retry once the engine is back")
GATEWAY_LOST = ("the engine lost its gateway's heartbeat and dropped this request; "
                "the request was not completed, please retry")


class EngineGuard:
    """The faults of one engine (module doc). It reads the scheduler through `sched` (None until
    the worker is configured) and reports through `send_errors` and `publish_stats`."""

    def __init__(self, bus: Bus, engine_id: int, sched: Callable[[], Scheduler | None],
                 send_errors: Callable[[list[Request], str, int], None], publish_stats: Callable[[], None]) -> None:
        self.bus = bus
        s = bus.streams
        self.in_stream = s.engine_in(engine_id)
        self.sched = sched
        self.send_errors = send_errors
        self.publish_stats = publish_stats
        self.heartbeat = Heartbeat(bus.url, s.heartbeat("scheduler", engine_id),
                                   members=[(s.engines_key(), engine_id)])
        self.worker_key = s.heartbeat("worker", engine_id)
        self.worker = Absence()
        self._worker_checked = 0.0
        self.gateways: dict[str, Absence] = {}
        self.dead: OrderedDict[str, None] = OrderedDict()  # reply streams of dead gateways (bounded)
        self.server: str | None = None
        self._next_gateways = self._next_broker = self._next_trim = 0.0

    def start(self) -> None:
        self.heartbeat.start()

    def stop(self) -> None:
        self.heartbeat.stop()

    def tick(self) -> None:
        """Called once per loop iteration; each check runs at its own pace."""
        now = time.monotonic()
        if now >= self._next_broker:
            self._next_broker = now + BROKER_CHECK_S
            self.check_broker()
        if now >= self._next_gateways:
            self._next_gateways = now + GATEWAY_CHECK_S
            self.reap_gateways(now)
        if now >= self._next_trim:
            self._next_trim = now + TRIM_EVERY_S
            self.bus.trim_consumed(self.in_stream)

    # ------------------------------------------------------------------------------ broker

    def check_broker(self) -> None:
        server = self.bus.server_id(self.in_stream)
        if self.server is None:
            self.server = server
        elif server != self.server:
            self.server = server
            raise BrokerRestarted("the broker restarted (new run_id): its streams and groups are gone")

    def resync_broker(self) -> None:
        """After a broker error: remember the server we are now talking to."""
        self.server = self.bus.server_id(self.in_stream)

    # ------------------------------------------------------------------------------ worker

    def worker_lost(self) -> bool:
        """Whether the worker's heartbeat has been missing for GRACE_S (checked at most every 0.5 s)."""
        now = time.monotonic()
        if now - self._worker_checked >= WORKER_CHECK_S:
            self._worker_checked = now
            return self.worker.observe(bool(self.bus.r.exists(self.worker_key)), now)
        return self.worker.lost

    def fail_all(self, message: str, status: int = 503) -> int:
        """End every request with an error (the worker or the broker lost them); returns how many."""
        sched = self.sched()
        if sched is None:
            return 0
        reqs = list(sched.requests.values())
        for req in reqs:
            sched.abort(req.request_id)
        self.send_errors(reqs, message, status)
        sched.reset_worker()  # nothing in flight, nothing for a worker to forget
        if reqs:
            log.warning("failed %d requests: %s", len(reqs), message)
        self.publish_stats()
        return len(reqs)

    # ---------------------------------------------------------------------------- gateways

    def reap_gateways(self, now: float) -> None:
        sched = self.sched()
        if sched is None:
            return
        targets = sorted({req.reply_to for req in sched.requests.values()})
        for gone in set(self.gateways) - set(targets):
            del self.gateways[gone]
        if not targets:
            return
        s = self.bus.streams
        pipe = self.bus.r.pipeline(transaction=False)
        pipe.smembers(s.gateways_key())
        for t in targets:
            pipe.exists(s.heartbeat("gateway", t))
        registered_raw, *alive = pipe.execute()
        registered = {m.decode() if isinstance(m, bytes) else m for m in registered_raw}
        dead: list[str] = []
        for t, beating in zip(targets, alive, strict=True):
            if t in self.dead and beating and t in registered:
                # Declared dead while its key was out of reach (a broker failover, a stalled
                # beat), yet beating and announced again: alive, and its new requests are served.
                del self.dead[t]
                self.gateways.pop(t, None)
                log.warning("gateway %s is beating again: serving its requests", t)
            if t in self.dead:
                dead.append(t)  # a late request of a gateway already declared dead
            elif t not in registered:
                self.gateways.pop(t, None)  # not a gateway that announced itself (e.g. a test harness)
            elif self.gateways.setdefault(t, Absence()).observe(bool(beating), now):
                dead.append(t)
        if not dead:
            return
        doomed = set(dead)
        reqs = [req for req in sched.requests.values() if req.reply_to in doomed]
        ids = [req.request_id for req in reqs]
        for rid in ids:
            sched.abort(rid)
        # Each also gets an error reply: a gateway that only looked dead tells its client at once
        # instead of leaving it waiting; a dead one's stream expires with it unread (below).
        self.send_errors(reqs, GATEWAY_LOST, 503)
        pipe = self.bus.r.pipeline(transaction=False)
        for t in dead:
            pipe.expire(t, REPLY_TTL_S)  # also recreated by an error reply after it had expired
            if t not in self.dead:
                log.warning("gateway %s stopped beating: aborted its requests", t)
                pipe.srem(s.gateways_key(), t)
                pipe.expire(s.requests_for(t), REPLY_TTL_S)  # nobody writes this one any more
                self.dead[t] = None
                self.gateways.pop(t, None)
        while len(self.dead) > 4096:
            self.dead.popitem(last=False)
        pipe.execute()
        if ids:
            log.warning("aborted %d requests of dead gateways", len(ids))
            self.publish_stats()
