"""A request body from raw bytes to the tokenizer's message: decode (msgspec's errors as OpenAI
errors), check the rules across fields and per gateway, convert. The bodies themselves, and every
rule a single field states, are in bodies.py."""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar, get_type_hints

import msgspec
from msgspec import Struct

from rill.services.gateway.bodies import (
    DEFAULT_MAX_LOGPROBS,
    MAX_LOGGED_UNKNOWN,
    MAX_TOKEN_CHARS,
    AssistantMessage,
    ChatCompletionRequest,
    ChatFrame,
    CompletionFrame,
    CompletionRequest,
    Content,
    GenerateBody,
    Message,
    TextPart,
    TokenizeBody,
    UnreadPart,
)
from rill.services.gateway.chat_tools import chat_tool_calls, tool_choice_name, tool_definitions
from rill.services.gateway.errors import APIError
from rill.services.gateway.fields import NotYet
from rill.services.gateway.structured import check as check_structured
from rill.services.gateway.structured import grammar_of
from rill.shared.kinds import RequestKind
from rill.shared.request_params import TEMPLATE_FIELDS, ChatMessage, SamplingParams
from rill.shared.schema import GenerateRequest, TokenizeRequest

log = logging.getLogger("rill.gateway.requests")

B = TypeVar("B", bound=Struct)


# ---------------------------------------------------------------------------------------------
# Decoding: msgspec's errors as OpenAI errors


@dataclass(frozen=True)
class Admission:
    """This gateway's settings the rules depend on."""

    model_name: str
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    ignore_unknown_fields: bool = False
    max_model_len: int = 0  # 0: unknown (no size check before tokenizing)
    max_batch: int = 0  # most prompts in one completions body (the admission cap); 0: no bound
    reasoning: bool = False  # a --reasoning-parser splits the reasoning out (reasoning.py)


_ERROR = re.compile(r"(?P<msg>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?", re.S)
_NAMED = re.compile(r"Object (?P<what>missing required|contains unknown) field `(?P<name>[^`]+)`")
_logged_unknown: set[str] = set()


def _param(path: str) -> str | None:
    """msgspec's `$.messages[0].role` (or `$.logit_bias[...]` for a value in a map) as OpenAI's param."""
    return path.replace("[...]", "").lstrip(".") or None


def _lower(text: str) -> str:
    return text[:1].lower() + text[1:]


def validation_error(exc: msgspec.ValidationError) -> APIError:
    m = _ERROR.fullmatch(str(exc))
    assert m is not None  # the pattern matches any text
    msg, param = m["msg"], _param(m["path"] or "")
    named = _NAMED.fullmatch(msg)
    if named:
        param = f"{param}.{named['name']}" if param else named["name"]
        if named["what"] == "missing required":
            return APIError(f"{param} is required.", 400, param=param)
        return APIError(f"Unrecognized request argument supplied: {param}", 400, param=param)
    if param is None:
        return APIError(f"Invalid request body: {_lower(msg)}.", 400)
    where = "a key of " if m["key"] else ""
    return APIError(f"Invalid value for {where}{param}: {_lower(msg)}.", 400, param=param)


def _known_fields(cls: type[Struct]) -> frozenset[str]:
    tag = cls.__struct_config__.tag_field
    return frozenset((*cls.__struct_encode_fields__, *([tag] if tag else [])))


def _drop_unknown(raw: bytes | str, cls: type[Struct]) -> bytes | str:
    """--ignore-unknown-fields: the body without the top-level fields `cls` does not know."""
    try:
        fields = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError:
        return raw  # not an object: the typed decode reports it
    unknown = fields.keys() - _known_fields(cls)
    if not unknown:
        return raw
    for name in sorted(unknown - _logged_unknown):
        if len(_logged_unknown) < MAX_LOGGED_UNKNOWN:
            _logged_unknown.add(name)
            log.warning("ignoring unknown request field %r (--ignore-unknown-fields; logged once)", name)
    return msgspec.json.encode({k: v for k, v in fields.items() if k not in unknown})


def decode(raw: bytes | str, cls: type[B], ignore_unknown: bool = False) -> B:
    """The body as `cls`, or an APIError: 400 naming the field for anything msgspec refuses."""
    try:
        if ignore_unknown:
            raw = _drop_unknown(raw, cls)
        return msgspec.json.decode(raw, type=cls)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None
    except msgspec.DecodeError as exc:  # also invalid UTF-8 and truncated input
        text = str(exc)
        raise APIError(text if text.startswith("JSON is malformed") else f"JSON is malformed: {_lower(text)}",
                       400) from None
    except RecursionError:  # msgspec stops at Python's recursion limit (about 1,000 levels)
        raise APIError("The JSON is nested too deeply.", 400) from None


# ---------------------------------------------------------------------------------------------
# Rules across fields and per gateway


@cache
def not_yet_fields(cls: type[Struct]) -> tuple[tuple[str, NotYet], ...]:
    hints = get_type_hints(cls, include_extras=True)
    return tuple((name, meta) for name in cls.__struct_fields__
                 for meta in getattr(hints[name], "__metadata__", ()) if isinstance(meta, NotYet))


def refuse_not_yet(obj: Struct, path: str) -> None:
    """The first NotYet field (or non-text content part) set in `obj` or the Structs inside it."""
    if isinstance(obj, UnreadPart):
        raise APIError(f"{path}: {obj.__struct_config__.tag} content parts are not supported yet ({obj.why}).",
                       400, param=path)
    for name, mark in not_yet_fields(type(obj)):
        if not mark.accepts(getattr(obj, name)):
            raise mark.refusal(f"{path}.{name}" if path else name)
    for name in obj.__struct_fields__:
        value = getattr(obj, name)
        if isinstance(value, Struct):
            refuse_not_yet(value, f"{path}.{name}" if path else name)
        elif isinstance(value, list) and value and isinstance(value[0], Struct):  # messages, content parts
            for i, item in enumerate(value):
                refuse_not_yet(item, f"{path}.{name}[{i}]" if path else f"{name}[{i}]")


def _bad(message: str, param: str | None) -> APIError:
    return APIError(message, 400, param=param)


def check_model(model: str | None, model_name: str) -> None:
    if model is not None and model != model_name:
        raise APIError(f"The model `{model}` does not exist.", 404, type="NotFoundError",
                       param="model", code="model_not_found")


def _check_messages(messages: list[Message]) -> None:
    for i, m in enumerate(messages):
        if m.content is None and not isinstance(m, AssistantMessage):
            raise _bad(f"messages[{i}].content is required for role {m.__struct_config__.tag!r}.",
                       f"messages[{i}].content")


def _check_prompt(prompt: str | list[Any], max_batch: int) -> None:
    # A list of texts or of token-id lists is a batch: one request each (openai_api fans it out).
    if isinstance(prompt, str) or all(type(t) is int for t in prompt):
        return
    if any(type(t) is int for t in prompt):
        raise _bad("prompt must be a string, a list of token ids, or a list of either.", "prompt")
    if 0 < max_batch < len(prompt):  # it could never be admitted: a 400, not a 429 to retry
        raise _bad(f"A batch of {len(prompt)} prompts is more than this server lets wait at once "
                   f"({max_batch}); split it.", "prompt")


def max_tokens_of(req: GenerateBody) -> tuple[str, int | None]:
    """(the field that sets the output limit, its value): max_completion_tokens wins, as in OpenAI."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return "max_completion_tokens", req.max_completion_tokens
    return "max_tokens", req.max_tokens


def scores_only(req: GenerateBody) -> bool:
    """Completions' `echo` with `max_tokens: 0` (OpenAI's legacy scoring): the prompt and its
    logprobs come back, and the one token the engine is asked for is dropped."""
    return isinstance(req, CompletionRequest) and bool(req.echo) and req.max_tokens == 0


def logprobs_of(req: GenerateBody) -> tuple[str, int | None]:
    """(the field, how many top logprobs per output token): 0 only the sampled token's, None none.
    Completions take `logprobs` as that number; chat takes `logprobs: true` and `top_logprobs`."""
    if isinstance(req, CompletionRequest):
        return "logprobs", req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise _bad("top_logprobs requires logprobs to be true.", "top_logprobs")
    return "top_logprobs", (req.top_logprobs or 0) if req.logprobs else None


def _check_sampling(req: GenerateBody, max_logprobs: int) -> None:
    _, max_tokens = max_tokens_of(req)
    if max_tokens == 0 and not scores_only(req):
        raise _bad("max_tokens must be at least 1; 0 is for scoring a prompt, with echo: true.", "max_tokens")
    if req.min_tokens is not None and max_tokens is not None and req.min_tokens > max_tokens:
        raise _bad(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {req.min_tokens}.",
                   "min_tokens")
    name, n = logprobs_of(req)
    if n is not None and n > max_logprobs:
        raise _bad(f"Requested sample logprobs of {n}, which is greater than max allowed: {max_logprobs}.", name)
    if req.prompt_logprobs is not None and req.prompt_logprobs > max_logprobs:
        raise _bad(f"Requested prompt logprobs of {req.prompt_logprobs}, which is greater than max allowed: "
                   f"{max_logprobs}.", "prompt_logprobs")
    if req.prompt_logprobs is not None and req.stream:
        raise _bad("prompt_logprobs are not available when stream is true.", "prompt_logprobs")
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options is only allowed when stream is true.", "stream_options")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats \
            and not req.stream_options.include_usage:
        raise _bad("continuous_usage_stats needs include_usage: true.", "stream_options.continuous_usage_stats")


def _check_tools(req: ChatCompletionRequest) -> None:
    if not req.tools:  # as OpenAI: a choice among no tools is a mistake ("none" asks for nothing)
        for name in ("tool_choice", "parallel_tool_calls"):
            if getattr(req, name) not in (None, "none"):
                raise _bad(f"{name} is only allowed when tools are given.", name)
        return
    choice = tool_choice_name(req.tool_choice, req.tools)
    if choice not in ("none", "auto", "required") and all(t.function.name != choice for t in req.tools):
        raise _bad(f"tool_choice names {choice!r}, which is not among the tools.", "tool_choice")


def _check_truncation(req: GenerateBody, max_model_len: int) -> None:
    k = req.truncate_prompt_tokens  # -1, or at most the context when known
    if k == 0 or (k is not None and max_model_len > 0 and k > max_model_len):
        raise _bad(f"truncate_prompt_tokens must be -1 or between 1 and the context ({max_model_len} tokens), "
                   f"got {k}.", "truncate_prompt_tokens")
    if k is not None and (clash := "echo" if req.echo else "suffix" if getattr(req, "suffix", None) else ""):
        raise _bad(f"truncate_prompt_tokens cannot be used with {clash}.", "truncate_prompt_tokens")  # unread text, cut FIM markers


def _check_size(req: GenerateBody, max_model_len: int) -> None:
    """Prompts that cannot fit the context whatever their tokens, refused before a tokenizer
    spends time on them: more ids than the context (unless truncated to it), or more characters
    than MAX_TOKEN_CHARS per token of it (no tokenizer's token is that long; the tokenizer checks
    the rest exactly)."""
    if max_model_len <= 0:
        return
    if isinstance(req, ChatCompletionRequest):
        sizes = [("messages", sum(len(_text(m.content)) for m in req.messages), "characters")]
    else:
        prompts = prompts_of(req.prompt)
        sizes = [("prompt" if len(prompts) == 1 else f"prompt[{i}]", len(p),
                  "token ids" if isinstance(p, list) else "characters") for i, p in enumerate(prompts)]
    for param, size, unit in sizes:
        if size > (max_model_len if unit == "token ids" and req.truncate_prompt_tokens is None
                   else max_model_len * MAX_TOKEN_CHARS):
            raise _bad(f"This model's maximum context length is {max_model_len} tokens; the {param} "
                       f"({size} {unit}) cannot fit in it.", param)


def _check_frame(req: GenerateBody) -> None:
    if isinstance(req, CompletionRequest) and len(prompts_of(req.prompt)) > 1:
        raise _bad("A WebSocket frame carries one prompt; send a frame for each.", "prompt")
    if scores_only(req):  # a frame's text is what the engine generates; scoring generates nothing
        raise _bad("max_tokens 0 (scoring the prompt) is for HTTP; a frame asks prompt_logprobs.", "max_tokens")


def _check_tokenize(req: TokenizeBody) -> None:
    if req.prompt is None and req.messages is None:
        raise _bad("prompt (a string) or messages is required.", "prompt")
    if req.prompt is not None and req.messages is not None:
        raise _bad("Give prompt or messages, not both.", "prompt")
    # They reach the chat template, which text skips.
    for name in ("add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs"):
        if req.prompt is not None and getattr(req, name) is not None:
            raise _bad(f"{name} applies to messages only.", name)
    if req.messages is not None:
        turn_ending(req)


def turn_ending(req: ChatCompletionRequest | TokenizeBody) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) for the chat template: a new assistant turn
    is opened after the messages unless the final one is continued; asking for both is a 400."""
    cont = bool(req.continue_final_message)
    if cont and req.add_generation_prompt:
        raise _bad("continue_final_message and add_generation_prompt cannot both be true: the final message is "
                   "either continued or followed by a new assistant turn.", "continue_final_message")
    return (not cont if req.add_generation_prompt is None else req.add_generation_prompt), cont


def check(req: Struct, gate: Admission) -> None:
    """The rules no single field can state; each raises a 400 (404 for the model) naming its field."""
    check_model(getattr(req, "model", None), gate.model_name)
    refuse_not_yet(req, "")
    if isinstance(req, ChatCompletionRequest):
        _check_messages(req.messages)
        _check_tools(req)
        turn_ending(req)
        if req.include_reasoning is False and not gate.reasoning:
            raise APIError("include_reasoning: false needs a server started with --reasoning-parser (without "
                           "one, reasoning is never split out of the content).", param="include_reasoning")
    elif isinstance(req, CompletionRequest):
        _check_prompt(req.prompt, gate.max_batch)
    elif isinstance(req, TokenizeBody):
        _check_tokenize(req)
        if req.messages is not None:
            _check_messages(req.messages)
    if isinstance(req, (ChatCompletionRequest, CompletionRequest)):
        _check_sampling(req, gate.max_logprobs)
        _check_truncation(req, gate.max_model_len)
        _check_size(req, gate.max_model_len)
        check_structured(req)
    if isinstance(req, (ChatFrame, CompletionFrame)):
        _check_frame(req)


def parse(raw: bytes | str, cls: type[B], gate: Admission) -> B:
    """Decode and check a body: the one entry for HTTP bodies and WebSocket frames."""
    req = decode(raw, cls, gate.ignore_unknown_fields)
    check(req, gate)
    return req


# ---------------------------------------------------------------------------------------------
# Into the messages the tokenizer consumes


def _text(content: Content | None) -> str:
    if content is None:
        return ""  # an assistant turn that only carried tool calls
    if isinstance(content, str):
        return content
    return "\n".join(p.text for p in content if isinstance(p, TextPart))  # vLLM joins text parts so


def chat_messages(messages: list[Message]) -> list[ChatMessage]:
    return [ChatMessage(role=m.__struct_config__.tag, content=_text(m.content), name=m.name,
                        tool_calls=chat_tool_calls(getattr(m, "tool_calls", None)),
                        tool_call_id=getattr(m, "tool_call_id", None),
                        reasoning_content=getattr(m, "reasoning_content", None)) for m in messages]


def prompts_of(prompt: str | list[Any]) -> list[str | list[int]]:
    """A completions body's prompts: its one prompt, or each of a batch."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def thinks(req: GenerateBody) -> bool:
    """Whether the output may open with reasoning: a chat request, unless its template was told
    not to think (`enable_thinking: false`, Qwen3's and SmolLM3's switch) or it continues its
    final message (the output goes on with that message's text)."""
    return (isinstance(req, ChatCompletionRequest) and not req.continue_final_message
            and (req.chat_template_kwargs or {}).get("enable_thinking") is not False)


def reasoning_parser(req: GenerateBody, parser: str) -> str:
    """The server's reasoning parser where this request's output may open with reasoning, else none."""
    return parser if thinks(req) else "none"


def sampling_params(req: GenerateBody, reasoning: str = "none") -> SamplingParams:
    """The body's sampling settings; `reasoning`: the server's reasoning parser (chat requests)."""
    kw: dict[str, Any] = {name: getattr(req, name) for name in (
        "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
        "min_tokens", "n", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "cache_salt",
        "truncate_prompt_tokens", "return_token_ids", "prompt_logprobs", "bad_words", "stop_token_ids",
        "logit_bias", "allowed_token_ids") if getattr(req, name) is not None}
    kw["max_tokens"] = 1 if scores_only(req) else max_tokens_of(req)[1]
    kw["logprobs"] = logprobs_of(req)[1]
    if req.top_k is not None:
        kw["top_k"] = max(req.top_k, 0)  # -1 and 0 both disable
    stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
    kw["stop"] = [s for s in stop if s]  # an empty stop string would end every request at once
    kw["grammar"] = grammar_of(req, reasoning_parser(req, reasoning))
    kw["prediction"] = req.prediction.text if req.prediction is not None else None
    masks = [name for name in ("allowed_token_ids", "bad_words") if kw.get(name)]
    if masks and (kw["grammar"] or len(masks) > 1):  # masks that together may leave no token at all
        other = "structured outputs or forced tool calls" if kw["grammar"] else masks[0]
        raise _bad(f"{masks[-1]} cannot be combined with {other}.", masks[-1])
    if isinstance(req, ChatCompletionRequest) and tool_choice_name(req.tool_choice, req.tools) == "auto":
        # Calls in the model's own format start with a marker that is a special token in some
        # vocabularies (Granite's and Phi-4-mini's <|tool_call|>): kept, or no call would parse.
        kw.setdefault("skip_special_tokens", False)
    if isinstance(req, CompletionRequest) and req.echo and kw["logprobs"] is not None:
        kw["prompt_logprobs"] = max(kw["logprobs"], req.prompt_logprobs or 0)  # echo scores the prompt too
    return SamplingParams(**kw)


def echo_of(req: ChatCompletionRequest) -> str:
    """Chat's echo: the final message's text if the reply goes on in its role (a new turn's: assistant)."""
    last = req.messages[-1]
    role = last.__struct_config__.tag
    return _text(last.content) if req.echo and role == ("assistant" if turn_ending(req)[0] else role) else ""


def kind_of(req: GenerateBody) -> RequestKind:
    return "chat" if isinstance(req, ChatCompletionRequest) else "completion"


def generate_requests(req: GenerateBody, request_id: str, reply_to: str,
                      reasoning: str = "none") -> list[GenerateRequest]:
    """The checked body as the messages the tokenizer consumes: one, or one per prompt of a
    batch, `<request_id>-<i>` (the response lists prompt i's n choices from index i * n, as OpenAI).
    `reasoning`: the server's reasoning parser."""
    chat = isinstance(req, ChatCompletionRequest)
    prompts: list[str | list[int] | None] = [None] if chat else list(prompts_of(req.prompt))
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    params, arrival = sampling_params(req, reasoning), time.time()
    opens, continues = turn_ending(req) if isinstance(req, ChatCompletionRequest) else (True, False)
    return [GenerateRequest(request_id=rid, reply_to=reply_to, kind=kind_of(req), params=params,
                            arrival_time=arrival, messages=chat_messages(req.messages) if chat else None,
                            prompt=prompt, suffix=None if chat else req.suffix or None,
                            tools=tool_definitions(req.tools) if chat else None,
                            chat_template_kwargs=template_variables(req) if chat else {},
                            add_generation_prompt=opens, continue_final_message=continues,
                            add_special_tokens=req.add_special_tokens, priority=req.priority or 0)
            for rid, prompt in zip(ids, prompts, strict=True)]


def template_variables(req: ChatCompletionRequest | TokenizeBody) -> dict[str, Any]:
    """What the request sets in its template: its fields only a template reads and its own template
    (chat_template: the tokenizer's to allow), then its chat_template_kwargs, which win (as in vLLM)."""
    fields = {name: getattr(req, name, None) for name in (*TEMPLATE_FIELDS, "chat_template")}
    return {**{k: v for k, v in fields.items() if v is not None}, **(req.chat_template_kwargs or {})}


def tokenize_request(body: TokenizeBody, reply_to: str) -> TokenizeRequest:
    """The checked /tokenize body as the message the tokenizer consumes."""
    if body.messages is None:
        return TokenizeRequest(request_id="", reply_to=reply_to, prompt=body.prompt,
                               add_special_tokens=body.add_special_tokens)
    opens, continues = turn_ending(body)
    return TokenizeRequest(request_id="", reply_to=reply_to, messages=chat_messages(body.messages),
                           add_generation_prompt=opens, continue_final_message=continues,
                           add_special_tokens=body.add_special_tokens, tools=tool_definitions(body.tools),
                           chat_template_kwargs=template_variables(body))
