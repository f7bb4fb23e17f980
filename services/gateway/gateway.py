"""The gateway's manager, one per process: its reply stream, reader and watch tasks; requests in and out.

One gateway owns one reply stream. A single background task reads it and routes every
delta to the request it belongs to (request_tracker.py); handlers only ever wait on their own
RequestStream.

Faults: the gateway beats a heartbeat key (so schedulers abort the requests of a gateway that
died) and a watch task checks, every WATCH_S, the broker (unreachable for BROKER_GRACE_S, or
restarted: a new run_id) and, with `watch_engine`, every engine's scheduler and worker
heartbeats. Each of those fails the requests in flight with a clear 503 error instead of
leaving them hanging: a lost engine's own requests (the tokenizer tells the gateway where it
sent each one, `Routed`) while other engines live, every request when none does; /health answers
503 and new requests are refused while no engine is live.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import msgspec
from redis.exceptions import OutOfMemoryError, RedisError

from rill.services.gateway.admission import DEFAULT_MAX_WAITING_REQUESTS, admit
from rill.services.gateway.bodies import DEFAULT_MAX_LOGPROBS
from rill.services.gateway.chat_output import DEFAULT_PARSERS, ChatParsers
from rill.services.gateway.deadline import DEFAULT_PROGRESS_TIMEOUT_S, stalled, timed_out
from rill.services.gateway.drain import DRAINING
from rill.services.gateway.engine_stats import RegisteredEngines
from rill.services.gateway.errors import (
    APIError,
)
from rill.services.gateway.metrics import GatewayMetrics
from rill.services.gateway.request_tracker import RequestStream, RequestTracker
from rill.services.gateway.requests import Admission
from rill.services.gateway.websocket import DEFAULT_WS_IDLE_TIMEOUT_S
from rill.shared.bus import AsyncBus, Backoff
from rill.shared.heartbeat import REPLY_TTL_S, Absence, Heartbeat, engine_beat_keys, engine_ids, engines_alive
from rill.shared.kinds import AbortReason
from rill.shared.lifecycle import POLL_MS
from rill.shared.schema import (
    ENGINE_LOST_PREFIX,
    AbortRequest,
    DetokenizeRequest,
    ErrorReply,
    GenerateRequest,
    TokenizeReply,
    TokenizeRequest,
    gateway_input_decoder,
)
from rill.shared.streams import Streams

log = logging.getLogger("rill.gateway")

# ---------------------------------------------------------------------------------------------
# The gateway: bus, reader task, watch task, submit / abort

WATCH_S = 0.5  # how often the watch task looks at the broker and the engine heartbeats
BROKER_GRACE_S = 2.0  # the broker unreachable this long fails the requests in flight
TRIM_EVERY_S = 2.0  # trimming what we already read from our reply stream
ENGINE_UNAVAILABLE = "the engine is not available: no scheduler and worker are running; retry later"
# A restarted scheduler is back within seconds (a worker loading a model may take longer): long
# enough for clients that honour Retry-After (the openai SDKs retry a 503 twice) to find it back.
ENGINE_RETRY_AFTER_S = 2
ENGINE_LOST = (f"{ENGINE_LOST_PREFIX}: its scheduler or worker stopped (no heartbeat) while this "
               "request was in flight; the request was not completed")
ONE_ENGINE_LOST = (f"{ENGINE_LOST_PREFIX}: engine {{engine}} stopped (no scheduler or worker heartbeat) "
                   "while it ran this request; the request was not completed; retry: new requests go to the "
                   "engines still running")
BROKER_LOST = "the message broker is unreachable; the request was not completed"
BROKER_RESTARTED = "the message broker restarted and lost this request; please retry"
BROKER_FAILED_OVER = "a message broker failover (a replica promoted) lost this request; please retry"
BROKER_FULL = "The message broker is full (its maxmemory); the request was not queued; retry later."
REPLICA_ROLES = ("tokenizer", "detokenizer")  # /health needs a live replica of each
MAX_RESENDS = 1  # times a request its client saw nothing of is sent again after its engine was lost
CALL_TIMEOUT_S = 30.0  # a /tokenize or /detokenize answer; tokenizer replicas answer in milliseconds


@dataclass
class Gateway:
    redis_url: str
    prefix: str
    model_name: str
    max_model_len: int
    gateway_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    # Refuse and fail requests while no engine heartbeats (the deployed gateway does; a gateway
    # whose downstream services are played by a test harness does not).
    watch_engine: bool = False
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    ignore_unknown_fields: bool = False  # --ignore-unknown-fields: drop (and log) them instead of a 400
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS  # admission.py; 0: no cap
    progress_timeout_s: float = DEFAULT_PROGRESS_TIMEOUT_S  # deadline.py; 0: none
    ws_idle_timeout_s: float = DEFAULT_WS_IDLE_TIMEOUT_S  # websocket.py; 0: none
    chat_parsers: ChatParsers = DEFAULT_PARSERS  # the model's tool-call and reasoning formats

    def __post_init__(self) -> None:
        self.bus: AsyncBus | None = None
        self.metrics = GatewayMetrics(self.model_name)  # this gateway's own registry (/metrics)
        self.tracker = RequestTracker(self.metrics)
        self.tracker.resend = self.resend
        self._reader: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._heartbeat: Heartbeat | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._cursor = b"0-0"  # last entry read from our reply stream
        self.engine_live = True  # as of the last watch; only consulted with watch_engine
        self._engine_seen = False  # whether any watch found an engine live
        self.broker_ok = True
        self._server: str | None = None  # the broker's run_id
        self._masters: dict[str, str] = {}  # on a cluster, the master of each of our keys
        self._engines = RegisteredEngines()  # where aborts go
        self._engine_gone = Absence()
        self._engines_gone: dict[int, Absence] = {}  # each engine's, for the requests sent to it
        self._replicas_gone = {role: Absence() for role in REPLICA_ROLES}
        self._broker_gone = Absence(BROKER_GRACE_S)
        self.draining = False  # SIGTERM: /health 503, no new requests (drain.py)

    @property
    def admission(self) -> Admission:  # the settings request validation depends on (requests.py)
        return Admission(self.model_name, self.max_logprobs, self.ignore_unknown_fields, self.max_model_len,
                         self.max_waiting_requests, self.chat_parsers.reasoning != "none")

    @property
    def reply_stream(self) -> str:
        return Streams(self.prefix).reply(self.gateway_id)

    @property
    def requests_stream(self) -> str:
        """Where this gateway's requests go; every tokenizer replica reads it."""
        return Streams(self.prefix).requests(self.gateway_id)

    async def start(self) -> None:
        self.bus = AsyncBus(self.redis_url, self.prefix, name=self.gateway_id)
        # Read only what arrives after start; the id is taken before any request is sent.
        self._cursor = await self.bus.last_id(self.reply_stream)
        s = self.bus.streams
        self._heartbeat = Heartbeat(self.redis_url, s.heartbeat("gateway", self.reply_stream),
                                    members=[(s.gateways_key(), self.reply_stream)],
                                    expire=[(self.reply_stream, REPLY_TTL_S), (self.requests_stream, REPLY_TTL_S)])
        await asyncio.to_thread(self._heartbeat.start)
        await self._watch_once()
        self._reader = asyncio.create_task(self._read_loop(), name="gateway-reply-reader")
        self._watcher = asyncio.create_task(self._watch_loop(), name="gateway-watch")
        log.info("gateway started id=%s reply=%s model=%s", self.gateway_id, self.reply_stream,
                 self.model_name)

    async def stop(self) -> None:
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._reader = self._watcher = None
        if self._heartbeat is not None:
            await asyncio.to_thread(self._heartbeat.stop)
            self._heartbeat = None
        if self.bus is None:
            return
        # Free engine resources held by requests that will never be read now.
        pending = self.tracker.ids()
        with contextlib.suppress(Exception):
            if pending:
                await self.abort(pending)
        for task in list(self._background):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 2.0)
        with contextlib.suppress(Exception):
            await self.bus.r.delete(self.reply_stream)  # nobody will ever read it again
        await self.bus.close()
        self.bus = None

    async def _read_loop(self) -> None:
        assert self.bus is not None
        backoff = Backoff()
        while True:
            try:
                entries = await self.bus.read(self.reply_stream, self._cursor, POLL_MS)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis restarting or unreachable: keep trying (the watch
                if not backoff.failures:  # task fails the requests if it lasts)
                    log.warning("reply stream read failed, retrying: %r", exc)
                await asyncio.sleep(backoff.next())
                continue
            backoff.reset()
            for entry_id, payload in entries:
                self._cursor = entry_id
                try:
                    msg = gateway_input_decoder.decode(payload)
                except msgspec.DecodeError as exc:
                    log.warning("undecodable reply entry %s: %s", entry_id, exc)
                    continue
                try:
                    self.tracker.dispatch(msg)
                except Exception:  # one bad message must not stop every other request's replies
                    log.exception("could not route reply entry %s", entry_id)

    # -------------------------------------------------------------------------- watching

    async def _watch_loop(self) -> None:
        next_trim = time.monotonic() + TRIM_EVERY_S
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                await self._watch_once()
                self._expire_stalled()
                if self.broker_ok and time.monotonic() >= next_trim:
                    next_trim = time.monotonic() + TRIM_EVERY_S
                    await self._trim_reply_stream()
            except asyncio.CancelledError:
                raise
            except Exception:  # the watch must outlive any bug in one round
                log.exception("gateway watch round failed")

    async def _watch_once(self) -> None:
        """One look at the broker and the engines; fails the requests in flight when they are lost."""
        assert self.bus is not None
        now = time.monotonic()
        try:
            pipe = self.bus.r.pipeline(transaction=False)
            pipe.smembers(self.bus.streams.engines_key())
            for role in REPLICA_ROLES:
                pipe.smembers(self.bus.streams.replicas_key(role))
            members, *replicas = await asyncio.wait_for(pipe.execute(), 5.0)
            engines = engine_ids(members) or [0]
            s = self.bus.streams
            server, masters = await asyncio.wait_for(self.bus.server_id(
                [self.requests_stream, self.reply_stream, *(s.engine_in(e) for e in engines)]), 5.0)
            live = True
            lost: list[int] = []
            if self.watch_engine:
                keys = engine_beat_keys(s, engines)
                spans = []  # each role's slice of the keys: every heartbeat in one MGET
                for role, names in zip(REPLICA_ROLES, replicas, strict=True):
                    spans.append((role, len(keys), len(keys) + len(names)))
                    keys += [s.heartbeat(role, n.decode() if isinstance(n, bytes) else n) for n in names]
                beats = await self.bus.mget(keys)
                alive = engines_alive(beats, len(engines))
                live = any(alive)
                lost = [e for e, up in zip(engines, alive, strict=True)
                        if self._engines_gone.setdefault(e, Absence()).observe(up, now)]
                for role, lo, hi in spans:
                    self._replicas_gone[role].observe(any(b is not None for b in beats[lo:hi]), now)
        except Exception as exc:  # the broker is unreachable (or answers with errors)
            if self.broker_ok:
                log.warning("broker unreachable: %r", exc)
            self.broker_ok = False
            if self._broker_gone.observe(False, now):
                self.fail_in_flight(BROKER_LOST)
            return
        self.broker_ok = True
        self._broker_gone.observe(True, now)
        if self._server is not None and server != self._server:
            self._lost_writes(masters)
        self._server, self._masters = server, masters
        if live != self.engine_live:
            if self._engine_seen:
                log.warning("engine %s", "live again" if live else "not available (no scheduler/worker heartbeat)")
            else:  # starting beside the engines: waiting for their first beat is no fault
                log.info("engine %s", "live" if live else "not live yet (no scheduler/worker heartbeat)")
        self._engine_seen = self._engine_seen or live
        self.engine_live = live
        for e in lost if live else ():  # with none live, every request fails below
            self.fail_engine_requests(e)
        if self._engine_gone.observe(live, now):
            self.fail_in_flight(ENGINE_LOST)

    def _lost_writes(self, masters: dict[str, str]) -> None:
        """The broker restarted: everything in flight went down with it. A cluster's failover
        (`masters`: each of our keys' master now) loses writes only where the master changed: all
        our requests if our streams moved, else those of engines whose streams did, and unrouted ones."""
        moved = {key for key, master in masters.items() if self._masters.get(key, master) != master}
        if not masters or {self.requests_stream, self.reply_stream} & moved:
            log.warning("the broker restarted or failed over: failing %d in flight", len(self.tracker))
            self.fail_in_flight(BROKER_FAILED_OVER if masters else BROKER_RESTARTED)
            self._cursor = b"0-0"  # our reply stream starts afresh
        elif moved:
            s = Streams(self.prefix)
            ids = [st.request_id for st in self.tracker.streams()
                   if st.engine is None or s.engine_in(st.engine) in moved]
            log.warning("a broker failover moved engine streams: failing %d requests in flight", len(ids))
            self.fail_in_flight(BROKER_FAILED_OVER, ids)

    def _expire_stalled(self) -> None:
        ids = stalled(self.tracker.streams(), time.monotonic(), self.progress_timeout_s)
        if not ids:
            return
        log.warning("%d requests made no progress for %g s: ending them", len(ids), self.progress_timeout_s)
        for rid in ids:
            self.tracker.fail(rid, timed_out(rid, self.progress_timeout_s))
        self.abort_soon(ids)  # frees their engine blocks

    @property
    def missing_roles(self) -> list[str]:
        """Stateless roles with no live replica for a while (their requests wait in the stream)."""
        return [role for role, gone in self._replicas_gone.items() if gone.lost] if self.watch_engine else []

    def fail_in_flight(self, message: str, ids: list[str] | None = None) -> None:
        """End the requests in flight (`ids`, else all) with a 503 error (or send them again:
        resend), and tell the engines to drop those that ended."""
        ids = self.tracker.ids() if ids is None else ids
        ended = [rid for rid in ids if self.tracker.fail(rid, ErrorReply.of(rid, message, 503))]
        if ended:
            self.abort_soon(ended)

    def resend(self, stream: RequestStream, err: ErrorReply) -> bool:
        """Whether a request whose engine was lost before its client saw anything (no token
        released, or a non-streaming reply) goes to the tokenizers once more, under a new engine
        id (their router picks a live engine), rather than failing: the client sees nothing of it
        but the wait. Not while draining, with no engine live, or for any other error."""
        if (stream.sent is None or stream.resent >= MAX_RESENDS or err.status != 503
                or not err.message.startswith(ENGINE_LOST_PREFIX) or self.draining or self.bus is None
                or (self.watch_engine and not self.engine_live)):
            return False
        lost, engine = stream.engine_request_id, stream.engine
        self.tracker.renew(stream, f"{stream.request_id}~{stream.resent + 1}")
        log.debug("request %s lost with its engine before its client saw it: sent again", lost)
        self.metrics.resent.inc()
        self._in_background(self._resend(stream, lost, err, -1 if engine is None else engine))
        return True

    async def _resend(self, stream: RequestStream, lost: str, err: ErrorReply, engine: int) -> None:
        assert self.bus is not None and stream.sent is not None
        try:  # not to the engine that lost it, while another runs (router.py)
            await self.bus.send(self.requests_stream, msgspec.structs.replace(
                stream.sent, request_id=stream.engine_request_id, avoid_engine=engine))
        except Exception as exc:  # the first error stands
            log.warning("could not send %s again: %r", stream.request_id, exc)
            self.tracker.fail(stream.request_id, err)
        try:  # wherever the lost id still sits (an engine that comes back)
            await self._send_abort([lost], "abort")
        except Exception as exc:
            log.warning("abort of %s failed: %r", lost, exc)

    def fail_engine_requests(self, engine: int) -> None:
        """End the requests sent to a lost engine with a 503 error (the others run on)."""
        ids = [s.request_id for s in self.tracker.streams() if s.engine == engine]
        if ids:
            log.warning("engine %d lost: failing its %d requests in flight", engine, len(ids))
            self.fail_in_flight(ONE_ENGINE_LOST.format(engine=engine), ids)

    async def _trim_reply_stream(self) -> None:
        """Drop what our cursor passed (XTRIM MINID ~); best effort: a reshard may refuse it now."""
        if self.bus is not None and self._cursor != b"0-0":
            with contextlib.suppress(RedisError):
                await self.bus.r.xtrim(self.reply_stream, minid=self._cursor, approximate=True)

    # ---------------------------------------------------------------------------- requests

    async def submit(self, req: GenerateRequest, buffered: bool = False) -> RequestStream:
        """Register first, then send, so a fast reply can never arrive before its stream exists."""
        stream = self.tracker.register(req.request_id, req.params.n, buffered)
        try:
            await self.send_request(req)
        except APIError:
            self.tracker.unregister(req.request_id)
            raise
        return stream

    def _mark_accepted(self, request_id: str, accepted: bool) -> None:
        stream = self.tracker.get(request_id)
        if stream is not None and stream.metrics is not None:
            stream.metrics.accepted = accepted

    async def send_request(self, req: GenerateRequest) -> None:
        """Queue a registered request for the tokenizers."""
        assert self.bus is not None
        if self.draining:
            raise APIError(DRAINING, 503, type="server_error")
        if self.watch_engine and not self.engine_live:
            raise APIError(ENGINE_UNAVAILABLE, 503, type="server_error",
                           headers={"Retry-After": str(ENGINE_RETRY_AFTER_S)})
        admit(len(self.tracker.waiting), self.max_waiting_requests)
        try:
            # Counted in /metrics from now on (set before the send: its replies may come first).
            self._mark_accepted(req.request_id, True)
            stream = self.tracker.get(req.request_id)
            if stream is not None:
                stream.sent = req  # for a re-send (resend)
            await self.bus.send(self.requests_stream, req)
        except Exception as exc:
            self._mark_accepted(req.request_id, False)  # answered with an error at once: not counted
            log.warning("could not submit %s: %r", req.request_id, exc)
            if isinstance(exc, OutOfMemoryError):  # at its maxmemory (noeviction): refuse, kill nothing
                raise APIError(BROKER_FULL, 503, type="server_error") from exc
            raise APIError("The server could not queue the request; try again.", 503) from exc

    async def call(self, msg: TokenizeRequest | DetokenizeRequest) -> TokenizeReply:
        """Ask a tokenizer replica (through the requests stream, like generate requests) and wait."""
        assert self.bus is not None
        msg = msgspec.structs.replace(msg, request_id=f"call-{uuid.uuid4().hex}", reply_to=self.reply_stream)
        fut: asyncio.Future[TokenizeReply | ErrorReply] = asyncio.get_running_loop().create_future()
        self.tracker.calls[msg.request_id] = fut
        try:
            try:
                await self.bus.send(self.requests_stream, msg)
            except Exception as exc:
                raise APIError("The server could not queue the request; try again.", 503) from exc
            try:
                reply = await asyncio.wait_for(fut, CALL_TIMEOUT_S)
            except TimeoutError:
                raise APIError("No tokenizer answered in time; try again.", 503, type="server_error") from None
        finally:
            self.tracker.calls.pop(msg.request_id, None)
        if isinstance(reply, ErrorReply):
            raise APIError(reply.message, reply.status if 400 <= reply.status <= 599 else 500, type=reply.type,
                           param=reply.param)
        return reply

    async def detokenize(self, token_ids: list[int]) -> TokenizeReply:
        return await self.call(DetokenizeRequest(request_id="", reply_to="", token_ids=token_ids))

    async def abort(self, request_ids: list[str], reason: AbortReason = "abort") -> None:
        """Stop routing these requests and tell every engine to drop them (idempotent there)."""
        engine_ids = [self.tracker.engine_id(rid) for rid in request_ids]
        for rid in request_ids:
            self.tracker.unregister(rid)
        await self._send_abort(engine_ids, reason)

    async def _send_abort(self, engine_ids: list[str], reason: AbortReason) -> None:
        if self.bus is None or not engine_ids:
            return
        msg = AbortRequest(request_ids=engine_ids, reason=reason)
        engines = await self._engines.read(self.bus)
        # The bus writes sends waiting together in one pipelined round trip.
        await asyncio.gather(*(self.bus.send(self.bus.streams.engine_in(e), msg) for e in engines))

    def abort_soon(self, request_ids: list[str]) -> None:
        """Abort from code that may itself be cancelled (disconnect paths): run it as its own task."""
        for rid in request_ids:
            self.tracker.unregister(rid)
        self._in_background(self._abort_logged(request_ids))

    def _in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_logged(self, request_ids: list[str]) -> None:
        try:
            await self.abort(request_ids)
        except Exception as exc:
            log.warning("abort of %s failed: %r", request_ids, exc)
