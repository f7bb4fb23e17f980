"""The gateway process: app factory, lifecycle, the reply-stream reader and the request registry.

One gateway owns one reply stream. A single background task reads it and routes every
delta to the request it belongs to; handlers only ever wait on their own RequestStream.
Detokenizer replicas may deliver a request's deltas out of order or twice (after a crash),
so each request keeps a DeltaSequencer that releases text exactly once, in offset order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException

from rill.services.gateway import openai_api, websocket
from rill.services.gateway.errors import (
    APIError,
    api_error_handler,
    http_exception_handler,
    internal_error_handler,
)
from rill.shared.bus import FIELD, MAXLEN, AsyncBus, Streams
from rill.shared.lifecycle import POLL_MS
from rill.shared.schema import (
    AbortRequest,
    ErrorReply,
    GatewayInput,
    GenerateRequest,
    ReplyBatch,
    TextDelta,
    encode,
    gateway_input_decoder,
)

log = logging.getLogger("rill.gateway")

# ---------------------------------------------------------------------------------------------
# Exactly-once, in-order delivery (pure, no I/O)


class DeltaSequencer:
    """Releases a request's deltas in offset order, each once, and nothing after the finish.

    A delta applies when its offset is the next expected one; earlier offsets are duplicates
    and dropped; later ones wait in `pending` until the gap is filled.
    """

    __slots__ = ("next_offset", "pending", "finished")

    def __init__(self) -> None:
        self.next_offset = 0
        self.pending: dict[int, TextDelta] = {}
        self.finished = False

    def push(self, delta: TextDelta) -> list[TextDelta]:
        if self.finished or delta.offset < self.next_offset:
            return []
        if delta.offset > self.next_offset:
            self.pending.setdefault(delta.offset, delta)
            return []
        out: list[TextDelta] = []
        nxt: TextDelta | None = delta
        while nxt is not None:
            out.append(nxt)
            self.next_offset += nxt.num_tokens
            if nxt.finish_reason is not None:
                self.finished = True
                self.pending.clear()
                break
            nxt = self.pending.pop(self.next_offset, None)
        return out


# ---------------------------------------------------------------------------------------------
# Per-request event streams and the registry


Event = TextDelta | ErrorReply


class RequestStream:
    """What one handler waits on: batches of in-order TextDeltas, ending with a finish or an error.

    Iterating yields lists (everything that arrived since the last wake-up), so a slow
    consumer sends one chunk per wake-up instead of falling behind one chunk per step.
    Iteration stops after the terminal event, or at once when the request was cancelled here.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.sequencer = DeltaSequencer()
        self._buf: list[Event] = []
        self._wake = asyncio.Event()
        self.terminal = False  # a finish or error was queued
        self.closed = False  # cancelled locally: stop without a terminal event
        self._done = False  # the terminal event was handed out

    def _put(self, events: list[Event]) -> None:
        if events and not self.closed:
            self._buf.extend(events)
            self._wake.set()

    def feed(self, delta: TextDelta) -> None:
        out = self.sequencer.push(delta)
        if out and out[-1].finish_reason is not None:
            self.terminal = True
        self._put(out)

    def fail(self, err: ErrorReply) -> None:
        if not self.terminal:
            self.terminal = True
            self._put([err])

    def close(self) -> None:
        self.closed = True
        self._buf.clear()
        self._wake.set()

    def __aiter__(self) -> AsyncIterator[list[Event]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[list[Event]]:
        while True:
            if not self._buf:
                if self.closed or self._done:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch, self._buf = self._buf, []
            if isinstance(batch[-1], ErrorReply) or batch[-1].finish_reason is not None:
                self._done = True
            yield batch


class RequestTracker:
    """Registry of this gateway's in-flight requests; routes reply messages to their streams."""

    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}

    def register(self, request_id: str) -> RequestStream:
        if request_id in self._streams:
            raise KeyError(f"request {request_id} is already in flight")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        return stream

    def unregister(self, request_id: str) -> bool:
        """Forget a request (cancelled, disconnected); its stream stops. True if it was in flight."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        stream.close()
        return True

    def dispatch(self, msg: GatewayInput) -> None:
        if isinstance(msg, ReplyBatch):
            for delta in msg.deltas:
                stream = self._streams.get(delta.request_id)
                if stream is None:
                    continue  # finished, cancelled, or another gateway generation's id
                stream.feed(delta)
                if stream.terminal:
                    del self._streams[delta.request_id]
        elif isinstance(msg, ErrorReply):
            stream = self._streams.pop(msg.request_id, None)
            if stream is not None:
                stream.fail(msg)

    def ids(self) -> list[str]:
        return list(self._streams)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)


# ---------------------------------------------------------------------------------------------
# The gateway: bus, reader task, submit / abort


@dataclass
class Gateway:
    redis_url: str
    prefix: str
    model_name: str
    max_model_len: int
    gateway_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.bus: AsyncBus | None = None
        self.tracker = RequestTracker()
        self._reader: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    @property
    def reply_stream(self) -> str:
        return Streams(self.prefix).reply(self.gateway_id)

    async def start(self) -> None:
        self.bus = AsyncBus(self.redis_url, self.prefix)
        # Read only what arrives after start; the id is taken before any request is sent.
        last = await self.bus.last_id(self.reply_stream)
        self._reader = asyncio.create_task(self._read_loop(last), name="gateway-reply-reader")
        log.info("gateway started id=%s reply=%s model=%s", self.gateway_id, self.reply_stream,
                 self.model_name)

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
            self._reader = None
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

    async def _read_loop(self, last: bytes) -> None:
        assert self.bus is not None
        while True:
            try:
                entries = await self.bus.read(self.reply_stream, last, POLL_MS)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis restarting or unreachable: keep trying.
                log.warning("reply stream read failed: %r", exc)
                await asyncio.sleep(0.5)
                continue
            for entry_id, payload in entries:
                last = entry_id
                try:
                    msg = gateway_input_decoder.decode(payload)
                except msgspec.DecodeError as exc:
                    log.warning("undecodable reply entry %s: %s", entry_id, exc)
                    continue
                try:
                    self.tracker.dispatch(msg)
                except Exception:  # one bad message must not stop every other request's replies
                    log.exception("could not route reply entry %s", entry_id)

    async def submit(self, req: GenerateRequest) -> RequestStream:
        """Register first, then send, so a fast reply can never arrive before its stream exists."""
        stream = self.tracker.register(req.request_id)
        try:
            await self.send_request(req)
        except APIError:
            self.tracker.unregister(req.request_id)
            raise
        return stream

    async def send_request(self, req: GenerateRequest) -> None:
        """Queue a registered request for the tokenizers."""
        assert self.bus is not None
        try:
            await self.bus.send(self.bus.streams.requests, req, maxlen=MAXLEN["requests"])
        except Exception as exc:
            log.warning("could not submit %s: %r", req.request_id, exc)
            raise APIError("The server could not queue the request; try again.", 503) from exc

    async def engine_ids(self) -> list[int]:
        assert self.bus is not None
        members = await self.bus.r.smembers(self.bus.streams.engines_key())
        ids = sorted({int(m) for m in members if m.isdigit()})
        return ids or [0]

    async def abort(self, request_ids: list[str], reason: str = "abort") -> None:
        """Stop routing these requests and tell every engine to drop them (idempotent there)."""
        for rid in request_ids:
            self.tracker.unregister(rid)
        if self.bus is None or not request_ids:
            return
        payload = encode(AbortRequest(request_ids=list(request_ids), reason=reason))
        engines = await self.engine_ids()
        pipe = self.bus.r.pipeline(transaction=False)
        for e in engines:
            pipe.xadd(self.bus.streams.engine_in(e), {FIELD: payload},
                      maxlen=MAXLEN["engine_in"], approximate=True)
        await pipe.execute()

    def abort_soon(self, request_ids: list[str]) -> None:
        """Abort from code that may itself be cancelled (disconnect paths): run it as its own task."""
        for rid in request_ids:
            self.tracker.unregister(rid)
        task = asyncio.get_running_loop().create_task(self._abort_logged(request_ids))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_logged(self, request_ids: list[str]) -> None:
        try:
            await self.abort(request_ids)
        except Exception as exc:
            log.warning("abort of %s failed: %r", request_ids, exc)


# ---------------------------------------------------------------------------------------------
# App factory and entry point


def create_app(redis_url: str, prefix: str, model_name: str, max_model_len: int) -> Starlette:
    gateway = Gateway(redis_url, prefix, model_name, max_model_len)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = Starlette(
        routes=[*openai_api.routes(), *websocket.routes()],
        lifespan=lifespan,
        exception_handlers={HTTPException: http_exception_handler, APIError: api_error_handler,
                            Exception: internal_error_handler},
    )
    app.state.gateway = gateway
    return app


def run(redis_url: str, prefix: str, model_name: str, max_model_len: int, host: str, port: int) -> None:
    import uvicorn

    from rill.shared.logs import setup_logging

    setup_logging("gateway")
    app = create_app(redis_url, prefix, model_name, max_model_len)
    # log_config=None keeps Rill's log format; uvicorn's own loggers stay at WARNING. The graceful
    # shutdown timeout stops a stream whose engine died from holding the process open.
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, log_config=None,
                timeout_graceful_shutdown=5)
