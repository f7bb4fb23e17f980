"""Tool calling on the way out: the model's text as OpenAI `tool_calls`.

- `tool_choice` "required" or a named function is forced through the grammar engine (as vLLM
  does): a named choice generates that function's arguments as JSON; "required" generates a
  JSON array of {"name", "parameters"} objects, one of the offered functions each (one call
  when parallel_tool_calls is false). Even a small model so emits calls that parse.
- "auto" (the default with tools) lets the model answer in its own format, parsed afterwards
  by the parser the chat template implies or `--tool-call-parser` names: "hermes"
  (`<tool_call>{"name": .., "arguments": ..}</tool_call>`, Qwen 2.5/3, Hermes, SmolLM3) or
  "llama3_json" (`{"name": .., "parameters": ..}` objects separated by ";", optionally after
  `<|python_tag|>`) or "granite" (`<|tool_call|>` then a JSON array of {"name", "arguments"},
  Granite 3.x). Text that does not parse stays content. A chat template that renders no
  tools gets them as hermes text (services/tokenizer/tool_prompt.py), so hermes is parsed.
- "none" leaves the output as text.

Streaming: content streams as it comes until a call may be starting (the parser's marker);
from there the text is held and, at the finish, sent as complete tool-call deltas (id, name and
arguments in one chunk per call, as clients accumulate). Forced calls, whose format the grammar
guarantees, stream as they are generated: a call's id and name once its name is complete, then
its arguments piece by piece, as OpenAI streams them.

Cut short by max_tokens, forced calls keep what was generated (the last call's arguments end
where the output did, as OpenAI's do) and the finish reason stays "length", so that a client
does not run a tool on arguments the model never finished.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from rill.services.gateway.structured import json_objects

PARSERS = ("auto", "hermes", "llama3_json", "granite")


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}


# ---------------------------------------------------------------------------------------------
# Parsers of the model's own format ("auto")


class Hermes:
    name = "hermes"
    marker = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        start = text.find(self.marker)
        if start < 0:
            return text, []
        calls = []
        for body in self._block.findall(text[start:]):
            obj = _json_object(body)
            if obj is None or not isinstance(obj.get("name"), str):
                return text, []  # not a well-formed call: the text stays content
            calls.append(_call(obj["name"], obj.get("arguments", {})))
        content = text[:start].strip()
        return content or None, calls


class Llama3Json:
    name = "llama3_json"
    marker = "{"  # a call is the whole message: JSON from its first character
    _tag = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        body = text.strip().removeprefix(self._tag).strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            calls.append(_call(obj["name"], obj.get("parameters", obj.get("arguments", {}))))
            pos = len(body) - len(body[pos:].lstrip().removeprefix(";").lstrip())
        return None, calls

    def starts(self, text: str) -> bool:
        head = text.lstrip()
        return head.startswith("{") or head.startswith(self._tag)


class GraniteJson:
    name = "granite"
    marker = "<|tool_call|>"

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        start = text.find(self.marker)
        if start < 0:
            return text, []
        try:
            items = json.loads(text[start + len(self.marker):])
        except ValueError:
            return text, []
        items = items if isinstance(items, list) else [items]
        if not items or not all(isinstance(it, dict) and isinstance(it.get("name"), str) for it in items):
            return text, []
        calls = [_call(it["name"], it.get("arguments", it.get("parameters", {}))) for it in items]
        return text[:start].strip() or None, calls


def marker_tail(text: str, marker: str) -> int:
    """How many characters at the end of `text` may be the start of `marker` (held back while
    streaming until the next piece tells)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def calls_finish(reason: str | None, calls: list[dict[str, Any]]) -> str | None:
    """The finish reason of a choice whose text became calls: "tool_calls" when the model ended
    them whole; otherwise its own ("length", or "stop" at a stop string: arguments cut short)."""
    whole = all(_json_object(c["function"]["arguments"]) is not None for c in calls)
    return "tool_calls" if reason == "stop" and whole else reason


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


Parser = Hermes | Llama3Json | GraniteJson


def pick_parser(name: str, templates: list[str]) -> Parser:
    """`--tool-call-parser`; "auto" reads the chat template's own tool-call format."""
    if name == "hermes":
        return Hermes()
    if name == "llama3_json":
        return Llama3Json()
    if name == "granite":
        return GraniteJson()
    source = "\n".join(templates)
    if GraniteJson.marker in source:
        return GraniteJson()
    if "<|python_tag|>" in source or ("ipython" in source and "<tool_call>" not in source):
        return Llama3Json()
    return Hermes()  # the commonest format, and what templates without tool support get


def template_sources(model_dir: str | Path, override: str | Path | None) -> list[str]:
    from rill.services.tokenizer.chat_template import load_templates

    try:
        return [t.source for t in load_templates(model_dir, override).templates.values()]
    except (OSError, ValueError):
        return []


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


_ITEM_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')
_ITEM_END = re.compile(r"\s*\}")


def required_calls(text: str) -> list[tuple[str, str]]:
    """(name, arguments as written) of each call of a "required" array so far: its whole items,
    then one cut short (max_tokens, or still streaming) with its arguments so far. The grammar
    writes "name" before "parameters", so a call is known once its name is."""
    body = text.lstrip()
    if not body.startswith("["):
        return []
    decoder = json.JSONDecoder()
    calls: list[tuple[str, str]] = []
    pos = 1
    while True:
        while pos < len(body) and body[pos] in ", \t\r\n":
            pos += 1
        head = _ITEM_HEAD.match(body, pos)
        if head is None:
            return calls
        try:
            _, end = decoder.raw_decode(body, head.end())
        except ValueError:
            return [*calls, (json.loads(head.group(1)), body[head.end():])]
        calls.append((json.loads(head.group(1)), body[head.end():end]))
        close = _ITEM_END.match(body, end)
        if close is None:
            return calls
        pos = close.end()


# ---------------------------------------------------------------------------------------------
# One request's mode, and one choice's stream


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's output becomes tool calls: `choice` is "auto", "required" or the
    name of the forced function."""

    choice: str
    parser: Parser
    parallel: bool = True  # parallel_tool_calls; false keeps the first call the model made

    def forced_calls(self, text: str) -> list[tuple[str, str]]:
        """(name, arguments as written) of a forced choice's calls so far."""
        return required_calls(text) if self.choice == "required" else [(self.choice, text)]

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a finished output."""
        if self.choice == "auto":
            content, calls = self.parser.parse(text)
            return content, calls if self.parallel else calls[:1]
        return None, [_call(name, args) for name, args in self.forced_calls(text)]

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
    """One choice's streamed text with the tool-call tail held back. Forced calls stream as
    they are generated (OpenAI's deltas: the id and name first, then pieces of arguments);
    calls parsed from the model's own format ("auto") go out whole at the finish."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""
        self.sent = 0  # characters of `text` already streamed as content
        self.ids: list[str] = []  # forced calls announced so far
        self.args_sent: list[int] = []

    def feed(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        """The content that may stream now and the tool-call deltas, given the next piece of text."""
        self.text += piece
        if self.mode.choice != "auto":
            return "", self._call_deltas()
        free = len(self.text) - self.mode.holds(self.text)
        if free <= self.sent:
            return "", []
        out, self.sent = self.text[self.sent:free], free
        return out, []

    def _call_deltas(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for k, (name, args) in enumerate(self.mode.forced_calls(self.text)):
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
        head = content or ""  # the whole text when no call parsed ("auto"); forced calls have none
        tail = head[self.sent:] if len(head) > self.sent else ""
        if self.mode.choice == "auto":
            return tail, [{"index": k, **c} for k, c in enumerate(calls)], calls
        deltas = self._call_deltas()
        return tail, deltas, [{**c, "id": self.ids[k]} for k, c in enumerate(calls)]


def tool_mode(req: Any, parser: str) -> ToolMode | None:
    """The request's ToolMode, or None when its output is plain text (no tools, or "none")."""
    from rill.services.gateway.chat_tools import tool_choice_name

    tools = getattr(req, "tools", None)
    choice = tool_choice_name(getattr(req, "tool_choice", None), tools)
    if not tools or choice == "none":
        return None
    return ToolMode(choice, pick_parser(parser, []), req.parallel_tool_calls is not False)
