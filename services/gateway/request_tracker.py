"""The gateway's request registry: each request's event queue, fed in order and exactly once.

Detokenizer replicas may deliver a request's deltas out of order or twice (after a crash), so
each request keeps a DeltaSequencer that releases text exactly once, in offset order.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

from rill.services.gateway.metrics import GatewayMetrics, RequestMetrics
from rill.shared.request_params import sample_request_id
from rill.shared.schema import (
    ErrorReply,
    GatewayInput,
    GenerateRequest,
    ReplyBatch,
    Routed,
    TextDelta,
    TokenizeReply,
)

MAX_RENAMED = 4096

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

    A request with n > 1 samples receives the deltas of all of them (engine ids
    `sample_request_id(id, i, n)`), each sample sequenced on its own; `index(delta)` says which
    choice a delta belongs to, and the stream ends when every sample finished.
    Iterating yields lists (everything that arrived since the last wake-up), so a slow
    consumer sends one chunk per wake-up instead of falling behind one chunk per step.
    Iteration stops after the terminal event, or at once when the request was cancelled here.
    """

    def __init__(self, request_id: str, n: int = 1, metrics: RequestMetrics | None = None,
                 buffered: bool = False) -> None:
        self.request_id = request_id
        self.n = n
        # Handed out only at the end (a non-streaming reply): until then the client has seen
        # nothing, so the request may start over after its engine was lost (renew).
        self.buffered = buffered
        self.metrics = metrics  # timings and counts for /metrics; None when not measured
        self.engine_request_id = request_id  # the id the engines know it by (another once re-sent)
        self.sent: GenerateRequest | None = None  # what went to the tokenizers, for a re-send
        self.resent = 0  # times it was sent again after its engine was lost
        self.sequencers = [DeltaSequencer() for _ in range(n)]
        self._index = {sample_request_id(request_id, i, n): i for i in range(n)}  # sample id -> choice
        self._buf: list[Event] = []
        self._wake = asyncio.Event()
        self.terminal = False  # every sample finished, or an error was queued
        self.sample_failed = False  # one sample ended in error: the request fails, its others are aborted
        self.closed = False  # cancelled locally: stop without a terminal event
        self._done = False  # the terminal event was handed out
        self.started = False  # a token was released (no longer counts as waiting, admission.py)
        self.engine: int | None = None  # where the tokenizer sent it (Routed); None: not yet
        self.last_progress = time.monotonic()  # registration or the last released delta (deadline.py)

    @property
    def sample_ids(self) -> list[str]:
        return list(self._index)

    @property
    def engine_ids(self) -> list[str]:
        """Every id the engines may answer it under: the request's, and each sample's (n > 1)."""
        return [self.engine_request_id, *self._index] if self.n > 1 else list(self._index)

    def renew(self, engine_request_id: str) -> None:
        """Start over under a new engine id (its client saw nothing): what the old id still
        brings is no longer ours."""
        self.engine_request_id = engine_request_id
        self._index = {sample_request_id(engine_request_id, i, self.n): i for i in range(self.n)}
        self.sequencers = [DeltaSequencer() for _ in range(self.n)]
        self._buf.clear()  # empty unless buffered: held back, never handed out
        self.started = False
        if self.metrics is not None:
            self.metrics.restart()
        self.engine = None
        self.resent += 1
        self.last_progress = time.monotonic()

    def index(self, delta: TextDelta) -> int:
        """The choice index of a delta of this request (looked up: a sample id is never parsed)."""
        return self._index[delta.request_id]

    @property
    def _holding(self) -> bool:
        """A buffered stream hands nothing out before its end (or a sample's failure, which ends it)."""
        return self.buffered and not self.terminal and not self.sample_failed

    def _put(self, events: list[Event]) -> None:
        if events and not self.closed:
            self._buf.extend(events)
            if not self._holding:
                self._wake.set()

    def feed(self, delta: TextDelta) -> None:
        index = self.index(delta)
        out = self.sequencers[index].push(delta)
        if out:
            self.started = True
            self.last_progress = time.monotonic()  # only released text: a gap that never fills is no progress
        if out and self.metrics is not None:
            self.metrics.deltas(index, out)
        if out and out[-1].finish_reason is not None and all(s.finished for s in self.sequencers):
            self.terminal = True
            if self.metrics is not None:
                self.metrics.finish()
        elif out and out[-1].finish_reason == "error" and not self.sample_failed:
            # Not terminal: the handler still aborts the samples that run on.
            self.sample_failed = True
            if self.metrics is not None:
                self.metrics.finish()  # counted as an error now, not as the abort that follows
        self._put(out)

    def fail(self, err: ErrorReply) -> None:
        if not self.terminal:
            self.terminal = True
            if self.metrics is not None:
                self.metrics.fail(err)
            self._put([err])

    def close(self) -> None:
        if not self.terminal and not self.closed and self.metrics is not None:
            self.metrics.abort()  # cancelled or disconnected before its end
        self.closed = True
        self._buf.clear()
        self._wake.set()

    def __aiter__(self) -> AsyncIterator[list[Event]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[list[Event]]:
        while True:
            if not self._buf or self._holding:
                if self.closed or self._done:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch, self._buf = self._buf, []
            if self.terminal:  # the final events were queued with (or before) the flag
                self._done = True
            yield batch


class RequestTracker:
    """Registry of this gateway's in-flight requests; routes reply messages to their streams.

    A stream is reachable under the client's request id (this gateway's own failures, aborts)
    and under its engine ids (what the other services send: deltas, errors, routes). `resend`,
    when set, may take a failed stream its client saw nothing of and send it again under a new
    engine id (Gateway.resend) instead of failing it."""

    def __init__(self, metrics: GatewayMetrics | None = None) -> None:
        self.metrics = metrics
        self._streams: dict[str, RequestStream] = {}  # client request id -> stream
        self._routes: dict[str, RequestStream] = {}  # engine id of the request and every sample -> stream
        self.resend: Callable[[RequestStream, ErrorReply], bool] | None = None
        # Client id -> engine id of re-sent requests, kept past their end for late aborts (bounded).
        self._renamed: OrderedDict[str, str] = OrderedDict()
        self.waiting: set[str] = set()  # registered, no token yet: what the admission cap counts
        # One-shot calls to a tokenizer replica (/tokenize, /detokenize): id -> its answer.
        self.calls: dict[str, asyncio.Future[TokenizeReply | ErrorReply]] = {}

    def register(self, request_id: str, n: int = 1, buffered: bool = False) -> RequestStream:
        if request_id in self._streams:
            raise KeyError(f"request {request_id} is already in flight")
        stream = RequestStream(request_id, n, self.metrics.request(n) if self.metrics is not None else None,
                               buffered)
        self._streams[request_id] = stream
        self.waiting.add(request_id)
        for eid in stream.engine_ids:
            self._routes[eid] = stream
        return stream

    def _drop(self, stream: RequestStream) -> None:
        self._streams.pop(stream.request_id, None)
        self.waiting.discard(stream.request_id)
        for eid in stream.engine_ids:
            self._routes.pop(eid, None)

    def renew(self, stream: RequestStream, engine_request_id: str) -> None:
        """Route a registered stream under a new engine id; the old one's replies are dropped."""
        for eid in stream.engine_ids:
            self._routes.pop(eid, None)
        stream.renew(engine_request_id)
        self.waiting.add(stream.request_id)  # again, if it had started
        for eid in stream.engine_ids:
            self._routes[eid] = stream
        self._renamed[stream.request_id] = engine_request_id
        while len(self._renamed) > MAX_RENAMED:
            self._renamed.popitem(last=False)

    def engine_id(self, request_id: str) -> str:
        """The id the engines know a client request by now (for aborts)."""
        stream = self._streams.get(request_id)
        return stream.engine_request_id if stream is not None else self._renamed.get(request_id, request_id)

    def fail(self, request_id: str, err: ErrorReply) -> bool:
        """End a registered request with an error (or send it again, see `resend`); True if it
        ended."""
        stream = self._streams.get(request_id)
        return stream is not None and self._fail(stream, err)

    def _fail(self, stream: RequestStream, err: ErrorReply) -> bool:
        if (stream.buffered or not stream.started) and self.resend is not None and self.resend(stream, err):
            return False
        self._drop(stream)
        stream.fail(err)
        return True

    def unregister(self, request_id: str) -> bool:
        """Forget a request (cancelled, disconnected); its stream stops. True if it was in flight."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        self._drop(stream)
        stream.close()
        return True

    def dispatch(self, msg: GatewayInput) -> None:
        if isinstance(msg, ReplyBatch):
            for delta in msg.deltas:
                stream = self._routes.get(delta.request_id)
                if stream is None:
                    continue  # finished, cancelled, or another gateway generation's id
                stream.feed(delta)
                if stream.terminal:
                    self._drop(stream)
                elif stream.started:
                    self.waiting.discard(stream.request_id)
        elif isinstance(msg, ErrorReply):
            stream = self._routes.get(msg.request_id)
            if stream is not None:
                self._fail(stream, msg)
            else:
                self._answer(msg)
        elif isinstance(msg, TokenizeReply):
            self._answer(msg)
        elif isinstance(msg, Routed):
            stream = self._routes.get(msg.request_id)
            if stream is not None:
                stream.engine = msg.engine

    def _answer(self, msg: TokenizeReply | ErrorReply) -> None:
        fut = self.calls.pop(msg.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def get(self, request_id: str) -> RequestStream | None:
        return self._streams.get(request_id)

    def ids(self) -> list[str]:
        return list(self._streams)

    def streams(self) -> list[RequestStream]:
        return list(self._streams.values())

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)
