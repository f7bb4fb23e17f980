"""OpenAI-compatible HTTP endpoints.

Bodies are decoded and checked by requests.py (the request schema, shared with the WebSocket
protocol) into a GenerateRequest, or refused with an APIError (400 naming the `param`). Length
checks against the context window need tokens, so the tokenizer service does them and answers
with an ErrorReply that becomes the same kind of error here.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from rill.services.gateway import requests
from rill.services.gateway.bodies import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    GenerateBody,
    TokenizeBody,
)
from rill.services.gateway.chat_tools import tool_definitions
from rill.services.gateway.engine_stats import read_engine_stats
from rill.services.gateway.errors import APIError, json_response
from rill.services.gateway.responses import (
    GENERATION_FAILED,
    ChunkFormatter,
    Event,
    Output,
    error_from_reply,
    full_response,
)
from rill.services.gateway.tool_calls import tool_mode
from rill.shared.kinds import RequestKind
from rill.shared.schema import ErrorReply, GenerateRequest, TokenizeRequest

if TYPE_CHECKING:
    from rill.services.gateway.gateway import Gateway
    from rill.services.gateway.request_tracker import RequestStream

T = TypeVar("T")
# Which data-parallel engine served a generate request (the last one, if it was sent again), as
# llm-d's gateway names its endpoint: to see routing at work. Absent before the tokenizer routed it.
ENGINE_HEADER = "x-rill-engine"


def _engine_header(stream: RequestStream) -> dict[str, str]:
    return {} if stream.engine is None else {ENGINE_HEADER: str(stream.engine)}


def new_request_id(kind: RequestKind) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------------------------
# Client-disconnect handling


class _Disconnected:
    pass


DISCONNECTED = _Disconnected()


async def wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def or_disconnect(receive: Receive, aw: Awaitable[T]) -> T | _Disconnected:
    """Run `aw` unless the client goes away first (then it is cancelled)."""
    work = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if work.done() and not work.cancelled():
        return work.result()
    return DISCONNECTED


# ---------------------------------------------------------------------------------------------
# Server-sent events

class SSEResponse:
    """Streams a request's events; a client disconnect before the finish aborts the request.

    A hand-written ASGI response rather than StreamingResponse: it races the writer against
    `http.disconnect` itself (uvicorn's h11 server drops writes to a closed socket silently),
    and sends one body chunk per wake-up without thread hops.
    """

    def __init__(self, gateway: Gateway, stream: RequestStream, events: AsyncIterator[list[Event]],
                 first: list[Event], fmt: ChunkFormatter) -> None:
        self.gateway = gateway
        self.stream = stream
        self.events = events
        self.first = first
        self.fmt = fmt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        extra = [(k.encode(), v.encode()) for k, v in _engine_header(self.stream).items()]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"), *extra]})
        try:
            await or_disconnect(receive, self._write(send))
        finally:
            if not self.stream.terminal:
                self.gateway.abort_soon([self.stream.request_id])

    async def _write(self, send: Send) -> None:
        await send({"type": "http.response.body", "body": self.fmt.start() + self.fmt.render(self.first),
                    "more_body": True})
        if not self.fmt.failed:
            async for batch in self.events:
                body = self.fmt.render(batch)
                if body:  # a batch of empty-text deltas (bytes of a split character) renders to nothing
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                if self.fmt.failed:
                    break  # one failed sample fails the request; the others are aborted on return
        await send({"type": "http.response.body", "body": self.fmt.end(), "more_body": False})


# ---------------------------------------------------------------------------------------------
# Endpoints


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


async def _echo_text(gw: Gateway, req: GenerateRequest) -> str:
    """The prompt as text, for echo: as given, or decoded by a tokenizer replica from its ids."""
    if isinstance(req.prompt, str):
        return req.prompt
    return (await gw.detokenize(list(req.prompt or []))).text


async def _generate(request: Request, cls: type[GenerateBody]) -> Response | SSEResponse:
    gw = _gateway(request)
    body = requests.parse(await request.body(), cls, gw.admission)
    kind = requests.kind_of(body)
    request_id = new_request_id(kind)
    req = requests.generate_request(body, request_id, gw.reply_stream)
    stream = bool(body.stream)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    as_ids = bool(body.return_tokens_as_token_ids)
    echo = isinstance(body, CompletionRequest) and bool(body.echo)
    echo_text = await _echo_text(gw, req) if echo else ""
    rs = await gw.submit(req, buffered=not stream)
    events = aiter(rs)
    handed_off = False  # once SSEResponse owns the stream, it aborts on disconnect itself
    logprobs = req.params.logprobs is not None
    tools = tool_mode(body, gw.tool_call_parser)
    try:
        if stream:
            first = await or_disconnect(request.receive, anext(events))
            if isinstance(first, _Disconnected):
                return Response(status_code=499)
            head = first[0]
            if isinstance(head, ErrorReply):
                return error_from_reply(head).response()
            if head.finish_reason == "error" and not head.text:
                return APIError(GENERATION_FAILED, 500).response()
            handed_off = True
            return SSEResponse(gw, rs, events, first,
                               ChunkFormatter(kind, request_id, gw.model_name, include_usage, req.params.n,
                                              rs.index, logprobs, echo_text, as_ids, tools))
        out = await or_disconnect(request.receive, _collect(rs, events, as_ids))
        if isinstance(out, _Disconnected):
            return Response(status_code=499)
        resp = json_response(full_response(kind, request_id, gw.model_name, out, logprobs, echo_text, tools))
        resp.headers.update(_engine_header(rs))
        return resp
    finally:
        # Disconnects, errors and cancellation all end here: free the engine's blocks.
        if not handed_off and not rs.terminal:
            gw.abort_soon([request_id])


async def _collect(rs: RequestStream, events: AsyncIterator[list[Event]], tokens_as_ids: bool) -> Output:
    out = Output(rs.n, tokens_as_ids)
    async for batch in events:
        for ev in batch:
            if isinstance(ev, ErrorReply):
                raise error_from_reply(ev)
            out.add(ev, rs.index(ev))
            if ev.finish_reason == "error":
                raise APIError(GENERATION_FAILED, 500)
    return out


async def completions(request: Request) -> Response | SSEResponse:
    return await _generate(request, CompletionRequest)


async def chat_completions(request: Request) -> Response | SSEResponse:
    return await _generate(request, ChatCompletionRequest)


async def tokenize(request: Request) -> Response:
    """vLLM's /tokenize: the ids a prompt (or chat messages, templated) turns into."""
    gw = _gateway(request)
    body = requests.parse(await request.body(), TokenizeBody, gw.admission)
    if body.messages is not None:
        msg = TokenizeRequest(request_id="", reply_to=gw.reply_stream,
                              messages=requests.chat_messages(body.messages),
                              add_generation_prompt=body.add_generation_prompt is not False,
                              tools=tool_definitions(body.tools), chat_template_kwargs=body.chat_template_kwargs or {})
    else:
        msg = TokenizeRequest(request_id="", reply_to=gw.reply_stream, prompt=body.prompt,
                              add_special_tokens=body.add_special_tokens is not False)
    reply = await gw.call(msg)
    return json_response({"count": len(reply.token_ids), "max_model_len": reply.max_model_len,
                          "tokens": reply.token_ids})


async def detokenize(request: Request) -> Response:
    """vLLM's /detokenize: token ids back to text."""
    gw = _gateway(request)
    body = requests.parse(await request.body(), DetokenizeBody, gw.admission)
    reply = await gw.detokenize(body.tokens)
    return json_response({"prompt": reply.text})


def _model_card(gw: Gateway) -> dict[str, Any]:
    return {"id": gw.model_name, "object": "model", "created": gw.created, "owned_by": "rill",
            "root": gw.model_name, "parent": None, "max_model_len": gw.max_model_len}


async def models(request: Request) -> Response:
    return json_response({"object": "list", "data": [_model_card(_gateway(request))]})


async def model(request: Request) -> Response:
    """One model's card (the openai client's models.retrieve); a name may hold slashes."""
    gw = _gateway(request)
    requests.check_model(request.path_params["model"], gw.model_name)
    return json_response(_model_card(gw))


async def health(request: Request) -> Response:
    """200 while the broker answers and (for a deployed gateway) an engine and at least one tokenizer
    and one detokenizer replica heartbeat; else 503 with the reason."""
    gw = _gateway(request)
    try:
        assert gw.bus is not None
        await asyncio.wait_for(gw.bus.r.ping(), 2.0)
    except Exception:
        return json_response({"status": "unavailable", "reason": "the message broker is unreachable"}, 503)
    if gw.watch_engine and not gw.engine_live:
        return json_response({"status": "unavailable", "reason": "no engine is live (no scheduler and worker "
                                                                 "heartbeat)"}, 503)
    missing = gw.missing_roles
    if missing:
        return json_response({"status": "unavailable",
                              "reason": f"no live {' or '.join(missing)} replica (requests wait until one starts)"},
                             503)
    return json_response({"status": "ok"})


async def stats(request: Request) -> Response:
    """Every engine's latest EngineStats, as written by its scheduler after each step."""
    try:
        engines = await read_engine_stats(_gateway(request).bus)
    except Exception as exc:
        raise APIError("Redis is unavailable.", 503) from exc
    return json_response({"engines": [msgspec.to_builtins(st) for st in engines]})


def routes() -> list[Route]:
    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/tokenize", tokenize, methods=["POST"]),
        Route("/v1/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
    ]
