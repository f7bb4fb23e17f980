"""OpenAI-compatible HTTP endpoints.

Bodies are decoded and checked by requests.py (the request schema, shared with the WebSocket protocol) into a
GenerateRequest, or refused with an APIError (400 naming the `param`). Length checks against the context window need
tokens, so the tokenizer service does them and answers with an ErrorReply that becomes the same kind of error here.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from rill.services.gateway import beam_search, requests
from rill.services.gateway.bodies import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateBody,
)
from rill.services.gateway.chat_output import PLAIN, ChatOutput, chat_output
from rill.services.gateway.errors import APIError, json_response
from rill.services.gateway.responses import (
    GENERATION_FAILED,
    ChunkFormatter,
    Event,
    Formatter,
    Output,
    Shape,
    batch_response,
    error_from_reply,
    full_response,
    stream_end,
)
from rill.shared.kinds import RequestKind
from rill.shared.schema import ErrorReply, GenerateRequest

if TYPE_CHECKING:
    from rill.services.gateway.gateway import Gateway
    from rill.services.gateway.request_tracker import RequestStream

T = TypeVar("T")
# Which data-parallel engine served a generate request (the last one, if it was sent again), as
# llm-d's gateway names its endpoint: to see routing at work. A batch of prompts lists each prompt's,
# in order. Absent before the tokenizer routed every one.
ENGINE_HEADER = "x-rill-engine"


def _engine_header(streams: list[RequestStream]) -> dict[str, str]:
    engines = [s.engine for s in streams]
    return {} if None in engines else {ENGINE_HEADER: ",".join(map(str, engines))}


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

@dataclass
class _Part:
    """One prompt's request of a streamed response (a batch has one per prompt)."""

    stream: RequestStream
    events: AsyncIterator[list[Event]]
    first: list[Event]
    fmt: Formatter


_First = tuple[AsyncIterator[list[Event]], list[Event]]  # a stream's events, and the batch taken first


async def _merged(parts: list[_Part]) -> AsyncIterator[tuple[_Part, list[Event]]]:
    """Every part's batches as they arrive (one part: straight from its stream, no task)."""
    if len(parts) == 1:
        async for batch in parts[0].events:
            yield parts[0], batch
        return
    queue: asyncio.Queue[tuple[_Part, list[Event]] | None] = asyncio.Queue()

    async def pump(part: _Part) -> None:
        try:
            async for batch in part.events:
                queue.put_nowait((part, batch))
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(p)) for p in parts]
    try:
        left = len(parts)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


class SSEResponse:
    """Streams a request's events; a client disconnect before the finish aborts the request.

    A hand-written ASGI response rather than StreamingResponse: it races the writer against
    `http.disconnect` itself (uvicorn's h11 server drops writes to a closed socket silently),
    and sends one body chunk per wake-up without thread hops.
    """

    def __init__(self, gateway: Gateway, parts: list[_Part], shape: Shape | None = None) -> None:
        self.gateway = gateway
        self.parts = parts
        self.shape = shape

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        extra = [(k.encode(), v.encode()) for k, v in _engine_header([p.stream for p in self.parts]).items()]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"), *extra]})
        try:
            await or_disconnect(receive, self._write(send))
        finally:
            _abort_unfinished(self.gateway, [p.stream for p in self.parts])

    async def _write(self, send: Send) -> None:
        head = b"".join(p.fmt.head(p.first) for p in self.parts)
        await send({"type": "http.response.body", "body": head, "more_body": True})
        if not any(p.fmt.failed for p in self.parts):
            async with contextlib.aclosing(_merged(self.parts)) as batches:
                async for part, batch in batches:
                    body = part.fmt.render(batch)
                    if self.shape is not None:
                        await self.shape.settle()
                    if body:  # a batch of empty-text deltas (bytes of a split character) renders to nothing
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                    if part.fmt.failed:
                        break  # one failed sample fails the request; the others are aborted on return
        end = self.shape.end() if self.shape else stream_end([p.fmt for p in self.parts])
        await send({"type": "http.response.body", "body": end, "more_body": False})


def _abort_unfinished(gw: Gateway, streams: list[RequestStream]) -> None:
    ids = [s.request_id for s in streams if not s.terminal]
    if ids:
        gw.abort_soon(ids)


# ---------------------------------------------------------------------------------------------
# Endpoints


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


async def echo_text(gw: Gateway, req: GenerateRequest) -> str:
    """The prompt as text, for echo: as given, or decoded by a tokenizer replica from its ids."""
    if isinstance(req.prompt, str):
        return req.prompt
    try:
        return (await gw.detokenize(list(req.prompt or []))).text
    except APIError as err:  # an id outside the vocabulary: the prompt's error, not /detokenize's field's
        if err.param != "tokens":
            raise
        raise APIError(err.message, err.status, param="prompt") from None


async def _generate(request: Request, cls: type[GenerateBody]) -> Response | SSEResponse:
    return await generate(request, requests.parse(await request.body(), cls, _gateway(request).admission))


async def generate(request: Request, body: GenerateBody, shape: Shape | None = None) -> Response | SSEResponse:
    """Run a checked body; its results in OpenAI's completions or chat objects, or `shape`'s."""
    gw = _gateway(request)
    beam_search.check(body, gw.admission.max_logprobs)
    request_id = shape.request_id if shape else new_request_id(requests.kind_of(body))
    reqs = requests.generate_requests(body, request_id, gw.reply_stream, gw.chat_parsers.reasoning)
    if body.use_beam_search:
        return await _beam_search(request, body, request_id, reqs[0])
    if isinstance(body, CompletionRequest) and body.echo:
        echoes = list(await asyncio.gather(*(echo_text(gw, req) for req in reqs)))
    else:
        echoes = [requests.echo_of(body) if isinstance(body, ChatCompletionRequest) else ""] * len(reqs)
    streams = await _submit(gw, reqs, buffered=not body.stream)
    handed_off = False  # once SSEResponse owns the streams, it aborts on disconnect itself
    try:
        if body.stream:
            resp = await _start_stream(request, body, request_id, reqs, streams, echoes, shape)
            handed_off = isinstance(resp, SSEResponse)
            return resp
        outs = await or_disconnect(request.receive, _collect_all(
            streams, bool(body.return_tokens_as_token_ids), requests.scores_only(body)))
        if isinstance(outs, _Disconnected):
            return Response(status_code=499)
        logprobs, chat = reqs[0].params.logprobs is not None, _chat_output(gw, body)
        for out in outs:
            out.reasoning = chat.reasoning
        if shape is not None:
            full = shape.full(outs[0], chat)
            await shape.settle()
            return json_response(full)
        resp = json_response(batch_response([
            full_response(requests.kind_of(body), request_id, gw.model_name, out, logprobs, echo_text, chat,
                          body.prompt_logprobs)
            for out, echo_text in zip(outs, echoes, strict=True)]))
        resp.headers.update(_engine_header(streams))
        return resp
    finally:
        # Disconnects, errors and cancellation all end here: free the engine's blocks.
        if not handed_off:
            _abort_unfinished(gw, streams)


async def _beam_search(request: Request, body: GenerateBody, request_id: str, first: GenerateRequest) -> Response:
    gw = _gateway(request)
    out = await or_disconnect(request.receive, beam_search.output(gw, body, first, lambda reqs: _run(gw, reqs)))
    if isinstance(out, _Disconnected):
        return Response(status_code=499)
    return json_response(full_response(requests.kind_of(body), request_id, gw.model_name, out, False, "",
                                       _chat_output(gw, body)))


async def _run(gw: Gateway, reqs: list[GenerateRequest]) -> list[Output]:
    """Requests run to their end (beam search's steps); what is left unfinished is aborted."""
    streams = await _submit(gw, reqs, buffered=True)
    try:
        return await _collect_all(streams, False, False)
    finally:
        _abort_unfinished(gw, streams)


async def _submit(gw: Gateway, reqs: list[GenerateRequest], buffered: bool) -> list[RequestStream]:
    """Send each prompt's request; one refused (429, 503) aborts those sent before it."""
    streams: list[RequestStream] = []
    try:
        for req in reqs:
            streams.append(await gw.submit(req, buffered=buffered))
    except BaseException:
        _abort_unfinished(gw, streams)
        raise
    return streams


async def _start_stream(request: Request, body: GenerateBody, request_id: str, reqs: list[GenerateRequest],
                        streams: list[RequestStream], echoes: list[str], shape: Shape | None) -> Response | SSEResponse:
    """Wait for each prompt's first event, so an error before any token is an HTTP error, not a 200."""
    gw, n = _gateway(request), reqs[0].params.n
    firsts = await or_disconnect(request.receive, _first_events(streams))
    if isinstance(firsts, _Disconnected):
        return Response(status_code=499)
    chat = _chat_output(gw, body)
    if shape is not None:
        (events, first), = firsts
        return SSEResponse(gw, [_Part(streams[0], events, first, shape.formatter(chat))], shape)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    logprobs = reqs[0].params.logprobs is not None
    as_ids, scores_only = bool(body.return_tokens_as_token_ids), requests.scores_only(body)
    return SSEResponse(gw, [
        _Part(rs, events, first, ChunkFormatter(
            requests.kind_of(body), request_id, gw.model_name, include_usage, n, rs.index, logprobs, echo_text,
            as_ids, chat, first_index=i * n, scores_only=scores_only, continuous_usage=continuous))
        for i, (rs, (events, first), echo_text) in enumerate(zip(streams, firsts, echoes, strict=True))])


def _chat_output(gw: Gateway, body: GenerateBody) -> ChatOutput:
    return chat_output(body, gw.chat_parsers) if isinstance(body, ChatCompletionRequest) else PLAIN


def _raise_early_error(head: Event) -> None:
    if isinstance(head, ErrorReply):
        raise error_from_reply(head)
    if head.finish_reason == "error" and not head.text:
        raise APIError(GENERATION_FAILED, 500)


async def _first_events(streams: list[RequestStream]) -> list[_First]:
    """Each stream's first batch, waited for together; an error in any one answers at once."""
    iters = [aiter(rs) for rs in streams]
    if len(iters) == 1:
        first = await anext(iters[0])
        _raise_early_error(first[0])
        return [(iters[0], first)]
    tasks = [asyncio.ensure_future(anext(it)) for it in iters]
    try:
        pending: set[asyncio.Future[list[Event]]] = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                _raise_early_error(task.result()[0])
        return [(it, task.result()) for it, task in zip(iters, tasks, strict=True)]
    finally:
        for task in tasks:
            task.cancel()


async def _collect(rs: RequestStream, events: AsyncIterator[list[Event]], tokens_as_ids: bool,
                   scores_only: bool) -> Output:
    out = Output(rs.n, tokens_as_ids, scores_only)
    async for batch in events:
        for ev in batch:
            if isinstance(ev, ErrorReply):
                raise error_from_reply(ev)
            out.add(ev, rs.index(ev))
            if ev.finish_reason == "error":
                raise APIError(GENERATION_FAILED, 500)
    return out


async def _collect_all(streams: list[RequestStream], tokens_as_ids: bool, scores_only: bool) -> list[Output]:
    """Every prompt's output; the first error fails the request at once."""
    if len(streams) == 1:
        return [await _collect(streams[0], aiter(streams[0]), tokens_as_ids, scores_only)]
    tasks = [asyncio.ensure_future(_collect(rs, aiter(rs), tokens_as_ids, scores_only)) for rs in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def completions(request: Request) -> Response | SSEResponse:
    return await _generate(request, CompletionRequest)


async def chat_completions(request: Request) -> Response | SSEResponse:
    return await _generate(request, ChatCompletionRequest)


def routes() -> list[Route]:
    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
