"""The /v1/ws protocol: many concurrent requests per socket, each with a client-chosen id.

Client frames:  {"type": "chat", "id": .., "messages": [..], ...sampling}
                {"type": "completion", "id": .., "prompt": .., ...sampling}
                {"type": "cancel", "id": ..}
(chat and completion frames are the HTTP bodies plus `type` and `id`, checked by the same
schema, requests.py)
Server frames:  {"id": .., "type": "delta", "text": .., "index"?: .., "logprobs"?: [..], "tool_calls"?: [..],
                 "token_ids"?: [..]}
                {"id": .., "type": "done", "finish_reason": .., "finish_reasons"?: [..], "usage": {..},
                 "tool_calls"?: [..], "tool_calls_by_index"?: [[..], ..], "prompt_token_ids"?: [..],
                 "prompt_logprobs"?: [..]}

Sampling fields are the chat/completions ones; `logprobs` (true, with `top_logprobs`) adds the
chat-shaped logprobs of a delta's tokens; with `n` > 1 each delta names its sample's `index`
and the done frame, sent once every sample ended, lists each sample's finish reason. Tool calls
stream in delta frames as OpenAI's chunks carry them (a call's id and name, then pieces of its
arguments, by `index` of call); the done frame has them whole. `return_token_ids` adds each
delta's token ids and the prompt's in the done frame; `prompt_logprobs`, vLLM's in the done frame.
`echo` opens each sample's first delta with the prompt's text (chat: the continued message's), and
with a completion's `logprobs` puts the prompt's in the done frame as `prompt_logprobs`.
                {"id": .., "type": "error", "error": {"message": .., "type": .., "param": .., "code": ..}}

Every request ends with exactly one `done` or `error` frame. A bad frame only earns an error
frame: the socket and its other requests carry on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket

from rill.services.gateway import requests
from rill.services.gateway.bodies import MAX_WS_ID_LEN, ChatFrame, CompletionFrame, FrameHead
from rill.services.gateway.chat_output import ChatStream, chat_output
from rill.services.gateway.errors import APIError
from rill.services.gateway.openai_api import echo_text
from rill.services.gateway.responses import (
    GENERATION_FAILED,
    Output,
    chat_logprobs,
    error_from_reply,
    prompt_logprobs_of,
)
from rill.services.gateway.tool_calls import calls_finish
from rill.shared.schema import ErrorReply, TextLogprob

if TYPE_CHECKING:
    from rill.services.gateway.gateway import Gateway
    from rill.services.gateway.request_tracker import RequestStream

log = logging.getLogger("rill.gateway.ws")

FRAMES: dict[str, type[ChatFrame | CompletionFrame]] = {"chat": ChatFrame, "completion": CompletionFrame}
MAX_INFLIGHT = 1024  # per socket; one client should not be able to flood the engine unchecked
DEFAULT_WS_IDLE_TIMEOUT_S = 300.0  # a socket with no frame and no request in flight this long is closed
_json = msgspec.json.Encoder()


@dataclass(eq=False)
class _Entry:
    client_id: str | int
    request_id: str
    stream: RequestStream
    output: Output = field(default_factory=Output)
    task: asyncio.Task[None] | None = None
    # Chat with tools or reasoning: each choice's text passes through a ChatStream; the calls go
    # in the done frame, reasoning in delta frames of its own ("reasoning").
    chat: list[ChatStream] | None = None
    calls: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    prompt_logprobs: int | None = None  # asked for: in the done frame, vLLM's shape
    echo: str = ""  # what each sample's first delta opens with
    echoed: set[int] = field(default_factory=set)  # the samples that had it


@dataclass
class _Pending:
    """A sample's deltas that queued up since the last frame."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    logprobs: list[TextLogprob] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's tool-call deltas
    token_ids: list[int] = field(default_factory=list)  # return_token_ids


def _id_error() -> APIError:
    return APIError(f"Every frame needs an `id`: a string of 1 to {MAX_WS_ID_LEN} characters or an integer.",
                    param="id")


def _error_frame(client_id: Any, err: APIError) -> dict[str, Any]:
    body = err.body()["error"]
    if body["code"] is None:
        body["code"] = err.status
    return {"id": client_id, "type": "error", "error": body}


class Connection:
    """One socket: reads frames, runs one task per request, serialises sends."""

    def __init__(self, ws: WebSocket, gateway: Gateway) -> None:
        self.ws = ws
        self.gw = gateway
        self.conn_id = uuid.uuid4().hex
        self.started = 0  # requests started on this socket: keeps engine ids unique when a client id is reused
        self.inflight: dict[str | int, _Entry] = {}
        self.lock = asyncio.Lock()
        self.closed = False

    # -- sending ---------------------------------------------------------------------------

    async def _send(self, frame: dict[str, Any]) -> None:
        async with self.lock:
            await self._send_locked(frame)

    async def _send_locked(self, frame: dict[str, Any]) -> None:
        if self.closed:
            return
        try:
            await self.ws.send_text(_json.encode(frame).decode())
        except Exception:  # the peer went away; the read loop sees the disconnect and cleans up
            self.closed = True

    async def _send_owned(self, entry: _Entry, frame: dict[str, Any]) -> None:
        """Send only while the request is still this entry's (not cancelled, not finished)."""
        async with self.lock:
            if self.inflight.get(entry.client_id) is entry:
                await self._send_locked(frame)

    async def _finish(self, entry: _Entry, frame: dict[str, Any]) -> None:
        """Send the request's one terminal frame, unless a cancel already sent it."""
        async with self.lock:
            if self.inflight.get(entry.client_id) is entry:
                del self.inflight[entry.client_id]
                await self._send_locked(frame)

    def _done_frame(self, entry: _Entry, finish_reason: str | None = None) -> dict[str, Any]:
        choices = entry.output.choices
        reasons = [finish_reason or (calls_finish(c.finish_reason, entry.calls[i]) if i in entry.calls else c.finish_reason)
                   for i, c in enumerate(choices)]
        frame: dict[str, Any] = {"id": entry.client_id, "type": "done", "finish_reason": reasons[0],
                                 "usage": entry.output.usage()}
        if len(choices) > 1:
            frame["finish_reasons"] = reasons
        if entry.output.prompt_token_ids:
            frame["prompt_token_ids"] = entry.output.prompt_token_ids
        if entry.prompt_logprobs is not None:
            frame["prompt_logprobs"] = prompt_logprobs_of(entry.output.prompt_logprobs, entry.prompt_logprobs)
        if entry.calls and finish_reason is None:  # OpenAI's tool_calls, of choice 0 (all: by index)
            frame["tool_calls"] = entry.calls.get(0, [])
            if len(choices) > 1:
                frame["tool_calls_by_index"] = [entry.calls.get(i, []) for i in range(len(choices))]
        return frame

    # -- reading ---------------------------------------------------------------------------

    async def serve(self) -> None:
        while True:
            msg = await self._receive_or_idle()
            if msg is None:  # idle too long: an open socket costs a connection slot
                with contextlib.suppress(Exception):
                    await self.ws.close(1000, "idle timeout")
                return
            if msg["type"] == "websocket.disconnect":
                return
            data = msg.get("text")
            if data is None:
                data = msg.get("bytes") or b""
            await self.handle_frame(data)

    async def _receive_or_idle(self) -> dict[str, Any] | None:
        """The next message; None once the socket was idle (no frame, nothing in flight) for
        the gateway's ws_idle_timeout_s. The receive is never cancelled, so no frame is lost."""
        idle_s = self.gw.ws_idle_timeout_s
        receive = asyncio.ensure_future(self.ws.receive())
        busy = False  # a request was in flight at the last look: give the socket a full period more
        while True:
            done, _ = await asyncio.wait({receive}, timeout=idle_s if idle_s > 0 else None)
            if done:
                return receive.result()
            if not self.inflight and not busy:
                receive.cancel()
                return None
            busy = bool(self.inflight)

    async def handle_frame(self, data: str | bytes) -> None:
        try:  # the id first, so that every later error frame names the request
            head = requests.decode(data, FrameHead)
        except APIError as err:
            await self._send(_error_frame(None, _id_error() if err.param == "id" else err))
            return
        if head.id is None:
            await self._send(_error_frame(None, _id_error()))
            return
        if head.type == "cancel":
            await self.cancel(head.id)
        elif head.type in FRAMES:
            await self.start(head.id, FRAMES[head.type], data)
        else:
            await self._send(_error_frame(head.id, APIError(
                f"Unknown frame type {head.type!r}; expected 'chat', 'completion' or 'cancel'.", param="type")))

    # -- requests --------------------------------------------------------------------------

    async def start(self, cid: str | int, cls: type[ChatFrame | CompletionFrame], data: str | bytes) -> None:
        if cid in self.inflight:
            await self._send(_error_frame(cid, APIError(f"Request id {cid!r} is already in flight.",
                                                        param="id")))
            return
        if len(self.inflight) >= MAX_INFLIGHT:
            await self._send(_error_frame(cid, APIError(
                f"Too many requests in flight on this socket (max {MAX_INFLIGHT}).", 429)))
            return
        # A client may reuse an id once its request ended; late or redelivered deltas of the old
        # request must not reach the new one, so the engine-side id is unique per request.
        self.started += 1
        request_id = f"ws-{self.conn_id}-{self.started}-{cid}"
        try:
            body = requests.parse(data, cls, self.gw.admission)
            req = requests.generate_requests(body, request_id, self.gw.reply_stream,
                                             self.gw.chat_parsers.reasoning)[0]  # frames: one prompt
            # Reserve the id before the first await so a duplicate frame right behind it is refused.
            stream = self.gw.tracker.register(request_id, req.params.n)
            entry = _Entry(cid, request_id, stream, Output(stream.n, bool(body.return_tokens_as_token_ids)),
                           prompt_logprobs=req.params.prompt_logprobs)
            if isinstance(body, ChatFrame):
                mode = chat_output(body, self.gw.chat_parsers)
                entry.output.reasoning = mode.reasoning
                entry.chat = None if mode.plain else [ChatStream(mode) for _ in range(stream.n)]
                entry.echo = requests.echo_of(body)
        except APIError as err:
            await self._send(_error_frame(cid, err))
            return
        except KeyError:  # the same client id reused before the old request was forgotten
            await self._send(_error_frame(cid, APIError(f"Request id {cid!r} is already in flight.",
                                                        param="id")))
            return
        self.inflight[cid] = entry
        try:
            if isinstance(body, CompletionFrame) and body.echo:
                entry.echo = await echo_text(self.gw, req)
            await self.gw.send_request(req)
        except APIError as err:
            self.gw.tracker.unregister(request_id)
            await self._finish(entry, _error_frame(cid, err))
            return
        entry.task = asyncio.create_task(self._run(entry), name=f"ws-{request_id}")

    async def _run(self, entry: _Entry) -> None:
        out, stream = entry.output, entry.stream
        try:
            async for batch in stream:
                pending: dict[int, _Pending] = {}
                for ev in batch:
                    if isinstance(ev, ErrorReply):
                        await self._flush(entry, pending)
                        await self._finish(entry, _error_frame(entry.client_id, error_from_reply(ev)))
                        return
                    i = stream.index(ev)
                    ev = out.add(ev, i)  # as the response shows it (tokens as ids)
                    p = pending.setdefault(i, _Pending())
                    if entry.echo and i not in entry.echoed:
                        entry.echoed.add(i)
                        p.text.append(entry.echo)
                    text = ev.text
                    if entry.chat is not None:
                        d = entry.chat[i].feed(text, ev.finish_reason is not None)
                        text = d.content
                        p.reasoning.append(d.reasoning)
                        p.tool_calls.extend(d.tool_calls)
                        if d.calls:
                            entry.calls[i] = d.calls
                    p.text.append(text)
                    p.logprobs.extend(ev.logprobs)
                    p.token_ids.extend(ev.token_ids)
                    if ev.finish_reason == "error":
                        await self._flush(entry, pending)
                        await self._finish(entry, _error_frame(entry.client_id, APIError(GENERATION_FAILED, 500)))
                        return
                await self._flush(entry, pending)
            if all(c.finish_reason is not None for c in out.choices):  # else cancelled: cancel() answered
                await self._finish(entry, self._done_frame(entry))
        except Exception:
            log.exception("websocket request %s failed", entry.request_id)
            await self._finish(entry, _error_frame(entry.client_id, APIError("Internal server error", 500)))
        finally:
            if not stream.terminal and not stream.closed:  # one sample failed: stop the others
                self.gw.abort_soon([entry.request_id])

    async def _flush(self, entry: _Entry, pending: dict[int, _Pending]) -> None:
        # One frame per sample per wake-up: deltas that queued up meanwhile go out together.
        for i, p in sorted(pending.items()):
            text, reasoning = "".join(p.text), "".join(p.reasoning)
            if not text and not reasoning and not p.logprobs and not p.tool_calls and not p.token_ids:
                continue
            frame: dict[str, Any] = {"id": entry.client_id, "type": "delta", "text": text}
            if reasoning:
                frame["reasoning"] = reasoning
            if entry.stream.n > 1:
                frame["index"] = i
            if p.logprobs:
                frame["logprobs"] = chat_logprobs(p.logprobs)["content"]
            if p.tool_calls:
                frame["tool_calls"] = p.tool_calls
            if p.token_ids:
                frame["token_ids"] = p.token_ids
            await self._send_owned(entry, frame)
        pending.clear()

    async def cancel(self, cid: str | int) -> None:
        entry = self.inflight.pop(cid, None)
        if entry is None:
            return  # already finished (the done frame is on its way) or never existed: idempotent
        try:
            await self.gw.abort([entry.request_id])
        except Exception as exc:
            log.warning("abort of %s failed: %r", entry.request_id, exc)
        await self._send(self._done_frame(entry, "abort"))

    async def shutdown(self) -> None:
        """Socket gone: abort everything still running and let the request tasks end."""
        self.closed = True
        entries = list(self.inflight.values())
        self.inflight.clear()
        running = [e.request_id for e in entries if not e.stream.terminal]
        if running:
            self.gw.abort_soon(running)  # also closes their streams, which ends the tasks
        tasks = [e.task for e in entries if e.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=2.0)
            for t in pending:
                t.cancel()


async def ws_endpoint(websocket: WebSocket) -> None:
    gw: Gateway = websocket.app.state.gateway
    await websocket.accept()
    conn = Connection(websocket, gw)
    try:
        await conn.serve()
    finally:
        await conn.shutdown()
        with contextlib.suppress(Exception):
            await websocket.close()


def routes() -> list[WebSocketRoute]:
    return [WebSocketRoute("/v1/ws", ws_endpoint)]
