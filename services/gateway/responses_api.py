"""POST /v1/responses: OpenAI's Responses API over the chat machinery.

A body becomes a chat completion request (instructions as the system turn, input items as
messages: function_call items as the assistant's tool calls, function_call_output items as tool
turns; `text.format` as response_format; flat function tools as chat tools), which is checked
and run as /v1/chat/completions runs it; its result becomes a Response object, or the typed
stream events (response_events.py).

A response is stored unless `store` is false (response_store.py): `previous_response_id`
continues its conversation, GET and DELETE /v1/responses/{id} read and remove it.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rill.services.gateway import requests
from rill.services.gateway.bodies import MAX_SALT_LEN, ChatCompletionRequest, ReasoningEffort
from rill.services.gateway.errors import APIError, json_response
from rill.services.gateway.fields import Body, NotYet
from rill.services.gateway.openai_api import SSEResponse, generate
from rill.services.gateway.requests import Admission
from rill.services.gateway.response_events import ResponseShape
from rill.services.gateway.response_store import ResponseStore
from rill.services.gateway.structured import JsonObjectFormat, TextFormat

# ---------------------------------------------------------------------------------------------
# The request


class InputText(Body, tag_field="type", tag="input_text"):
    text: str


class OutputText(Body, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class _Item(Body, kw_only=True):
    """An input item; `id` and `status` come back as a response gave them and are not read."""

    id: str | None = None
    status: str | None = None


class MessageItem(_Item, kw_only=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText | OutputText]
    type: Literal["message"] | None = None


class FunctionCallItem(_Item, kw_only=True):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item, kw_only=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningText(Body, tag_field="type", tag="reasoning_text"):
    text: str


class ReasoningItem(_Item, kw_only=True):
    """A thinking model's reasoning as a response gave it: the next assistant turn's reasoning_content."""

    type: Literal["reasoning"]
    summary: list[Any] | None = None
    content: list[ReasoningText] | None = None
    encrypted_content: Annotated[Any, NotYet("no encrypted reasoning")] = None


ITEMS: dict[str, type[Body]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


class FlatFunctionTool(Body, tag_field="type", tag="function"):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Body, tag_field="type", tag="function"):
    name: str


class FlatJsonSchemaFormat(Body, tag_field="type", tag="json_schema"):
    name: str
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


class TextConfig(Body):
    format: TextFormat | JsonObjectFormat | FlatJsonSchemaFormat | None = None
    verbosity: Annotated[Any, NotYet("no verbosity control", "medium")] = None


class ReasoningConfig(Body):
    effort: ReasoningEffort | None = None  # chat's reasoning_effort
    summary: Annotated[Any, NotYet("no reasoning summaries")] = None
    generate_summary: Annotated[Any, NotYet("no reasoning summaries")] = None


class ResponsesRequest(Body, kw_only=True):
    """POST /v1/responses."""

    input: Annotated[str, Meta(min_length=1)] | Annotated[list[dict[str, Any]], Meta(min_length=1)]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    tools: list[FlatFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_SALT_LEN)] | None = None  # as chat's
    store: bool | None = None  # absent: stored, as OpenAI's default
    previous_response_id: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    conversation: Annotated[Any, NotYet("no conversation objects; continue with previous_response_id")] = None
    include: Annotated[Any, NotYet("no extra output data", [])] = None
    reasoning: ReasoningConfig | None = None
    truncation: Annotated[Any, NotYet("no truncation", "disabled")] = None
    background: Annotated[Any, NotYet("no background responses", False)] = None
    service_tier: Annotated[Any, NotYet("one service tier", "auto", "default")] = None
    top_logprobs: Annotated[Any, NotYet("no logprobs on /v1/responses", 0)] = None
    max_tool_calls: Annotated[Any, NotYet("no built-in tools")] = None
    prompt: Annotated[Any, NotYet("no stored prompts")] = None
    stream_options: Annotated[Any, NotYet("no stream options on /v1/responses")] = None


def _renamed(err: APIError, old: str, new: str) -> APIError:
    """`err` with `old`, a part of the field it names, read as `new` (in its param and message)."""
    if not err.param or old not in err.param:
        return err
    return APIError(err.message.replace(old, new), err.status, err.type, err.param.replace(old, new, 1),
                    err.code, err.headers)


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of `body`; each carries `origin`, the field it came from (popped later)."""
    out: list[dict[str, Any]] = [
        {"role": "system", "content": body.instructions, "origin": "instructions"}] if body.instructions else []
    if isinstance(body.input, str):
        return [*out, {"role": "user", "content": body.input, "origin": "input"}]
    thought: str | None = None  # a reasoning item's, for the assistant turn that follows it
    for i, raw in enumerate(body.input):
        kind = raw.get("type", "message")
        if not isinstance(kind, str) or kind not in ITEMS:
            raise APIError(f"input[{i}].type: {kind!r} items are not supported (only {', '.join(ITEMS)}).",
                           400, param=f"input[{i}].type")
        try:
            item = msgspec.convert(raw, ITEMS[kind])
        except msgspec.ValidationError as exc:
            err = requests.validation_error(exc)
            raise _renamed(err, err.param or "", f"input[{i}].{err.param}") from None
        requests.refuse_not_yet(item, f"input[{i}]")
        if isinstance(item, ReasoningItem):
            thought = "".join(part.text for part in item.content or [])
            continue
        if isinstance(item, MessageItem):
            content = item.content if isinstance(item.content, str) else [
                {"type": "text", "text": part.text} for part in item.content]
            out.append({"role": item.role, "content": content, "origin": f"input[{i}]"})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant" and thought is None:  # the calls of one assistant turn
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call], "origin": f"input[{i}]"})
        else:
            assert isinstance(item, FunctionCallOutputItem)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output, "origin": f"input[{i}]"})
        if thought is not None and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"], thought = thought, None
    return out


def _untagged(obj: Body) -> dict[str, Any]:
    """A flat Responses object as the nested chat one: its fields without the `type` tag."""
    return {k: v for k, v in msgspec.to_builtins(obj).items() if k != "type"}


_FIELDS = {"model": "model", "max_output_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
           "parallel_tool_calls": "parallel_tool_calls", "metadata": "metadata", "user": "user",
           "safety_identifier": "safety_identifier", "prompt_cache_key": "prompt_cache_key",
           "cache_salt": "cache_salt"}
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
           "reasoning_effort": "reasoning.effort"}


def chat_request(body: ResponsesRequest, gate: Admission) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat completion request that runs `body`, checked as /v1/chat/completions checks one,
    and the Responses field each of its messages came from."""
    messages = _messages(body)
    origins = [m.pop("origin") for m in messages]
    chat: dict[str, Any] = {"messages": messages, "stream": bool(body.stream)}
    chat.update({dst: getattr(body, src) for src, dst in _FIELDS.items() if getattr(body, src) is not None})
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.tools is not None:
        chat["tools"] = [{"type": "function", "function": _untagged(t)} for t in body.tools]
    if isinstance(body.tool_choice, FunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    fmt = body.text.format if body.text else None
    if isinstance(fmt, JsonObjectFormat):
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, FlatJsonSchemaFormat):
        chat["response_format"] = {"type": "json_schema", "json_schema": _untagged(fmt)}
    try:
        return requests.parse(msgspec.json.encode(chat), ChatCompletionRequest, gate), origins
    except APIError as err:
        raise _responses_error(err, origins) from None


def _responses_error(err: APIError, origins: list[str]) -> APIError:
    """An error that names a field of the chat request, naming the Responses field instead
    (messages[j] as the input item or the instructions it came from)."""
    if err.param is None:
        return err
    at = re.match(r"messages\[(\d+)\]", err.param)
    head = err.param.split(".")[0].split("[")[0]
    if at and int(at[1]) < len(origins):
        old, new = at[0], origins[int(at[1])]
    elif head in _PARAMS:
        old, new = head, _PARAMS[head]
    else:
        old, new = ".function.", "."  # tools[i].function.x is tools[i].x
    return _renamed(err, old, new)


# ---------------------------------------------------------------------------------------------
# The endpoint


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The body's input as items (a string is one user message)."""
    return [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) \
        else list(body.input)


async def _continued(body: ResponsesRequest, store: ResponseStore) -> ResponsesRequest:
    """The body with the conversation its previous_response_id names before its own input
    (that response's instructions are not carried over, as OpenAI's are not)."""
    if body.previous_response_id is None:
        return body
    prev = await store.get(body.previous_response_id)
    if prev is None:
        why = "" if store.enabled else " (this server stores none: RILL_RESPONSES_TTL_S=0)"
        raise APIError(f"previous_response_id: no stored response has id {body.previous_response_id!r} (never "
                       f"stored, deleted, or past RILL_RESPONSES_TTL_S){why}.", 400,
                       param="previous_response_id", code="previous_response_not_found")
    return msgspec.structs.replace(body, input=[*prev.conversation(), *input_items(body)])


async def create_response(request: Request) -> Response | SSEResponse:
    gw = request.app.state.gateway
    body = requests.decode(await request.body(), ResponsesRequest, gw.admission.ignore_unknown_fields)
    requests.check(body, gw.admission)  # the model, and the fields Rill does not honour
    store = ResponseStore(gw.bus)
    if body.store and not store.enabled:
        raise APIError("This server stores no responses (RILL_RESPONSES_TTL_S=0); send store: false.", 400,
                       param="store")
    body = await _continued(body, store)
    chat, origins = chat_request(body, gw.admission)
    kept = store if body.store is not False and store.enabled else None
    try:  # run as a chat request: its errors until the first token
        return await generate(request, chat, ResponseShape(body, gw.model_name, kept, input_items(body)))
    except APIError as err:
        raise _responses_error(err, origins) from None


def _not_found(response_id: str) -> APIError:
    return APIError(f"Response with id '{response_id}' not found.", 404, param="response_id")


def _only_query(request: Request, allowed: tuple[str, ...] = ()) -> None:
    """A query parameter the route does not take is a 400 naming it."""
    for name in request.query_params:
        if name not in allowed:
            raise APIError(f"Query parameter {name!r} is not supported.", 400, param=name)


async def retrieve_response(request: Request) -> Response:
    _only_query(request)
    response_id = request.path_params["response_id"]
    stored = await ResponseStore(request.app.state.gateway.bus).get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return json_response(stored.response)


async def list_input_items(request: Request) -> Response:
    """The input items a stored response answered (its conversation before its output, earlier
    turns' included), OpenAI's list page: `order` desc (default) or asc, `limit` 1-100 (20),
    `after` an item id. `include` asks for data of images, files and encrypted reasoning, none of
    which Rill keeps: a 400."""
    _only_query(request, ("order", "limit", "after"))
    q = request.query_params
    order, limit = q.get("order", "desc"), q.get("limit", "20")
    if order not in ("asc", "desc"):
        raise APIError(f"order must be 'asc' or 'desc', got {order!r}.", 400, param="order")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise APIError(f"limit must be an integer from 1 to 100, got {limit!r}.", 400, param="limit")
    stored = await ResponseStore(request.app.state.gateway.bus).get(request.path_params["response_id"])
    if stored is None:
        raise _not_found(request.path_params["response_id"])
    items = stored.input if order == "asc" else stored.input[::-1]
    ids = [item.get("id") for item in items]
    if "after" in q and q["after"] not in ids:
        raise APIError(f"after: no input item of this response has id {q['after']!r}.", 400, param="after")
    start = ids.index(q["after"]) + 1 if "after" in q else 0
    page = items[start:start + int(limit)]
    return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                          "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < len(items)})


async def delete_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not await ResponseStore(request.app.state.gateway.bus).delete(response_id):
        raise _not_found(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


def routes() -> list[Route]:
    return [Route("/v1/responses", create_response, methods=["POST"]),
            Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
            Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
            Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"])]
