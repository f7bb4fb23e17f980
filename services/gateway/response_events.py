"""The Responses API's output: a Response object (`ResponseShape.full`) or its typed stream events
(`EventFormatter`: response.created ... response.completed, or response.incomplete when
max_output_tokens cut it). Items come in output order: a thinking model's reasoning
(--reasoning-parser), the message, then each function call.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec

from rill.services.gateway.chat_output import ChatOutput, ChatStream
from rill.services.gateway.errors import APIError
from rill.services.gateway.responses import GENERATION_FAILED, OUTPUT_FAILED, Event, Output, error_from_reply
from rill.shared.schema import ErrorReply

if TYPE_CHECKING:
    from rill.services.gateway.response_store import ResponseStore
    from rill.services.gateway.responses_api import ResponsesRequest

log = logging.getLogger("rill.gateway.responses")


def _usage(out: Output) -> dict[str, Any]:
    u = out.usage()
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": u.get("completion_tokens_details", {}).get("reasoning_tokens", 0)},
            "total_tokens": u["total_tokens"]}


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _function_call(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def _new_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


class ResponseShape:
    """One /v1/responses request's Response object and stream (openai_api.Shape)."""

    def __init__(self, body: ResponsesRequest, model: str, store: ResponseStore | None = None,
                 items: list[dict[str, Any]] | None = None) -> None:
        """`store`: where the finished response is kept, with `items` (the conversation before it)."""
        self.body = body
        self.model = model
        self.request_id = _new_id("resp")
        self.created = int(time.time())
        self.seq = 0
        self.store = store
        self.items = items or []
        self.final: dict[str, Any] | None = None  # the finished response, until stored

    async def settle(self) -> None:
        """Store the finished response, once, before its last bytes go out: a client that
        continues it at once finds it. A broker that fails here fails the storing, not the response."""
        final, self.final = self.final, None
        if self.store is None or final is None:
            return
        try:
            await self.store.put(final, self.items)
        except Exception as exc:  # a redis error of any kind
            log.warning("response %s not stored: %s", final["id"], exc)

    def object(self, status: str, output: list[dict[str, Any]], out: Output | None) -> dict[str, Any]:
        b = self.body
        tool_choice = msgspec.to_builtins(b.tool_choice) if b.tool_choice is not None else "auto"
        fmt = msgspec.to_builtins(b.text.format) if b.text and b.text.format else {"type": "text"}
        return {"id": self.request_id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "model": self.model, "output": output, "usage": _usage(out) if out else None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "temperature": b.temperature, "top_p": b.top_p, "tool_choice": tool_choice,
                "tools": msgspec.to_builtins(b.tools or []), "parallel_tool_calls": b.parallel_tool_calls is not False,
                "text": {"format": fmt}, "metadata": b.metadata or {}, "user": b.user, "store": self.store is not None,
                "previous_response_id": b.previous_response_id, "reasoning": None, "truncation": "disabled"}

    def full(self, out: Output, chat: ChatOutput) -> dict[str, Any]:
        message, _ = chat.message(out.text, out.finish_reason)
        content, calls, thought = message["content"], message.get("tool_calls", []), message.get("reasoning_content")
        status = _status(out.finish_reason)
        output = [_reasoning(_new_id("rs"), thought, status)] if thought is not None else []
        output += [_message(_new_id("msg"), content or "", status)] if content or (content is not None and not calls) \
            else []
        output += [_function_call(_new_id("fc"), c, status) for c in calls]
        self.final = self.object(status, output, out)
        return self.final

    def formatter(self, chat: ChatOutput) -> EventFormatter:
        return EventFormatter(self, chat)

    def end(self) -> bytes:
        return b""  # the Responses stream ends with its last event; no [DONE]

    def event(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _json.encode(
            {"type": kind, "sequence_number": self.seq - 1, **fields}) + b"\n\n"


_json = msgspec.json.Encoder()


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class EventFormatter:
    """The typed events of one streamed response (openai_api.Formatter). Items are numbered as
    they open: the reasoning, the message, then each function call."""

    def __init__(self, shape: ResponseShape, chat: ChatOutput) -> None:
        self.shape = shape
        self.output = Output()
        self.output.reasoning = chat.reasoning
        self.chat = ChatStream(chat)
        self.items: list[dict[str, Any]] = []  # every item opened so far, in output order
        self.reasoning: dict[str, Any] | None = None  # the reasoning item, while it is open
        self.msg: dict[str, Any] | None = None  # the message item, once text started
        self.calls: list[dict[str, Any]] = []  # the function_call items
        self.failed = False

    def head(self, first: list[Event]) -> bytes:
        s = self.shape
        started = s.object("in_progress", [], None)
        return s.event("response.created", response=started) + s.event("response.in_progress", response=started) \
            + self.render(first)

    def _open(self, item: dict[str, Any]) -> bytes:
        self.items.append(item)
        shown = {**item, "content": []} if item["type"] in ("message", "reasoning") else item
        return self.shape.event("response.output_item.added", output_index=len(self.items) - 1, item=shown)

    def _at(self, item: dict[str, Any]) -> int:
        return next(k for k, it in enumerate(self.items) if it is item)

    def _reasoning_text(self, delta: str) -> bytes:
        s, out = self.shape, b""
        if self.reasoning is None:
            self.reasoning = _reasoning(_new_id("rs"), "", "in_progress")
            out += self._open(self.reasoning)
        self.reasoning["content"][0]["text"] += delta
        return out + s.event("response.reasoning_text.delta", item_id=self.reasoning["id"],
                             output_index=self._at(self.reasoning), content_index=0, delta=delta)

    def _close_reasoning(self, status: str) -> bytes:
        item, self.reasoning = self.reasoning, None
        if item is None:
            return b""
        s, at, text = self.shape, self._at(item), item["content"][0]["text"]
        item["status"] = status
        return s.event("response.reasoning_text.done", item_id=item["id"], output_index=at, content_index=0,
                       text=text) + s.event("response.output_item.done", output_index=at, item=item)

    def _text(self, delta: str) -> bytes:
        s, out = self.shape, b""
        if self.msg is None:
            out += self._close_reasoning("completed")
            self.msg = _message(_new_id("msg"), "", "in_progress")
            out += self._open(self.msg)
            out += s.event("response.content_part.added", item_id=self.msg["id"], output_index=self._at(self.msg),
                           content_index=0, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        self.msg["content"][0]["text"] += delta
        return out + s.event("response.output_text.delta", item_id=self.msg["id"], output_index=self._at(self.msg),
                             content_index=0, delta=delta, logprobs=[])

    def _call_events(self, deltas: list[dict[str, Any]]) -> bytes:
        """Function-call items from the chat stream's tool-call deltas: a new call, then its arguments."""
        s, out = self.shape, b""
        for d in deltas:
            if "id" in d:  # a new call
                out += self._close_reasoning("completed")
                fn = d["function"]
                item = _function_call(_new_id("fc"), {**d, "function": {**fn, "arguments": ""}}, "in_progress")
                self.calls.append(item)
                out += self._open(item)
            item = self.calls[d["index"]]
            if d["function"]["arguments"]:
                out += s.event("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=self._at(item), delta=d["function"]["arguments"])
        return out

    def _finish(self, finish_reason: str | None, deltas: list[dict[str, Any]], calls: list[dict[str, Any]]) -> bytes:
        """The last events: open items close in order, calls parsed at the finish open after the text."""
        s, status = self.shape, _status(finish_reason)
        out = self._close_reasoning(status)
        if self.msg is not None:
            at, text = self._at(self.msg), self.msg["content"][0]["text"]
            self.msg["status"] = status
            out += s.event("response.output_text.done", item_id=self.msg["id"], output_index=at, content_index=0,
                           text=text, logprobs=[])
            out += s.event("response.content_part.done", item_id=self.msg["id"], output_index=at, content_index=0,
                           part=self.msg["content"][0])
            out += s.event("response.output_item.done", output_index=at, item=self.msg)
        out += self._call_events(deltas)
        for item, call in zip(self.calls, calls, strict=True):
            item.update(_function_call(item["id"], call, status))
            at = self._at(item)
            out += s.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                           arguments=item["arguments"])
            out += s.event("response.output_item.done", output_index=at, item=item)
        s.final = s.object(status, self.items, self.output)
        return out + s.event(f"response.{status}", response=s.final)

    def _fail(self, err: APIError) -> bytes:
        self.failed = True
        failed = {**self.shape.object("failed", [], self.output),
                  "error": {"code": "server_error" if err.status >= 500 else "invalid_prompt", "message": err.message}}
        return self.shape.event("response.failed", response=failed)

    def render(self, batch: list[Event]) -> bytes:
        try:
            return self._render(batch)
        except Exception:  # a fault shaping one request's output ends that request, in the stream's own terms
            log.exception("response %s: its output could not be shaped", self.shape.request_id)
            return self._fail(APIError(OUTPUT_FAILED, 500, type="server_error"))

    def _render(self, batch: list[Event]) -> bytes:
        out = b""
        for ev in batch:
            if isinstance(ev, ErrorReply):
                return out + self._fail(error_from_reply(ev))
            ev = self.output.add(ev)
            if ev.finish_reason == "error":
                return out + self._fail(APIError(GENERATION_FAILED, 500))
            d = self.chat.feed(ev.text, ev.finish_reason is not None)
            out += self._reasoning_text(d.reasoning) if d.reasoning else b""
            out += self._text(d.content) if d.content else b""
            if ev.finish_reason is None:
                out += self._call_events(d.tool_calls)
            else:
                out += self._finish(ev.finish_reason, d.tool_calls, d.calls)
        return out


