"""Structured outputs at admission: the request's constraint as one llguidance grammar, checked.

OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs` (json, regex,
choice, grammar as Lark or GBNF, json_object) and vLLM's older `guided_*` fields all become one
llguidance grammar string in SamplingParams.grammar, validated here so that a bad schema or
grammar is a 400 naming its field before anything runs (services/worker/structured.py applies it).
JSON is generated compact (no free whitespace between tokens): a small model at temperature 1
otherwise can fill max_tokens with blank lines inside an object. And an object that declares its
properties gets no others unless its schema says `additionalProperties` (`closed`), as xgrammar's
strict mode (vLLM's default backend) generates: a small model otherwise fills undeclared keys, a
tool's arguments with ones its function does not take, until max_tokens.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Annotated, Any, NamedTuple

from msgspec import Meta

from rill.services.gateway.errors import APIError
from rill.services.gateway.fields import Body, NotYet

MAX_GRAMMAR_BYTES = 64 * 1024  # a request's grammar crosses the broker once per sample (n)
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


class JsonSchemaFormat(Body):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern="^[A-Za-z0-9_-]+$")]
    schema: dict[str, Any] | None = None  # none: any JSON object
    description: str | None = None
    strict: bool | None = None  # the schema is always enforced


class TextFormat(Body, tag_field="type", tag="text"):
    pass


class JsonObjectFormat(Body, tag_field="type", tag="json_object"):
    pass


class JsonSchemaResponseFormat(Body, tag_field="type", tag="json_schema"):
    json_schema: JsonSchemaFormat


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaResponseFormat
Choices = Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1)]


class StructuredOutputs(Body):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: Choices | None = None
    grammar: Annotated[str, Meta(description="Lark, or GBNF (rules written with ::=).")] | None = None
    json_object: bool | None = None
    disable_fallback: bool | None = None  # one backend, no fallback either way
    disable_any_whitespace: Annotated[Any, NotYet("Rill's JSON is always compact", True)] = None
    disable_additional_properties: Annotated[Any, NotYet("undeclared properties are never generated (allow them "
                                                          "with additionalProperties in the schema)", True)] = None
    whitespace_pattern: Annotated[Any, NotYet("Rill's JSON is always compact")] = None
    structural_tag: Annotated[Any, NotYet("no structural tags")] = None


def _bad(message: str, param: str) -> APIError:
    return APIError(message, 400, param=param)


def _from_json(schema: str | dict[str, Any], param: str) -> str:
    from llguidance import LLMatcher

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise _bad(f"{param} is not valid JSON: {exc}", param) from None
        if not isinstance(schema, dict):
            raise _bad(f"{param} must be a JSON schema object.", param)
    try:
        return LLMatcher.grammar_from_json_schema(closed(schema), defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise _bad(f"{param} is not a valid JSON schema: {exc}", param) from None


_SCHEMA_VALUED = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OTHER_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with `additionalProperties: false` on each object that lists its properties,
    requires none it does not list, and says nothing of other keys. A schema that composes
    objects (allOf of two or more) stays as written: closing each part would forbid the others'
    keys, which only unevaluatedProperties (not generated here) expresses."""
    return schema if _composes(schema) else _close(schema)


def json_objects(value: Any) -> Iterator[dict[str, Any]]:
    """Every object in a JSON value; iterative, as a schema may nest deeper than Python's stack."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _composes(schema: dict[str, Any]) -> bool:
    return any(isinstance(n.get("allOf"), list) and len(n["allOf"]) > 1 for n in json_objects(schema))


def _close(schema: dict[str, Any]) -> dict[str, Any]:
    """`closed` on a schema without allOf compositions: every subschema copied, none changed in place."""
    root = dict(schema)
    stack = [root]
    while stack:
        node = stack.pop()
        for key, value in node.items():
            if key in _SCHEMA_VALUED and isinstance(value, dict):
                node[key] = child = dict(value)
                stack.append(child)
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                node[key] = [dict(s) if isinstance(s, dict) else s for s in value]
                stack.extend(s for s in node[key] if isinstance(s, dict))
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                node[key] = {name: dict(s) if isinstance(s, dict) else s for name, s in value.items()}
                stack.extend(s for s in node[key].values() if isinstance(s, dict))
        props, required = node.get("properties"), node.get("required", [])
        if (isinstance(props, dict) and not any(k in node for k in _OTHER_KEYS)
                and isinstance(required, list) and all(r in props for r in required)):
            node["additionalProperties"] = False
    return root


def _from_choice(choices: list[str]) -> str:
    from llguidance import LLMatcher

    # One terminal (a single lexer regex), not a rule per choice: thousands of choices stay one
    # lexeme instead of overflowing the parser's rows. Lark string literals take JSON's escapes.
    return LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " +
                                       " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))


def _from_grammar(text: str) -> str:
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    return LLMatcher.grammar_from_lark(any_to_lark(text))


def _from_regex(regex: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_regex(regex)


class _Constraint(NamedTuple):
    field: str  # the request field that sets it
    param: str  # the field a 400 about its content names
    kind: str  # json, json_object, regex, choice or grammar
    value: Any


def _requested(req: Any) -> list[_Constraint]:
    """Every constraint the request sets (valid requests set at most one); naming them is cheap,
    so conflicts are refused before any grammar is built."""
    out: list[_Constraint] = []
    rf = getattr(req, "response_format", None)
    if isinstance(rf, JsonObjectFormat):
        out.append(_Constraint("response_format", "response_format", "json_object", None))
    elif isinstance(rf, JsonSchemaResponseFormat):
        schema = rf.json_schema.schema
        out.append(_Constraint("response_format", "response_format.json_schema.schema", "json",
                               ANY_OBJECT if schema is None else schema))
    so: StructuredOutputs | None = getattr(req, "structured_outputs", None)
    if so is not None:
        kinds = [(name, value) for name, value in (("json", so.json), ("regex", so.regex), ("choice", so.choice),
                                                   ("grammar", so.grammar), ("json_object", so.json_object or None))
                 if value is not None]
        if len(kinds) != 1:
            raise _bad("structured_outputs takes exactly one of json, regex, choice, grammar and json_object.",
                       "structured_outputs")
        param = f"structured_outputs.{kinds[0][0]}"
        out.append(_Constraint(param, param, kinds[0][0], kinds[0][1]))
    forced = _forced_calls(req)
    if forced is not None:
        out.append(_Constraint("tool_choice", "tool_choice", "json", forced))
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        value = getattr(req, name, None)
        if value is not None:
            out.append(_Constraint(name, name, name.removeprefix("guided_"), value))
    return out


def _forced_calls(req: Any) -> dict[str, Any] | None:
    """tool_choice "required" or a named function: the schema of the calls (tool_calls.py)."""
    from rill.services.gateway.chat_tools import tool_choice_name
    from rill.services.gateway.tool_calls import forced_schema

    tools = getattr(req, "tools", None)
    if not tools:
        return None
    return forced_schema(tools, tool_choice_name(req.tool_choice, tools), req.parallel_tool_calls is not False)


def _build(c: _Constraint) -> str:
    try:
        return _grammar(c.param, c.kind, c.value)
    except APIError:
        raise
    except Exception as exc:  # llguidance's converters raise bare Exceptions on bad input
        raise _bad(f"Invalid {c.param}: {exc}", c.param) from None


def _grammar(param: str, kind: str, value: Any) -> str:
    if kind == "json":
        return _from_json(value, param)
    if kind == "json_object":
        return _from_json(ANY_OBJECT, param)
    if kind == "regex":
        return _from_regex(value)
    if kind == "choice":
        return _from_choice(value)
    return _from_grammar(value)


def check(req: Any) -> None:
    """The 400s that need no grammar: two constraints at once, or one with fields it overrides."""
    found = _requested(req)
    if not found:
        return
    if len(found) > 1:
        raise _bad(f"Give one structured output constraint, not {found[0].field} and {found[1].field}.",
                   found[1].field)
    # The grammar decides where the output ends.
    if getattr(req, "min_tokens", None):
        raise _bad("min_tokens cannot be combined with structured outputs (the grammar decides where the "
                   "output ends).", "min_tokens")
    if getattr(req, "ignore_eos", None):
        raise _bad("ignore_eos cannot be combined with structured outputs (the grammar decides where the "
                   "output ends).", "ignore_eos")


def grammar_of(req: Any, reasoning: str = "none") -> str | None:
    """The request's constraint (`check` has passed) as an llguidance grammar, built once and
    validated: a 400 naming the field when it cannot run. `reasoning`: the chat request's
    reasoning parser, whose reasoning the grammar admits before the answer it shapes."""
    from llguidance import LLMatcher

    found = _requested(req)
    if not found:
        return None
    param = found[0].field
    grammar = _build(found[0])
    if len(grammar) > MAX_GRAMMAR_BYTES:
        raise _bad(f"{param} is too large: {len(grammar)} bytes as a grammar, at most {MAX_GRAMMAR_BYTES}.", param)
    why = LLMatcher.validate_grammar(grammar)
    if why:
        raise _bad(f"Invalid {param}: {why.strip()}", param)
    if _matches_nothing(grammar):
        raise _bad(f"{param} matches no output at all (a schema that only refers to itself, say).", param)
    return grammar if _writes_reasoning(found[0].value) else after_reasoning(grammar, reasoning)


ANSWER = "rill_answer"  # the constraint's name, as a subgrammar after the reasoning


def after_reasoning(grammar: str, parser: str) -> str:
    """`grammar` (llguidance's JSON form or Lark text) applied after the reasoning that `parser`
    reads off an output's start (reasoning.reasoning_regex), unchanged without a parser. The
    reasoning is free text, ended lazily by the first end tag; whitespace may follow it."""
    from rill.services.gateway.reasoning import reasoning_regex

    reasoning = reasoning_regex(parser)
    if reasoning is None:
        return grammar
    regex, required = reasoning
    try:
        top = json.loads(grammar)
    except ValueError:
        top = {"grammars": [{"lark_grammar": grammar}]}
    answer, *others = top["grammars"]
    lark = (f"start: think{'' if required else '?'} @{ANSWER}\nthink: thought GAP?\n"
            f"thought[lazy]: /{regex}/\nGAP: /[ \\t\\r\\n]+/\n")
    top["grammars"] = [{"lark_grammar": lark}, {**answer, "name": ANSWER}, *others]
    return json.dumps(top)


def _writes_reasoning(value: Any) -> bool:
    """Whether a constraint names the end tag: it shapes the reasoning too, from the first token."""
    from rill.services.gateway.reasoning import END

    text = value if isinstance(value, str) else json.dumps(value)
    return END in text.replace("\\/", "/")


@functools.cache
def _byte_tokenizer() -> Any:  # llguidance.LLTokenizer: one token per byte, and an end token
    from llguidance import LLTokenizer

    return LLTokenizer("byte")


def _matches_nothing(grammar: str) -> bool:
    """Whether no string matches: such a grammar allows only the end token, which would end the
    output empty as if it had finished. Over bytes, so any tokenizer's answer is the same."""
    from llguidance import LLMatcher

    m = LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    m.compute_bitmask()
    return m.is_stopped() and not m.is_accepting()
