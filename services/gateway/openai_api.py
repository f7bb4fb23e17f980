"""OpenAI-compatible HTTP endpoints and the request validation shared with the WebSocket protocol.

Validation turns a JSON body into a GenerateRequest or raises APIError (400 with `param`);
length checks against the context window need tokens, so the tokenizer service does them and
answers with an ErrorReply that becomes the same kind of error here.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from rill.services.gateway.errors import APIError, json_response
from rill.services.gateway.responses import (
    GENERATION_FAILED,
    ChunkFormatter,
    Event,
    Output,
    error_from_reply,
    full_response,
)
from rill.shared.schema import (
    ChatMessage,
    ErrorReply,
    GenerateRequest,
    SamplingParams,
    TokenizeRequest,
)

if TYPE_CHECKING:
    from rill.services.gateway.app import Gateway, RequestStream

T = TypeVar("T")

MAX_STOP = 16
MAX_N = 128  # OpenAI's bound on parallel samples
MAX_LOGIT_BIAS = 1024
MAX_REPETITION_PENALTY = 100.0
DEFAULT_MAX_LOGPROBS = 20  # --max-logprobs, as in vLLM
ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})
_INT64 = 2**63
MAX_TOKEN_ID = 2**31 - 1


def _is_token_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_TOKEN_ID

# ---------------------------------------------------------------------------------------------
# Validation (shared with websocket.py)


def _bad(message: str, param: str | None) -> APIError:
    return APIError(message, 400, param=param)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt_int(body: dict[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise _bad(f"{name} must be an integer, got {v!r}.", name)
    if not -_INT64 <= v < _INT64:  # beyond int64 the message could not even be encoded
        raise _bad(f"{name} is out of range, got {v}.", name)
    return v


def _opt_num(body: dict[str, Any], name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_num(v):
        raise _bad(f"{name} must be a number, got {v!r}.", name)
    return float(v)


def _opt_bool(body: dict[str, Any], name: str) -> bool | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise _bad(f"{name} must be a boolean, got {v!r}.", name)
    return v


def _opt_num_in(body: dict[str, Any], name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    """An optional number in [lo, hi] ((lo, hi] with lo_open); the error names the range."""
    v = _opt_num(body, name)
    if v is None:
        return None
    above_lo = lo < v if lo_open else lo <= v
    if not (above_lo and v <= hi):
        raise _bad(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}.", name)
    return v


def check_model(body: dict[str, Any], model_name: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise _bad(f"model must be a string, got {model!r}.", "model")
    if model != model_name:
        raise APIError(f"The model `{model}` does not exist.", 404, type="NotFoundError",
                       param="model", code="model_not_found")


def parse_sampling(body: dict[str, Any], kind: str, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> SamplingParams:
    """Sampling fields as vLLM accepts them (top_k at top level, as `extra_body` sends it)."""
    kw: dict[str, Any] = {}

    max_tokens = _opt_int(body, "max_tokens")
    if kind == "chat":
        # The newer name wins when both are given, as in OpenAI's API.
        mct = _opt_int(body, "max_completion_tokens")
        name = "max_completion_tokens" if mct is not None else "max_tokens"
        max_tokens = mct if mct is not None else max_tokens
    else:
        name = "max_tokens"
    if max_tokens is not None:
        if max_tokens < 1:
            raise _bad(f"{name} must be at least 1, got {max_tokens}.", name)
        kw["max_tokens"] = max_tokens

    for name, lo, hi, lo_open in (("temperature", 0.0, 2.0, False), ("top_p", 0.0, 1.0, True),
                                  ("min_p", 0.0, 1.0, False), ("presence_penalty", -2.0, 2.0, False),
                                  ("frequency_penalty", -2.0, 2.0, False),
                                  ("repetition_penalty", 0.0, MAX_REPETITION_PENALTY, True)):
        v = _opt_num_in(body, name, lo, hi, lo_open)
        if v is not None:
            kw[name] = v

    top_k = _opt_int(body, "top_k")
    if top_k is not None:
        if top_k < -1:
            raise _bad(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {top_k}.", "top_k")
        kw["top_k"] = max(top_k, 0)

    seed = _opt_int(body, "seed")
    if seed is not None:
        kw["seed"] = seed

    min_tokens = _opt_int(body, "min_tokens")
    if min_tokens is not None:
        if min_tokens < 0:
            raise _bad(f"min_tokens must be greater than or equal to 0, got {min_tokens}.", "min_tokens")
        if "max_tokens" in kw and min_tokens > kw["max_tokens"]:
            raise _bad(f"min_tokens must be less than or equal to max_tokens={kw['max_tokens']}, "
                       f"got {min_tokens}.", "min_tokens")
        kw["min_tokens"] = min_tokens

    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad("stop must be a string or a list of strings.", "stop")
        if len(stop) > MAX_STOP:
            raise _bad(f"stop may hold at most {MAX_STOP} strings, got {len(stop)}.", "stop")
        stop = [s for s in stop if s]  # an empty stop string would end every request at once
        if stop:
            kw["stop"] = stop

    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(_is_token_id(t) for t in stop_ids):
            raise _bad("stop_token_ids must be a list of non-negative integers.", "stop_token_ids")
        if stop_ids:
            kw["stop_token_ids"] = stop_ids

    for flag in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
        v = _opt_bool(body, flag)
        if v is not None:
            kw[flag] = v

    n = _opt_int(body, "n")
    if n is not None:
        if not 1 <= n <= MAX_N:
            raise _bad(f"n must be in [1, {MAX_N}], got {n}.", "n")
        kw["n"] = n

    bias = _parse_logit_bias(body.get("logit_bias"))
    if bias:
        kw["logit_bias"] = bias

    logprobs = _parse_logprobs(body, kind, max_logprobs)
    if logprobs is not None:
        kw["logprobs"] = logprobs

    return SamplingParams(**kw)


def _parse_logit_bias(value: Any) -> dict[int, float] | None:
    """OpenAI's map of token id (a JSON object key, so a string) to a bias in [-100, 100]."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("logit_bias must be an object mapping token ids to numbers in [-100, 100].", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise _bad(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(value)}.", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise _bad(f"logit_bias keys must be token ids, got {key!r}.", "logit_bias") from None
        if not _is_token_id(token):
            raise _bad(f"logit_bias token id {key!r} is out of range.", "logit_bias")
        if not _is_num(bias) or not -100.0 <= bias <= 100.0:
            raise _bad(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {key}.",
                       "logit_bias")
        out[token] = float(bias)
    return out


def _parse_logprobs(body: dict[str, Any], kind: str, max_logprobs: int) -> int | None:
    """How many top logprobs per output token (0: only the sampled token's), None: no logprobs.

    Completions take `logprobs` as that number; chat takes `logprobs: true` and `top_logprobs`."""
    if kind == "chat":
        want = _opt_bool(body, "logprobs")
        top = _opt_int(body, "top_logprobs")
        if top is not None and not want:
            raise _bad("top_logprobs requires logprobs to be true.", "top_logprobs")
        if not want:
            return None
        name, n = "top_logprobs", top or 0
    else:
        name, n = "logprobs", _opt_int(body, "logprobs")
        if n is None:
            return None
    if n < 0:
        raise _bad(f"{name} must be non-negative, got {n}.", name)
    if n > max_logprobs:
        raise _bad(f"Requested sample logprobs of {n}, which is greater than max allowed: {max_logprobs}.", name)
    return n


def _content_text(content: Any, i: int) -> str:
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _bad("Only text content parts ({\"type\": \"text\", \"text\": ...}) are supported.",
                           param)
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad("A text content part needs a string `text`.", param)
            texts.append(text)
        return "\n".join(texts)  # vLLM joins text parts with newlines
    raise _bad("content must be a string or a list of text parts.", param)


def parse_messages(value: Any) -> list[ChatMessage]:
    if not isinstance(value, list) or not value:
        raise _bad("messages must be a non-empty list of {role, content} objects.", "messages")
    out: list[ChatMessage] = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object with role and content.", "messages")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise _bad(f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}.",
                       f"messages[{i}].role")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""  # assistant turns that only carried tool calls
        out.append(ChatMessage(role=role, content=_content_text(content, i)))
    return out


def parse_prompt(value: Any) -> str | list[int]:
    # Unwrap a batch of one: ["text"] or [[ids]]. Larger batches need n-way fan-out (not yet).
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        if len(value) > 1:
            raise _bad("Batched prompts are not supported yet; send one prompt per request.", "prompt")
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise _bad("prompt must not be empty.", "prompt")
        return value
    if isinstance(value, list):
        if not value:
            raise _bad("prompt must not be empty.", "prompt")
        if not all(_is_token_id(t) for t in value):
            raise _bad("prompt must be a string or a list of non-negative token ids.", "prompt")
        return value
    raise _bad("prompt must be a string or a list of token ids.", "prompt")


def new_request_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def parse_generate(body: Any, kind: str, model_name: str, request_id: str, reply_to: str,
                   max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> GenerateRequest:
    """Validate a chat / completion body into the message the tokenizer consumes."""
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.", None)
    check_model(body, model_name)
    if kind == "chat":
        if "messages" not in body:
            raise _bad("messages is required.", "messages")
        messages, prompt = parse_messages(body["messages"]), None
    else:
        if "prompt" not in body:
            raise _bad("prompt is required.", "prompt")
        messages, prompt = None, parse_prompt(body["prompt"])
    priority = _opt_int(body, "priority")  # vLLM's extension: lower runs first (--scheduling-policy priority)
    return GenerateRequest(request_id=request_id, reply_to=reply_to, kind=kind,
                           params=parse_sampling(body, kind, max_logprobs), arrival_time=time.time(),
                           messages=messages, prompt=prompt, priority=priority or 0)


def parse_stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage); stream_options without stream is an error, as in vLLM."""
    stream = bool(_opt_bool(body, "stream"))
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise _bad("stream_options must be an object.", "stream_options")
    if not stream:
        raise _bad("stream_options is only allowed when stream is true.", "stream_options")
    return stream, bool(_opt_bool(opts, "include_usage"))


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
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
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


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise _bad(f"Malformed JSON body: {exc}", None) from exc


def parse_echo(body: dict[str, Any], kind: str) -> bool:
    return bool(_opt_bool(body, "echo")) if kind == "completion" else False


async def _echo_text(gw: Gateway, req: GenerateRequest) -> str:
    """The prompt as text, for echo: as given, or decoded by a tokenizer replica from its ids."""
    if isinstance(req.prompt, str):
        return req.prompt
    return (await gw.detokenize(list(req.prompt or []))).text


async def _generate(request: Request, kind: str) -> Response | SSEResponse:
    gw = _gateway(request)
    body = await _json_body(request)
    request_id = new_request_id(kind)
    req = parse_generate(body, kind, gw.model_name, request_id, gw.reply_stream, gw.max_logprobs)
    stream, include_usage = parse_stream_options(body)
    as_ids = bool(_opt_bool(body, "return_tokens_as_token_ids"))
    echo = parse_echo(body, kind)
    if echo and req.params.logprobs is not None:  # the prompt's tokens get logprobs too
        req = msgspec.structs.replace(req, params=msgspec.structs.replace(
            req.params, prompt_logprobs=req.params.logprobs))
    echo_text = await _echo_text(gw, req) if echo else ""
    rs = await gw.submit(req)
    events = aiter(rs)
    handed_off = False  # once SSEResponse owns the stream, it aborts on disconnect itself
    logprobs = req.params.logprobs is not None
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
                                              rs.index, logprobs, echo_text, as_ids))
        out = await or_disconnect(request.receive, _collect(rs, events, as_ids))
        if isinstance(out, _Disconnected):
            return Response(status_code=499)
        return json_response(full_response(kind, request_id, gw.model_name, out, logprobs, echo_text))
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
    return await _generate(request, "completion")


async def chat_completions(request: Request) -> Response | SSEResponse:
    return await _generate(request, "chat")


async def _json_object(request: Request, gw: Gateway) -> dict[str, Any]:
    """A JSON object body naming this server's model (or none)."""
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.", None)
    check_model(body, gw.model_name)
    return body


async def tokenize(request: Request) -> Response:
    """vLLM's /tokenize: the ids a prompt (or chat messages, templated) turns into."""
    gw = _gateway(request)
    body = await _json_object(request, gw)
    add_special = _opt_bool(body, "add_special_tokens")
    add_generation_prompt = _opt_bool(body, "add_generation_prompt")
    if "messages" in body:
        msg = TokenizeRequest(request_id="", reply_to=gw.reply_stream, messages=parse_messages(body["messages"]),
                              add_generation_prompt=True if add_generation_prompt is None else add_generation_prompt)
    elif isinstance(body.get("prompt"), str):
        msg = TokenizeRequest(request_id="", reply_to=gw.reply_stream, prompt=body["prompt"],
                              add_special_tokens=True if add_special is None else add_special)
    else:
        raise _bad("prompt (a string) or messages is required.", "prompt")
    reply = await gw.call(msg)
    return json_response({"count": len(reply.token_ids), "max_model_len": reply.max_model_len,
                          "tokens": reply.token_ids})


async def detokenize(request: Request) -> Response:
    """vLLM's /detokenize: token ids back to text."""
    gw = _gateway(request)
    body = await _json_object(request, gw)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_token_id(t) for t in tokens):
        raise _bad("tokens must be a list of non-negative token ids.", "tokens")
    reply = await gw.detokenize(tokens)
    return json_response({"prompt": reply.text})


async def models(request: Request) -> Response:
    gw = _gateway(request)
    return json_response({"object": "list", "data": [
        {"id": gw.model_name, "object": "model", "created": gw.created, "owned_by": "rill",
         "root": gw.model_name, "parent": None, "max_model_len": gw.max_model_len}]})


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
        engines = await _gateway(request).engine_stats()
    except Exception as exc:
        raise APIError("Redis is unavailable.", 503) from exc
    return json_response({"engines": [msgspec.to_builtins(st) for st in engines]})


def routes() -> list[Route]:
    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
    ]
