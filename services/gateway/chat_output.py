"""A chat choice's text as OpenAI's assistant message: its reasoning first (reasoning.py), then
the answer as content and tool calls (tool_calls.py), whole at the finish or as stream deltas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rill.services.gateway.reasoning import Reasoning, ReasoningStream, reasoning_for
from rill.services.gateway.requests import reasoning_parser
from rill.services.gateway.tool_calls import ToolMode, ToolStream, calls_finish, tool_mode


@dataclass(frozen=True)
class ChatParsers:
    """The served model's output formats: `--tool-call-parser` (resolved) and `--reasoning-parser`."""

    tools: str = "hermes"
    reasoning: str = "none"


DEFAULT_PARSERS = ChatParsers()


@dataclass(frozen=True)
class ChatOutput:
    """How one chat request's text becomes a message (a plain text without either part)."""

    tools: ToolMode | None = None
    reasoning: Reasoning | None = None

    @property
    def plain(self) -> bool:
        return self.tools is None and self.reasoning is None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a finished choice, and its finish reason ("tool_calls" when
        the answer became calls)."""
        thought, content = self.reasoning.split(text) if self.reasoning else (None, text)
        calls: list[dict[str, Any]] = []
        if self.tools is not None and content is not None:
            content, calls = self.tools.message(content)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thought is not None:
            message["reasoning_content"] = thought
        if calls:
            message["tool_calls"] = calls
            finish_reason = calls_finish(finish_reason, calls)
        return message, finish_reason


PLAIN = ChatOutput()


def chat_output(body: Any, parsers: ChatParsers) -> ChatOutput:
    """The chat request's ChatOutput: reasoning split off where the output may open with it."""
    return ChatOutput(tool_mode(body, parsers.tools), reasoning_for(body, reasoning_parser(body, parsers.reasoning)))


@dataclass
class ChatDelta:
    """What one piece of a choice's text releases."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's tool-call deltas
    calls: list[dict[str, Any]] = field(default_factory=list)  # at the finish: the whole calls


class ChatStream:
    """One choice's streamed text through its reasoning split and then its ToolStream."""

    def __init__(self, mode: ChatOutput) -> None:
        self.reasoning = ReasoningStream(mode.reasoning) if mode.reasoning is not None else None
        self.tools = ToolStream(mode.tools) if mode.tools is not None else None
        # A forced call has no content: clients open no text part for it.
        self.forced = mode.tools is not None and mode.tools.choice != "auto"

    def feed(self, piece: str, final: bool = False) -> ChatDelta:
        """The deltas `piece` releases; `final`: it is the choice's last, release everything."""
        d = ChatDelta()
        text = piece
        if self.reasoning is not None:
            d.reasoning, text = self.reasoning.feed(piece)
            if final:
                more_reasoning, more_text = self.reasoning.finish()
                d.reasoning, text = d.reasoning + more_reasoning, text + more_text
        if self.tools is None:
            d.content = text
            return d
        d.content, d.tool_calls = self.tools.feed(text)
        if final:
            tail, more, d.calls = self.tools.finish()
            d.content, d.tool_calls = d.content + tail, d.tool_calls + more
        return d
