"""Tool calling on the way out: the model's text as OpenAI `tool_calls`.

- `tool_choice` "required" or a named function is forced through the grammar engine (as vLLM
  does): a named choice generates that function's arguments as JSON; "required" generates a
  JSON array of {"name", "parameters"} objects, one of the offered functions each (one call
  when parallel_tool_calls is false). Even a small model so emits calls that parse.
- "auto" (the default with tools) lets the model answer in its own format, parsed afterwards
  by the parser the chat template implies or `--tool-call-parser` names: "hermes"
  (`<tool_call>{"name": .., "arguments": ..}</tool_call>`, Qwen 2.5/3, Hermes, SmolLM3) or
  "llama3_json" (`{"name": .., "parameters": ..}` objects separated by ";", optionally after
  `<|python_tag|>`) or "granite" / "phi4_mini" (`<|tool_call|>` then a JSON array of
  {"name", "arguments"} or the objects bare, Granite 3.x and Phi-4-mini, whose template takes the
  tools in the system message: services/tokenizer/tool_prompt.py) or "mistral" (`[TOOL_CALLS]`
  then a JSON array, or `name[ARGS]{..}` per call in Mistral's newer tokenizers). Text that does
  not parse stays content. A chat template that renders no tools gets them as hermes text
  (tool_prompt.py), so hermes is parsed. Special tokens stay in the text of a request with tools
  ("auto"; requests.py): some formats' markers are special tokens.
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
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from rill.services.gateway.structured import json_objects
from rill.services.tokenizer.tool_prompt import SYSTEM_TOOLS

PARSERS = ("auto", "hermes", "llama3_json", "granite", "phi4_mini", "mistral")


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}


# ---------------------------------------------------------------------------------------------
# Parsers of the model's own format ("auto")

_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_CALL_END = re.compile(r"\s*\}")

Written = tuple[str, str]  # a call so far: (name, arguments as written)


def written_calls(body: str, pos: int = 0, between: str = " \t\r\n") -> list[Written]:
    """The calls written from `pos` of `body`: {"name": .., "arguments" (or "parameters"): ..}
    objects separated by characters of `between`. A call is known once its name is, and its
    arguments (an object) count as written so far, the last call's possibly cut short (being
    generated, or ended by max_tokens). An object in another key order, or whose arguments are
    a string, is read once whole. Reading stops at anything else. JSON nested too deep to read
    counts as cut short: the model's text, never an error."""
    calls: list[Written] = []
    while True:
        while pos < len(body) and body[pos] in between:
            pos += 1
        head = _CALL_HEAD.match(body, pos)
        name = _read_json(head.group(1), 0) if head is not None else None
        if head is not None and name is None:  # an escape JSON does not know: no call
            return calls
        value = head.end() if head is not None else pos
        if head is not None and (value == len(body) or body[value] == "{"):
            read = _read_json(body, value)
            if read is None:
                return [*calls, (name[0], body[value:])]
            calls.append((name[0], body[value:read[1]]))
            close = _CALL_END.match(body, read[1])
            if close is None:  # more keys after the arguments (Mistral writes an "id"): past the object
                whole = _read_json(body, pos)
                if whole is None:
                    return calls
                close_at = whole[1]
            else:
                close_at = close.end()
            pos = close_at
            continue
        read = _read_json(body, pos)
        if read is None:  # cut short: a call whose name was written is kept, its arguments not yet
            return [*calls, (name[0], "")] if name is not None else calls
        obj, pos = read
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return calls
        arguments = obj.get("arguments", obj.get("parameters", {}))
        calls.append((obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)))


_DECODER = json.JSONDecoder()


def _read_json(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value at `pos` of `text` and where it ends, or None: not (yet) JSON, or deeper
    than the decoder reads."""
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None


class Hermes:
    name = "hermes"
    marker = "<tool_call>"

    def calls(self, text: str) -> list[Written]:
        # Each call reads on past its block's end tag: arguments may hold that text in a string.
        return [c for m in re.finditer(re.escape(self.marker), text) for c in written_calls(text, m.end())[:1]]

    def content(self, text: str) -> str | None:
        return text[:text.find(self.marker)].strip() or None


class Llama3Json:
    name = "llama3_json"
    marker = "{"  # a call is the whole message: JSON from its first character
    _tag = "<|python_tag|>"

    def calls(self, text: str) -> list[Written]:
        body = text.strip().removeprefix(self._tag).strip()
        return written_calls(body, between="; \t\r\n") if body.startswith("{") else []

    def content(self, text: str) -> str | None:
        return None

    def starts(self, text: str) -> bool:
        head = text.lstrip()
        return head.startswith("{") or head.startswith(self._tag) or self._tag.startswith(head)


class GraniteJson:
    name = "granite"
    marker = "<|tool_call|>"

    def calls(self, text: str) -> list[Written]:
        start = text.find(self.marker)
        if start < 0:
            return []
        body = text[start + len(self.marker):].lstrip()
        # An array, or the objects bare (Phi-4-mini drops the brackets at times); reading stops
        # at the end tag where the model writes one (<|/tool_call|>).
        return written_calls(body, 1 if body.startswith("[") else 0, ", \t\r\n")

    def content(self, text: str) -> str | None:
        return text[:text.find(self.marker)].strip() or None


class Phi4Mini(GraniteJson):
    name = "phi4_mini"  # Granite's marker and items; its template takes the tools in the system message


class Mistral:
    """`[TOOL_CALLS]` then a JSON array of {"name", "arguments"} (Mistral 7B v0.3, Mixtral, Nemo),
    or, from tokenizer v11 on (Mistral Small 3.2, Devstral), `[TOOL_CALLS]name[ARGS]{...}` per call."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    _named = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")

    def calls(self, text: str) -> list[Written]:
        at = [m.end() for m in re.finditer(re.escape(self.marker), text)]
        if not at:
            return []
        named = self._named.match(text, at[0])
        if named is None:
            body = text[at[0]:].lstrip()
            return written_calls(body, 1 if body.startswith("[") else 0, ", \t\r\n")
        calls: list[Written] = []
        for start in at:
            named = self._named.match(text, start)
            if named is None:
                return calls
            read = _read_json(text, named.end())
            arguments = text[named.end():read[1]] if read is not None else text[named.end():]
            calls.append((named.group(1), arguments.split(self.marker)[0]))
        return calls

    def content(self, text: str) -> str | None:
        return text[:text.find(self.marker)].strip() or None


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
    text = text.strip()
    read = _read_json(text, 0)
    return read[0] if read is not None and read[1] == len(text) and isinstance(read[0], dict) else None


Parser = Hermes | Llama3Json | GraniteJson | Phi4Mini | Mistral


def pick_parser(name: str, templates: list[str]) -> Parser:
    """`--tool-call-parser`; "auto" reads the chat template's own tool-call format."""
    if name == "hermes":
        return Hermes()
    if name == "llama3_json":
        return Llama3Json()
    if name == "granite":
        return GraniteJson()
    if name == "phi4_mini":
        return Phi4Mini()
    if name == "mistral":
        return Mistral()
    source = "\n".join(templates)
    if Mistral.marker in source:
        return Mistral()
    if GraniteJson.marker in source:
        return GraniteJson()
    if "<|tool|>" in source and SYSTEM_TOOLS.search(source):
        return Phi4Mini()
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
    return ToolMode(choice, pick_parser(parser, []), req.parallel_tool_calls is not False)
