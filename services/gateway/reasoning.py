"""Reasoning on the way out: a thinking model's `<think>…</think>` text as `reasoning_content`.

`--reasoning-parser` (vLLM's flag, and the field DeepSeek's API and vLLM answer with):
- "qwen3": reasoning is what the model writes between `<think>` and `</think>` at the start of its
  output (Qwen3, SmolLM3); output that does not start with `<think>` is all content.
- "deepseek_r1": the chat template opened the reasoning, so the output starts inside it, up to
  `</think>` (a `<think>` the model writes anyway is dropped).
- "none" (the default): the text stays content, tags and all.

Output cut short inside the reasoning is all reasoning, and its content null. After `</think>` the
text is the answer: its leading whitespace is dropped, and tool calls are parsed from it. A
request's `include_reasoning: false` keeps the reasoning out of the response. Under structured
outputs the model still reasons first, as vLLM lets it: the grammar shapes the answer after
`</think>` (structured.py), unless it writes the tags itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rill.services.gateway.tool_formats import marker_tail

START, END = "<think>", "</think>"
PARSERS = ("none", "qwen3", "deepseek_r1")


@dataclass(frozen=True)
class Reasoning:
    """One request's reasoning split: `opened` when the prompt opened the reasoning
    (deepseek_r1); `include` false drops it from the response."""

    opened: bool
    include: bool = True

    def length(self, text: str) -> int:
        """How many characters a finished output's reasoning takes from its start, tags included
        (where `split` cuts): 0 without any, all of it when the end tag never came."""
        head = text.lstrip()
        if head.startswith(START):
            start = len(text) - len(head) + len(START)
        elif self.opened:
            start = 0
        else:
            return 0
        at = text.find(END, start)
        return len(text) if at < 0 else at + len(END)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output."""
        stream = ReasoningStream(self)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
        if not stream.reasoned:
            return None, content
        return (reasoning if self.include else None), (content or None if stream.answered else None)


def reasoning_for(body: Any, parser: str) -> Reasoning | None:
    """The chat request's Reasoning, or None when the server has no reasoning parser."""
    if parser == "none":
        return None
    return Reasoning(opened=parser == "deepseek_r1", include=getattr(body, "include_reasoning", None) is not False)


def reasoning_regex(parser: str) -> tuple[str, bool] | None:
    """The reasoning this parser reads off the start of an output, for a grammar to admit before
    the answer it shapes (structured.py): a regex (llguidance's Lark syntax) to be matched up to
    the first END, and whether the output must open with it. None without a parser."""
    if parser == "none":
        return None
    end = END.replace("/", "\\/")
    if parser == "deepseek_r1":  # the template opened it: the output starts inside
        return f"(.|\\n)*{end}", True
    # The tag first: leading whitespace would commit a model that does not think to reasoning.
    return f"{START}(.|\\n)*{end}", False


def parser_hint(parser: str, templates: list[str]) -> str | None:
    """One line for the log at start when the parser and the chat template disagree, else None:
    a template that writes thinking tags with no parser (the reasoning reaches clients as
    content), a parser with a template that never writes them (qwen3: the model may not think;
    deepseek_r1: every answer would be reasoning)."""
    tags = any(START in t or END in t for t in templates)
    if parser == "none" and tags:
        return ("the chat template writes <think> tags: the reasoning goes out as content; start with "
                "--reasoning-parser qwen3 (or deepseek_r1 when the template opens it) to return reasoning_content")
    if parser == "qwen3" and templates and not tags:
        return ("--reasoning-parser qwen3, but the chat template never writes <think>: a model that does not think "
                "gains nothing from it, and under structured outputs may open a reasoning it was not trained to write")
    if parser == "deepseek_r1" and templates and not tags:
        return ("--reasoning-parser deepseek_r1, but the chat template never opens <think>: every answer is taken "
                "as reasoning until a </think> the model may never write; qwen3 splits only what the output opens")
    return None


class ReasoningStream:
    """One choice's text split as it streams into reasoning and content deltas. Text that may be
    the start of a tag is held back until the next piece tells."""

    def __init__(self, mode: Reasoning) -> None:
        self.mode = mode
        self.held = ""  # text not yet released
        self.state = "head"  # head: before a leading <think> is decided; then reasoning, gap, content
        self.reasoned = False  # the output had a reasoning part
        self.answered = False  # `</think>` came: the rest is content

    def feed(self, piece: str) -> tuple[str, str]:
        """(reasoning, content) that may go out now, given the next piece of text."""
        self.held += piece
        reasoning, content = [], []
        while True:
            text = self.held
            if self.state == "head":
                head = text.lstrip()
                if START.startswith(head) and len(head) < len(START):
                    return self._out(reasoning, content)  # may still become <think>
                if head.startswith(START):
                    self.held, self.state, self.reasoned = head[len(START):], "reasoning", True
                elif self.mode.opened:
                    self.state, self.reasoned = "reasoning", True
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                at = text.find(END)
                if at < 0:
                    keep = marker_tail(text, END)
                    reasoning.append(text[:len(text) - keep])
                    self.held = text[len(text) - keep:]
                    return self._out(reasoning, content)
                reasoning.append(text[:at])
                self.held, self.state, self.answered = text[at + len(END):], "gap", True
            elif self.state == "gap":  # whitespace between the reasoning and the answer
                self.held = text.lstrip()
                if not self.held:
                    return self._out(reasoning, content)
                self.state = "content"
            else:
                content.append(text)
                self.held = ""
                return self._out(reasoning, content)

    def finish(self) -> tuple[str, str]:
        """At the finish: what was held back (a tag that never completed is text)."""
        text, self.held = self.held, ""
        if self.state == "head" and self.mode.opened:
            self.reasoned = True
            return self._out([text], [])
        if self.state == "reasoning":
            return self._out([text], [])
        return self._out([], [] if self.state == "gap" else [text])

    def _out(self, reasoning: list[str], content: list[str]) -> tuple[str, str]:
        return ("".join(reasoning) if self.mode.include else ""), "".join(content)
