"""Tool calling on the way out: the model's text as OpenAI `tool_calls`.

- `tool_choice` "required" or a named function is forced through the grammar engine (as vLLM
  does): a named choice generates that function's arguments as JSON; "required" generates a
  JSON array of {"name", "parameters"} objects, one of the offered functions each (one call
  when parallel_tool_calls is false). Even a small model so emits calls that parse.
- "auto" (the default with tools) lets the model answer in its own format, parsed afterwards
  by the parser the chat template implies or `--tool-call-parser` names: "hermes"
  (`<tool_call>{"name": .., "arguments": ..}</tool_call>`, Qwen 2.5/3, Hermes, SmolLM3) or
  "llama3_json" (`{"name": .., "parameters": ..}` objects separated by ";", optionally after
  `<|python_tag|>`). Text that does not parse stays content. A chat template that renders no
  tools gets them as hermes text (services/tokenizer/tool_prompt.py), so hermes is parsed.
- "none" leaves the output as text.

Streaming: content streams as it comes until a call may be starting (the parser's marker, or
any text at all for forced calls); from there the text is held and, at the finish, sent as
complete tool-call deltas (id, name and arguments in one chunk per call, as clients accumulate).

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

PARSERS = ("auto", "hermes", "llama3_json")


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


Parser = Hermes | Llama3Json


def pick_parser(name: str, templates: list[str]) -> Parser:
    """`--tool-call-parser`; "auto" reads the chat template's own tool-call format."""
    if name == "hermes":
        return Hermes()
    if name == "llama3_json":
        return Llama3Json()
    source = "\n".join(templates)
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
    one = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
            "properties": {"name": {"const": t.function.name}, "parameters": params(t)}} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


_CUT_ITEM = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*(.*)', re.S)


def _cut_calls(text: str) -> list[dict[str, Any]]:
    """The calls of a "required" array cut short: its whole items, then the last item's name
    with its arguments so far (the grammar writes "name" before "parameters")."""
    body = text.lstrip()
    if not body.startswith("["):
        return []
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    pos = 1
    while True:
        while pos < len(body) and body[pos] in ", \t\r\n":
            pos += 1
        try:
            item, pos = decoder.raw_decode(body, pos)
        except ValueError:
            break
        calls.append(_call(item["name"], item["parameters"]))
    cut = _CUT_ITEM.match(body, pos)
    if cut:
        calls.append(_call(json.loads(cut.group(1)), cut.group(2)))
    return calls


# ---------------------------------------------------------------------------------------------
# One request's mode, and one choice's stream


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's output becomes tool calls: `choice` is "auto", "required" or the
    name of the forced function."""

    choice: str
    parser: Parser
    parallel: bool = True  # parallel_tool_calls; false keeps the first call the model made

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a finished output."""
        if self.choice == "auto":
            content, calls = self.parser.parse(text)
            return content, calls if self.parallel else calls[:1]
        if self.choice == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return None, _cut_calls(text)  # cut short (max_tokens)
            return None, [_call(i["name"], i["parameters"]) for i in items]
        return None, [_call(self.choice, text)]

    def holds(self, text: str) -> int:
        """How much of `text` (everything streamed so far) may already be a tool call, counted
        from its end; that tail is held back while streaming."""
        if self.choice != "auto":
            return len(text)
        if isinstance(self.parser, Llama3Json):
            return len(text) if self.parser.starts(text) or not text.strip() else 0
        at = text.find(Hermes.marker)
        if at >= 0:
            return len(text) - at
        for k in range(min(len(Hermes.marker) - 1, len(text)), 0, -1):  # a marker that may be starting
            if Hermes.marker.startswith(text[-k:]):
                return k
        return 0


class ToolStream:
    """One choice's streamed text with the tool-call tail held back."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""
        self.sent = 0  # characters of `text` already streamed as content

    def feed(self, piece: str) -> str:
        """The content that may stream now, given the next piece of text."""
        self.text += piece
        free = len(self.text) - self.mode.holds(self.text)
        if free <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:free], free
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the finish: (content still to stream, tool calls)."""
        content, calls = self.mode.message(self.text)
        head = content or ""  # the whole text when no call parsed ("auto"); forced calls have none
        return head[self.sent:] if len(head) > self.sent else "", calls


def tool_mode(req: Any, parser: str) -> ToolMode | None:
    """The request's ToolMode, or None when its output is plain text (no tools, or "none")."""
    from rill.services.gateway.chat_tools import tool_choice_name

    tools = getattr(req, "tools", None)
    choice = tool_choice_name(getattr(req, "tool_choice", None), tools)
    if not tools or choice == "none":
        return None
    return ToolMode(choice, pick_parser(parser, []), req.parallel_tool_calls is not False)
