"""The tool parts of a chat request as typed Structs: the function tools offered to the model
(`tools`) and the calls of earlier assistant turns (`messages[].tool_calls`), with what the
tokenizer gets of them. Both reach the chat template (services/tokenizer/chat_template.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from rill.shared.request_params import ChatToolCall

FUNCTION_NAME = Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$",
                                    description="a-z, A-Z, 0-9, underscores and dashes, at most 64.")]


class FunctionDefinition(Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: FUNCTION_NAME
    description: str | None = None
    parameters: Annotated[dict[str, Any], Meta(description="A JSON Schema object.")] | None = None
    strict: bool | None = None


class FunctionTool(Struct, forbid_unknown_fields=True, omit_defaults=True, tag_field="type", tag="function"):
    function: FunctionDefinition


class CalledFunction(Struct, forbid_unknown_fields=True):
    name: str
    arguments: Annotated[str, Meta(description="The arguments as JSON text.")]


class ToolCall(Struct, forbid_unknown_fields=True, tag_field="type", tag="function"):
    """A call the model made in an earlier assistant turn, sent back in the history."""

    id: str
    function: CalledFunction


def tool_definitions(tools: list[FunctionTool] | None) -> list[dict[str, Any]] | None:
    """The tools as the JSON objects the client sent (fields it left out stay out), which is
    what templates iterate over (`tool.function.name`, ...)."""
    return None if tools is None else msgspec.to_builtins(tools)


def chat_tool_calls(calls: list[ToolCall] | None) -> list[ChatToolCall]:
    return [ChatToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments) for c in calls or []]


class NamedFunction(Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(Struct, forbid_unknown_fields=True, tag_field="type", tag="function"):
    """tool_choice naming the one function the model must call."""

    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def tool_choice_name(choice: ToolChoice | None, tools: list[FunctionTool] | None) -> str:
    """"none", "auto", "required" or the forced function's name; tools default to "auto" (OpenAI)."""
    if isinstance(choice, NamedToolChoice):
        return choice.function.name
    return choice or ("auto" if tools else "none")
