"""Tools for chat templates that do not render them.

A template that never reads `tools` (SmolLM2's, Gemma's, most base ChatML ones) drops a
request's tools without a word, as transformers and vLLM render it: the model is never told
what it may call. Rill then tells it in text instead, in the hermes format that the gateway's
parser reads for such templates (services/gateway/tool_calls.py), as llama.cpp does for
templates without tool support:
- the tool signatures and the call format go at the end of the system message (a new one
  first when there is none; into the first user message if the template refuses a system);
- an assistant turn's calls become `<tool_call>` blocks after its content;
- tool results become user turns of `<tool_response>` blocks (consecutive ones in one turn),
  since such templates know no tool role or reject it.
Calls and results in the history are written so whether or not the request offers tools.

Phi-4-mini's template reads no `tools` either, but a system message's own: the JSON list of
functions it writes between <|tool|> tags, as the model was trained (tools_in_system). Its calls
come back as `<|tool_call|>[...]` (the gateway's phi4_mini parser).
"""

from __future__ import annotations

import json
import re
from typing import Any

# A template that renders a system message's `tools` field (Phi-4-mini's).
SYSTEM_TOOLS = re.compile(r"""message\s*\[\s*['"]tools['"]\s*\]|message\.tools\b""")
DEFAULT_SYSTEM = "You are a helpful assistant with some tools."  # Phi-4-mini's model card's

_INTRO = ("# Tools\n\nYou may call one or more of the functions below to answer. Their signatures, "
          "one JSON object per line:\n<tools>\n")
_OUTRO = ("\n</tools>\n\nTo call a function, answer with one JSON object per call, each inside "
          "<tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function name>, \"arguments\": "
          "<arguments as a JSON object>}\n</tool_call>")


def tools_text(tools: list[dict[str, Any]]) -> str:
    return _INTRO + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + _OUTRO


def _call_block(call: dict[str, Any]) -> str:
    fn = call["function"]
    return "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False) \
        + "\n</tool_call>"


def history_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Template messages with calls and tool results written as hermes text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        elif m.get("tool_calls"):
            blocks = [_call_block(c) for c in m["tool_calls"]]
            text = "\n".join([m["content"], *blocks] if m["content"] else blocks)
            out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": text})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]], in_system: bool = True
               ) -> list[dict[str, Any]]:
    """`messages` (template messages) telling the model about `tools`; `in_system` false puts
    the signatures in the first user message instead (templates that reject a system turn)."""
    text = tools_text(tools)
    out = history_as_text(messages)
    if not in_system:
        at = next((i for i, m in enumerate(out) if m["role"] == "user"), 0)
        out[at] = {**out[at], "content": f"{text}\n\n{out[at]['content']}"}
        return out
    if out and out[0]["role"] == "system":
        head = out[0]["content"]
        return [{**out[0], "content": f"{head}\n\n{text}" if head else text}, *out[1:]]
    return [{"role": "system", "content": text}, *out]


def tools_in_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` (template messages) with `tools` as Phi-4-mini's template takes them: the
    functions' JSON list in the system message's `tools` (a system message first when there is
    none), and an assistant turn's calls as `<|tool_call|>[...]<|/tool_call|>` after its content.
    Tool results keep their role, which the template writes as it writes any."""
    functions = json.dumps([t.get("function", t) for t in tools], ensure_ascii=False)
    out = calls_in_content(messages)
    if out and out[0]["role"] == "system":
        return [{**out[0], "tools": functions}, *out[1:]]
    return [{"role": "system", "content": DEFAULT_SYSTEM, "tools": functions}, *out]


def calls_in_content(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant turn's calls as Phi-4-mini writes them, `<|tool_call|>[...]<|/tool_call|>`
    after its content (its template writes no `tool_calls`)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = json.dumps([{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                for c in m["tool_calls"]], ensure_ascii=False)
            text = f"{m['content'] or ''}<|tool_call|>{calls}<|/tool_call|>"
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}
        out.append(m)
    return out
