"""OpenAI response objects built from a request's TextDeltas: full responses, SSE chunks,
usage and logprobs, for completions and chat, with n choices.

A request with n samples gets choice i from sample i (RequestStream.index tells which); every
choice keeps its own text, finish reason, token count and logprobs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from rill.services.gateway.chat_output import PLAIN, ChatOutput, ChatStream
from rill.services.gateway.errors import APIError
from rill.services.gateway.tool_calls import calls_finish
from rill.shared.kinds import RequestKind
from rill.shared.schema import ErrorReply, TextDelta, TextLogprob, TopLogprob

GENERATION_FAILED = "The request failed during generation."
# JSON has no -inf; OpenAI reports an impossible token's logprob as -9999.0.
MIN_LOGPROB = -9999.0


def error_from_reply(err: ErrorReply) -> APIError:
    status = err.status if 400 <= err.status <= 599 else 500  # never let a bad status break the reply
    return APIError(err.message, status, type=err.type, param=err.param)


# ---------------------------------------------------------------------------------------------
# Accumulation


class Choice:
    """One sample's text, finish reason, token count and logprobs, from its in-order deltas."""

    __slots__ = ("parts", "finish_reason", "completion_tokens", "logprobs")

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.logprobs: list[TextLogprob] = []

    def add(self, d: TextDelta) -> None:
        if d.text:
            self.parts.append(d.text)
        # Offsets count output tokens, so they bound the count even if a delta omits it.
        self.completion_tokens = max(self.completion_tokens, d.completion_tokens, d.offset + d.num_tokens)
        self.logprobs.extend(d.logprobs)
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.parts)


class Output:
    """Every choice of one request plus its prompt size."""

    def __init__(self, n: int = 1, tokens_as_ids: bool = False, scores_only: bool = False) -> None:
        self.choices = [Choice() for _ in range(n)]
        self.prompt_tokens = 0
        self.cached_tokens = 0  # of the prompt, as sample 0 found them (the others share its blocks)
        self.tokens_as_ids = tokens_as_ids
        self.scores_only = scores_only  # echo with max_tokens 0: the output token is dropped (requests.py)
        # Echo with logprobs: the prompt's, shared by every choice (sample 0 computes the prompt).
        self.prompt_logprobs: list[TextLogprob] = []

    def add(self, d: TextDelta, index: int = 0) -> TextDelta:
        """Take a delta (relabelled when tokens are shown as ids, emptied when only the prompt is
        scored), and return it as taken."""
        if self.tokens_as_ids and (d.logprobs or d.prompt_logprobs):
            d = msgspec.structs.replace(d, logprobs=as_token_ids(d.logprobs),
                                        prompt_logprobs=as_token_ids(d.prompt_logprobs))
        if self.scores_only:  # max_tokens 0 is reached before any token, whatever the engine's reason
            finish = d.finish_reason if d.finish_reason in (None, "error") else "length"
            d = msgspec.structs.replace(d, text="", logprobs=[], offset=0, num_tokens=0, completion_tokens=0,
                                        finish_reason=finish)
        if d.prompt_logprobs:
            self.prompt_logprobs = d.prompt_logprobs
        self.prompt_tokens = max(self.prompt_tokens, d.prompt_tokens)
        if index == 0 and d.cached_tokens:
            self.cached_tokens = d.cached_tokens
        self.choices[index].add(d)
        return d

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    @property
    def failed(self) -> bool:
        return any(c.finish_reason == "error" for c in self.choices)

    def usage(self) -> dict[str, Any]:
        completion = sum(c.completion_tokens for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


# ---------------------------------------------------------------------------------------------
# Logprobs in the two OpenAI shapes


def as_token_ids(lps: list[TextLogprob]) -> list[TextLogprob]:
    """vLLM's `return_tokens_as_token_ids`: tokens shown as "token_id:<id>", which stays exact
    where a token's text alone is ambiguous (bytes of a split character, spaces)."""
    return [TextLogprob(f"token_id:{lp.token_id}", lp.logprob, lp.token_id,
                        [TopLogprob(f"token_id:{t.token_id}", t.logprob, t.token_id) for t in lp.top])
            for lp in lps]


def _lp(v: float | None) -> float | None:
    return None if v is None else max(v, MIN_LOGPROB)


def chat_logprobs(lps: list[TextLogprob]) -> dict[str, Any]:
    """Chat: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    return {"content": [
        {"token": lp.token, "logprob": _lp(lp.logprob), "bytes": list(lp.token.encode()),
         "top_logprobs": [{"token": t.token, "logprob": _lp(t.logprob), "bytes": list(t.token.encode())}
                          for t in lp.top]}
        for lp in lps]}


def completion_logprobs(lps: list[TextLogprob], text_offset: int) -> dict[str, Any]:
    """Completions: parallel lists; each top_logprobs dict holds the top tokens and the sampled one.
    text_offset: where the first token's text starts in the choice's text."""
    offsets: list[int] = []
    for lp in lps:
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return {"tokens": [lp.token for lp in lps], "token_logprobs": [_lp(lp.logprob) for lp in lps],
            "top_logprobs": [None if lp.logprob is None else
                             {**{t.token: _lp(t.logprob) for t in lp.top}, lp.token: _lp(lp.logprob)}
                             for lp in lps],
            "text_offset": offsets}


def echo_logprobs(prompt: list[TextLogprob], lps: list[TextLogprob], text_offset: int) -> dict[str, Any]:
    """Completions with echo: the prompt's tokens (offsets from 0) before the output's."""
    head, tail = completion_logprobs(prompt, 0), completion_logprobs(lps, text_offset)
    return {k: head[k] + tail[k] for k in head}


# ---------------------------------------------------------------------------------------------
# Non-streamed responses


def full_response(kind: RequestKind, request_id: str, model: str, out: Output, logprobs: bool,
                  echo: str = "", chat: ChatOutput = PLAIN) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    for i, c in enumerate(out.choices):
        if kind == "chat":
            message, finish = chat.message(c.text, c.finish_reason)
            choices.append({"index": i, "message": message,
                            "logprobs": chat_logprobs(c.logprobs) if logprobs else None,
                            "finish_reason": finish})
        else:
            lp = None
            if logprobs:
                lp = echo_logprobs(out.prompt_logprobs, c.logprobs, len(echo)) if echo else \
                    completion_logprobs(c.logprobs, 0)
            choices.append({"index": i, "text": echo + c.text, "logprobs": lp, "finish_reason": c.finish_reason})
    return {"id": request_id, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices, "usage": out.usage()}


def summed_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: summed_usage([u[k] for u in usages]) if isinstance(v, dict) else sum(u[k] for u in usages)
            for k, v in usages[0].items()}


def batch_response(responses: list[dict[str, Any]]) -> dict[str, Any]:
    """One response of a batch's per-prompt responses: prompt i's choices from index i * n."""
    if len(responses) == 1:
        return responses[0]
    choices = [c for r in responses for c in r["choices"]]
    return {**responses[0], "choices": [{**c, "index": i} for i, c in enumerate(choices)],
            "usage": summed_usage([r["usage"] for r in responses])}


# ---------------------------------------------------------------------------------------------
# Server-sent events

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


Event = TextDelta | ErrorReply


class Formatter(Protocol):
    """Writes one request's events as SSE (ChunkFormatter; responses_api.EventFormatter)."""

    failed: bool

    def head(self, first: list[Event]) -> bytes: ...

    def render(self, batch: list[Event]) -> bytes: ...


class Shape(Protocol):
    """Another API over the chat machinery (responses_api.py): its id, full object and stream."""

    request_id: str

    def full(self, out: Output, chat: ChatOutput) -> dict[str, Any]: ...

    def formatter(self, chat: ChatOutput) -> Formatter: ...

    def end(self) -> bytes: ...


class ChunkFormatter:
    """Builds the SSE chunks of one streamed request (chat.completion.chunk or text_completion)."""

    def __init__(self, kind: RequestKind, request_id: str, model: str, include_usage: bool, n: int = 1,
                 index: Callable[[TextDelta], int] = lambda d: 0, logprobs: bool = False,
                 echo: str = "", tokens_as_ids: bool = False, chat: ChatOutput = PLAIN,
                 first_index: int = 0, scores_only: bool = False, continuous_usage: bool = False) -> None:
        self.kind = kind
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # vLLM's continuous_usage_stats: usage in every chunk
        self.index = index
        self.first_index = first_index  # a batch's prompt i: its choices are i * n ... (OpenAI's order)
        self.logprobs = logprobs
        self.echo = echo
        self.output = Output(n, tokens_as_ids, scores_only)
        self.text_offsets = [len(echo)] * n  # completions logprobs: where the next token's text starts
        self.prompt_sent = [False] * n
        self.failed = False
        # Chat with tools or reasoning: each choice's text passes through its ChatStream (chat_output.py).
        self.chat = [ChatStream(chat) for _ in range(n)] if kind == "chat" and not chat.plain else None

    @property
    def object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def _chunk(self, choices: list[dict[str, Any]]) -> bytes:
        obj: dict[str, Any] = {"id": self.request_id, "object": self.object, "created": self.created,
                               "model": self.model, "choices": choices}
        if self.include_usage:
            obj["usage"] = self.output.usage() if self.continuous_usage else None
        return sse(obj)

    def _choice(self, i: int, text: str, lps: list[TextLogprob], finish_reason: str | None,
                reasoning: str = "") -> dict[str, Any]:
        at = self.first_index + i
        if self.kind == "chat":
            delta = {"reasoning_content": reasoning} if reasoning else {}
            if text:
                delta["content"] = text
            return {"index": at, "delta": delta,
                    "logprobs": chat_logprobs(lps) if self.logprobs else None, "finish_reason": finish_reason}
        logprobs = None
        if self.logprobs:
            if self.echo and not self.prompt_sent[i]:  # the prompt's logprobs go with the first output
                logprobs = echo_logprobs(self.output.prompt_logprobs, lps, self.text_offsets[i])
                self.prompt_sent[i] = True
            else:
                logprobs = completion_logprobs(lps, self.text_offsets[i])
            self.text_offsets[i] += sum(len(lp.token) for lp in lps)
        return {"index": at, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def head(self, first: list[Event]) -> bytes:
        """The opening chunk, then the first events' (which tell the prompt's size)."""
        self.output.prompt_tokens = max([ev.prompt_tokens for ev in first if isinstance(ev, TextDelta)], default=0)
        return self.start() + self.render(first)

    def start(self) -> bytes:
        at = range(self.first_index, self.first_index + len(self.output.choices))
        if self.kind == "chat":
            # A forced call has no content: null, as OpenAI sends it (clients open no text part).
            content = None if self.chat and self.chat[0].forced else ""
            return self._chunk([{"index": i, "delta": {"role": "assistant", "content": content},
                                 "logprobs": None, "finish_reason": None} for i in at])
        if self.echo:
            return self._chunk([{"index": i, "text": self.echo, "logprobs": None, "finish_reason": None}
                                for i in at])
        return b""

    def render(self, batch: list[Event]) -> bytes:
        out: list[bytes] = []
        for ev in batch:
            if isinstance(ev, ErrorReply):
                out.append(sse(error_from_reply(ev).body()))
                self.failed = True
                continue
            i = self.index(ev)
            ev = self.output.add(ev, i)
            if ev.finish_reason == "error":
                out.append(sse(APIError(GENERATION_FAILED, 500).body()))
                self.failed = True
            elif self.chat is not None:
                out.append(self._chat_chunks(i, ev))
            elif ev.text or ev.finish_reason is not None or (self.logprobs and ev.logprobs):
                out.append(self._chunk([self._choice(i, ev.text, ev.logprobs, ev.finish_reason)]))
        return b"".join(out)

    def _chat_chunks(self, i: int, ev: TextDelta) -> bytes:
        """A chat delta of a request with tools or reasoning: reasoning and content as the
        ChatStream releases them, then tool-call deltas (forced calls as generated; parsed ones,
        or the held text as content, at the finish)."""
        assert self.chat is not None
        at, finish = self.first_index + i, ev.finish_reason
        d = self.chat[i].feed(ev.text, finish is not None)
        chunks: list[bytes] = []
        if d.content or d.reasoning or (self.logprobs and ev.logprobs):
            chunks.append(self._chunk([self._choice(i, d.content, ev.logprobs, None, d.reasoning)]))
        if d.tool_calls:
            chunks.append(self._chunk([{"index": at, "delta": {"tool_calls": d.tool_calls}, "logprobs": None,
                                        "finish_reason": None}]))
        if d.calls:
            finish = calls_finish(finish, d.calls)
        if finish is not None:
            chunks.append(self._chunk([{"index": at, "delta": {}, "logprobs": None, "finish_reason": finish}]))
        return b"".join(chunks)


def stream_end(fmts: list[ChunkFormatter]) -> bytes:
    """The end of a stream: the usage chunk (a batch's summed over its prompts) unless a choice
    failed, then [DONE]."""
    head = fmts[0]
    if not head.include_usage or any(f.failed for f in fmts):
        return DONE
    return sse({"id": head.request_id, "object": head.object, "created": head.created, "model": head.model,
                "choices": [], "usage": summed_usage([f.output.usage() for f in fmts])}) + DONE
