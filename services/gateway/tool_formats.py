"""The tool-call formats models write on their own (tool_choice "auto"), read as calls so far.

Each parser finds its format's calls in a choice's text as it grows: (name, arguments as
written), the last call possibly cut short, so the calls stream as they are written
(tool_calls.py). Formats, picked from the chat template or by `--tool-call-parser`:
- "hermes": `<tool_call>{"name": .., "arguments": ..}</tool_call>` (Qwen 2.5/3, Hermes, SmolLM3,
  and any template that renders no tools: services/tokenizer/tool_prompt.py writes them so);
- "llama3_json": `{"name": .., "parameters": ..}` objects separated by ";", optionally after
  `<|python_tag|>` (Llama 3.1-3.3);
- "granite" / "phi4_mini": `<|tool_call|>` then a JSON array of {"name", "arguments"}, or the
  objects bare (Granite 3.x; Phi-4-mini, whose template takes the tools in the system message);
- "mistral": `[TOOL_CALLS]` then a JSON array, or `name[ARGS]{..}` per call (newer tokenizers);
- "qwen3_coder": `<tool_call><function=name><parameter=key>value</parameter>...</function>`,
  each value typed by the function's JSON schema (Qwen3-Coder).
Text that holds no call stays content.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from rill.services.tokenizer.tool_prompt import SYSTEM_TOOLS

PARSERS = ("auto", "hermes", "llama3_json", "granite", "phi4_mini", "mistral", "qwen3_coder")



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
        name = read_json(head.group(1), 0) if head is not None else None
        if head is not None and name is None:  # an escape JSON does not know: no call
            return calls
        value = head.end() if head is not None else pos
        if head is not None and (value == len(body) or body[value] == "{"):
            read = read_json(body, value)
            if read is None:
                return [*calls, (name[0], body[value:])]
            calls.append((name[0], body[value:read[1]]))
            close = _CALL_END.match(body, read[1])
            if close is None:  # more keys after the arguments (Mistral writes an "id"): past the object
                whole = read_json(body, pos)
                if whole is None:
                    return calls
                close_at = whole[1]
            else:
                close_at = close.end()
            pos = close_at
            continue
        read = read_json(body, pos)
        if read is None:  # cut short: a call whose name was written is kept, its arguments not yet
            return [*calls, (name[0], "")] if name is not None else calls
        obj, pos = read
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return calls
        arguments = obj.get("arguments", obj.get("parameters", {}))
        calls.append((obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)))


_DECODER = json.JSONDecoder()


def read_json(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value at `pos` of `text` and where it ends, or None: not (yet) JSON, or deeper
    than the decoder reads."""
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None


class _Marked:
    """A format whose calls follow a marker: the text before it is the message's content."""

    marker: str

    def content(self, text: str) -> str | None:
        return text[:text.find(self.marker)].strip() or None


def _listed(body: str) -> list[Written]:
    """The calls of a JSON array, or of the same objects bare, at the start of `body`."""
    return written_calls(body, 1 if body.startswith("[") else 0, ", \t\r\n")


class Hermes(_Marked):
    name = "hermes"
    marker = "<tool_call>"

    def calls(self, text: str) -> list[Written]:
        # Each call reads on past its block's end tag: arguments may hold that text in a string.
        return [c for m in re.finditer(re.escape(self.marker), text) for c in written_calls(text, m.end())[:1]]


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


class GraniteJson(_Marked):
    name = "granite"
    marker = "<|tool_call|>"

    def calls(self, text: str) -> list[Written]:
        start = text.find(self.marker)
        if start < 0:
            return []
        body = text[start + len(self.marker):].lstrip()
        # Phi-4-mini drops the brackets at times; reading stops at its end tag (<|/tool_call|>).
        return _listed(body)


class Phi4Mini(GraniteJson):
    name = "phi4_mini"  # Granite's marker and items; its template takes the tools in the system message


class Mistral(_Marked):
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
            return _listed(text[at[0]:].lstrip())
        calls: list[Written] = []
        for start in at:
            named = self._named.match(text, start)
            if named is None:
                return calls
            read = read_json(text, named.end())
            arguments = text[named.end():read[1]] if read is not None else text[named.end():]
            calls.append((named.group(1), arguments.split(self.marker)[0]))
        return calls


class Qwen3Coder(_Marked):
    """`<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`, a
    value on lines of its own. The arguments are the JSON object of the parameters read so far
    (one streams once its closing tag is written), closed at </function>; each value becomes its
    schema's type (`schemas`: function name -> parameters schema), text where it is a string, has
    no type, or does not read as its type."""

    name = "qwen3_coder"
    marker = "<tool_call>"
    _function = re.compile(r"\s*<function=([^>\n]+)>")
    _parameter = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
    _end = re.compile(r"\s*</function>")

    def __init__(self, schemas: dict[str, Any] | None = None) -> None:
        self.schemas = schemas or {}

    def calls(self, text: str) -> list[Written]:
        calls: list[Written] = []
        for m in re.finditer(re.escape(self.marker), text):
            head = self._function.match(text, m.end())
            if head is None:
                continue
            name, pos, pairs = head.group(1).strip(), head.end(), []
            props = (self.schemas.get(name) or {}).get("properties") or {}
            while (param := self._parameter.match(text, pos)) is not None:
                key = param.group(1).strip()
                value = _typed(param.group(2), (props.get(key) or {}).get("type"))
                pairs.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
                pos = param.end()
            closed = self._end.match(text, pos) is not None
            calls.append((name, "{" + ", ".join(pairs) + ("}" if closed else "")))
        return calls


def _typed(value: str, kind: Any) -> Any:
    """A parameter's text as its schema `kind` ("string", "integer", "number", "boolean",
    "object", "array", a list of them, or None): the text itself where it reads as none."""
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds and len(kinds) == 1:
        return value
    stripped = value.strip()
    read = read_json(stripped, 0)
    if read is None or read[1] != len(stripped):
        return value
    want = {"integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list,
            "null": type(None)}
    ok = [want[k] for k in kinds if k in want]
    if kinds == [None] or any(isinstance(read[0], t) and not (t is int and isinstance(read[0], bool)) for t in ok):
        return read[0]
    return value


def marker_tail(text: str, marker: str) -> int:
    """How many characters at the end of `text` may be the start of `marker` (held back while
    streaming until the next piece tells)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


Parser = Hermes | Llama3Json | GraniteJson | Phi4Mini | Mistral | Qwen3Coder


def pick_parser(name: str, templates: list[str]) -> Parser:
    """`--tool-call-parser`; "auto" reads the chat template's own tool-call format."""
    named = {p.name: p for p in (Hermes, Llama3Json, GraniteJson, Phi4Mini, Mistral, Qwen3Coder)}
    if name in named:
        return named[name]()
    source = "\n".join(templates)
    if "<function=" in source and "<parameter=" in source:
        return Qwen3Coder()
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
