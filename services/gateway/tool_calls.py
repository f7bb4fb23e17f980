"""Tool calling on the way out: the model's text as OpenAI `tool_calls`.

- `tool_choice` "required" or a named function is forced through the grammar engine (as vLLM
  does): a named choice generates that function's arguments as JSON; "required" generates a
  JSON array of {"name", "parameters"} objects, one of the offered functions each (one call
  when parallel_tool_calls is false). Even a small model so emits calls that parse.
- "auto" (the default with tools) lets the model answer in its own format, read by the parser
  the chat template implies or `--tool-call-parser` names (tool_formats.py). Special tokens stay
  in the text of such a request (requests.py): some formats' markers are special tokens.
- "none" leaves the output as text.

Streaming: content streams as it comes until a call may be starting (the parser's marker);
from there the text is held back from content, and calls stream as they are generated, forced
or in the model's own format alike: a call's id and name once its name is complete, then its
arguments piece by piece, as OpenAI streams them. A call written with its arguments before its
name goes out whole once it is.

Cut short by max_tokens, calls keep what was generated (the last call's arguments end where the
output did, as OpenAI's do) and the finish reason stays "length", so that a client does not run
a tool on arguments the model never finished.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from rill.services.gateway.structured import json_objects
from rill.services.gateway.tool_formats import (
    Llama3Json,
    Parser,
    Qwen3Coder,
    Written,
    marker_tail,
    pick_parser,
    read_json,
    written_calls,
)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def calls_finish(reason: str | None, calls: list[dict[str, Any]]) -> str | None:
    """The finish reason of a choice whose text became calls: "tool_calls" when the model ended
    them whole; otherwise its own ("length", or "stop" at a stop string: arguments cut short)."""
    whole = all(_json_object(c["function"]["arguments"]) is not None for c in calls)
    return "tool_calls" if reason == "stop" and whole else reason


def _json_object(text: str) -> dict[str, Any] | None:
    text = text.strip()
    read = read_json(text, 0)
    return read[0] if read is not None and read[1] == len(text) and isinstance(read[0], dict) else None


# ---------------------------------------------------------------------------------------------
# Forced calls ("required", a named function)


def forced_schema(tools: list[Any], choice: str | None, parallel: bool) -> dict[str, Any] | None:
    """The JSON schema that forces the calls `choice` asks for ("required" or a function name),
    or None ("auto", "none"). `tools`: the request's FunctionTool Structs."""
    def params(t: Any) -> dict[str, Any]:
        return t.function.parameters if t.function.parameters is not None else {"type": "object"}

    if choice is None or choice in ("auto", "none"):
        return None
    if choice != "required":
        return params(next(t for t in tools if t.function.name == choice))
    # Each function's schema sits inside the array's: one with references ("#/$defs/..." point
    # into its own root) moves to the array's $defs under a name of its own, its pointers moved too.
    defs: dict[str, Any] = {}
    one = []
    for i, t in enumerate(tools):
        schema = params(t)
        if _local_refs(schema):
            defs[f"tool{i}"] = _rooted(schema, f"#/$defs/tool{i}")
            schema = {"$ref": f"#/$defs/tool{i}"}
        one.append({"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                    "properties": {"name": {"const": t.function.name}, "parameters": schema}})
    calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one}}
    if defs:
        calls["$defs"] = defs
    if not parallel:
        calls["maxItems"] = 1
    return calls


def _local_refs(schema: Any) -> list[dict[str, Any]]:
    """The objects of `schema` whose "$ref" points into its own document ("#...")."""
    return [n for n in json_objects(schema) if isinstance(n.get("$ref"), str) and n["$ref"].startswith("#")]


def _rooted(schema: dict[str, Any], base: str) -> dict[str, Any]:
    """A copy of `schema` whose local references resolve from `base` in the document it moves to."""
    copy = msgspec.json.decode(msgspec.json.encode(schema))  # C, as deep as the body it came in
    for node in _local_refs(copy):
        node["$ref"] = base + node["$ref"][1:]
    return copy


def required_calls(text: str) -> list[Written]:
    """(name, arguments as written) of each call of a "required" array so far (the grammar writes
    "name" before "parameters", so a call is known once its name is)."""
    body = text.lstrip()
    return written_calls(body, 1, ", \t\r\n") if body.startswith("[") else []


# ---------------------------------------------------------------------------------------------
# One request's mode, and one choice's stream


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's output becomes tool calls: `choice` is "auto", "required" or the
    name of the forced function."""

    choice: str
    parser: Parser
    parallel: bool = True  # parallel_tool_calls; false keeps the first call the model made

    def written(self, text: str) -> list[Written]:
        """(name, arguments as written) of the calls in `text` so far."""
        if self.choice == "auto":
            calls = self.parser.calls(text)
            return calls if self.parallel else calls[:1]
        return required_calls(text) if self.choice == "required" else [(self.choice, text)]

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a finished output: in the model's own format ("auto"), the
        text before the calls, or all of it as content where no call was written."""
        calls = [_call(name, arguments) for name, arguments in self.written(text)]
        if self.choice != "auto":
            return None, calls
        return (self.parser.content(text), calls) if calls else (text, [])

    def holds(self, text: str) -> int:
        """How much of `text` (everything streamed so far) may already be a tool call, counted
        from its end; that tail is held back while streaming."""
        if self.choice != "auto":
            return len(text)
        if isinstance(self.parser, Llama3Json):
            return len(text) if self.parser.starts(text) or not text.strip() else 0
        at = text.find(self.parser.marker)
        return len(text) - at if at >= 0 else marker_tail(text, self.parser.marker)


class ToolStream:
    """One choice's streamed text with the tool-call tail held back from content, and its calls
    streamed as they are written (OpenAI's deltas: the id and name first, then pieces of
    arguments)."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""
        self.sent = 0  # characters of `text` already streamed as content
        self.ids: list[str] = []  # calls announced so far
        self.args_sent: list[int] = []

    def feed(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        """The content that may stream now and the tool-call deltas, given the next piece of text."""
        self.text += piece
        free = len(self.text) - self.mode.holds(self.text)
        out = ""
        if free > self.sent:
            out, self.sent = self.text[self.sent:free], free
        return out, self._call_deltas() if free < len(self.text) else []

    def _call_deltas(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for k, (name, args) in enumerate(self.mode.written(self.text)):
            if k == len(self.ids):
                self.ids.append(call_id())
                self.args_sent.append(len(args))
                out.append({"index": k, "id": self.ids[k], "type": "function",
                            "function": {"name": name, "arguments": args}})
            elif len(args) > self.args_sent[k]:
                out.append({"index": k, "function": {"arguments": args[self.args_sent[k]:]}})
                self.args_sent[k] = len(args)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
        """At the finish: (content still to stream, tool-call deltas still to send, the calls)."""
        content, calls = self.mode.message(self.text)
        head = content or ""  # the whole text when no call was written ("auto"); forced calls have none
        tail = head[self.sent:] if len(head) > self.sent else ""
        deltas = self._call_deltas()
        return tail, deltas, [{**c, "id": self.ids[k]} for k, c in enumerate(calls)]


def tool_mode(req: Any, parser: str) -> ToolMode | None:
    """The request's ToolMode, or None when its output is plain text (no tools, or "none")."""
    from rill.services.gateway.chat_tools import tool_choice_name

    tools = getattr(req, "tools", None)
    choice = tool_choice_name(getattr(req, "tool_choice", None), tools)
    if not tools or choice == "none":
        return None
    reader = pick_parser(parser, [])
    if isinstance(reader, Qwen3Coder):  # its values are typed by the functions' schemas
        reader = Qwen3Coder({t.function.name: t.function.parameters for t in tools})
    return ToolMode(choice, reader, req.parallel_tool_calls is not False)
