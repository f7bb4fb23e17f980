"""The OpenAI request bodies as typed msgspec Structs: the one home of every request rule.

Each field's type and range is declared once, on the field (a `Meta` constraint); msgspec checks
them while it decodes the raw body, and /openapi.json is generated from the same Structs
(openapi_spec.py). The rules that span fields or depend on this gateway (the model name,
--max-logprobs) live in `check`, next to the Structs. Downstream services may assert what is
guaranteed here; they need not check it again.

Every field OpenAI or vLLM defines is either honoured, or declared `NotYet` and refused with a
400 naming it (any value but null and the field's listed no-op values, which ask for exactly what
Rill does anyway). A field nobody defines is refused as OpenAI refuses it ("Unrecognized request
argument supplied"), unless the gateway runs with --ignore-unknown-fields; then the unknown
top-level fields are dropped and each name is logged once per process. Unknown keys inside
nested objects (messages, content parts, stream_options) are always refused.

Accepted and ignored, because they are pure metadata that cannot change the output:
- `user`, `safety_identifier`: an end-user id OpenAI uses for abuse monitoring.
- `metadata`: tags for OpenAI's dashboard (with `store`, which is refused unless false).
- `prompt_cache_key`: a routing hint for OpenAI's prompt cache; Rill's prefix cache matches
  prompts by content, so the hint has nothing to add.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, ClassVar, TypeVar, get_type_hints

import msgspec
from msgspec import Meta, Struct

from rill.services.gateway.chat_tools import (
    FunctionTool,
    ToolCall,
    ToolChoice,
    chat_tool_calls,
    tool_choice_name,
    tool_definitions,
)
from rill.services.gateway.errors import APIError
from rill.services.gateway.fields import Body as _Body
from rill.services.gateway.fields import NotYet
from rill.services.gateway.structured import ResponseFormat, StructuredOutputs, grammar_of
from rill.services.gateway.structured import check as check_structured
from rill.shared.schema import ChatMessage, GenerateRequest, SamplingParams

log = logging.getLogger("rill.gateway.requests")

INT64_MAX = 2**63 - 1
MAX_TOKEN_ID = 2**31 - 1
MAX_STOP = 16
# A request's stop strings ride with each of its rows to the detokenizer every step (any replica
# may decode any row); these bounds keep that, and the worker's min_tokens bans, small.
MAX_STOP_LEN = 256
MAX_STOP_TOKEN_IDS = 128
MAX_TOKEN_CHARS = 256  # longer than any vocabulary's longest token (SmolLM2's: 81 characters)
MAX_N = 128  # OpenAI's bound on parallel samples
MAX_LOGIT_BIAS = 1024
MAX_REPETITION_PENALTY = 100.0
DEFAULT_MAX_LOGPROBS = 20  # --max-logprobs, as in vLLM
MAX_WS_ID_LEN = 128
MAX_TOOLS = 128  # OpenAI's bound on the functions of one request
MAX_LOGGED_UNKNOWN = 256  # distinct unknown names logged per process: a client cannot flood the log

Int64 = Annotated[int, Meta(ge=-(2**63), le=INT64_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
TokenIds = Annotated[list[TokenId], Meta(min_length=1)]
Text = Annotated[str, Meta(min_length=1)]
StopString = Annotated[str, Meta(max_length=MAX_STOP_LEN)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Logprobs = Annotated[int, Meta(ge=0, description="At most the server's --max-logprobs.")]
MaxTokens = Annotated[int, Meta(ge=1, le=INT64_MAX, description="Most tokens to generate; the prompt plus "
                                                                "max_tokens must fit the context window.")]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=MAX_REPETITION_PENALTY, description="1 is off.")]
# JSON object keys are strings: the pattern tells generators (schemathesis) what TokenId then checks.
LogitBias = Annotated[dict[TokenId, Annotated[float, Meta(ge=-100.0, le=100.0)]], Meta(
    max_length=MAX_LOGIT_BIAS, description="Token id (as a string) to a bias added to its logit.",
    extra_json_schema={"propertyNames": {"pattern": "^(0|[1-9][0-9]*)$"}})]
Priority = Annotated[Int64, Meta(description="Lower runs first under --scheduling-policy priority.")]
WsId = Annotated[str, Meta(min_length=1, max_length=MAX_WS_ID_LEN)] | Int64
Tools = Annotated[list[FunctionTool], Meta(max_length=MAX_TOOLS)]


TOOLS = "tool calling is planned"
TEMPLATES = "chat template options are planned"
BEAM = "Rill has no beam search"


# ---------------------------------------------------------------------------------------------
# Chat messages


class TextPart(_Body, tag_field="type", tag="text"):
    text: str


class _InputPart(Struct, tag_field="type"):
    """A non-text content part: recognised so that the 400 can say so, never read."""

    why: ClassVar[str] = "Rill serves text-only models"


class ImageURLPart(_InputPart, tag="image_url"):
    pass


class InputAudioPart(_InputPart, tag="input_audio"):
    pass


class FilePart(_InputPart, tag="file"):
    pass


class RefusalPart(_InputPart, tag="refusal"):
    why: ClassVar[str] = "no refusal turns in the chat template"


Content = str | list[TextPart | ImageURLPart | InputAudioPart | FilePart | RefusalPart]


class _Message(_Body, tag_field="role"):
    content: Content | None = None  # null only in assistant turns (that carried tool calls)
    name: str | None = None  # passed to the chat template (few templates read it)


class SystemMessage(_Message, tag="system"):
    pass


class DeveloperMessage(_Message, tag="developer"):
    pass


class UserMessage(_Message, tag="user"):
    pass


class AssistantMessage(_Message, tag="assistant"):
    tool_calls: list[ToolCall] | None = None
    function_call: Annotated[Any, NotYet(TOOLS)] = None
    refusal: Annotated[Any, NotYet("no refusal turns in the chat template")] = None
    audio: Annotated[Any, NotYet("text-only models")] = None


class ToolMessage(_Message, tag="tool", kw_only=True):
    tool_call_id: str  # required, as in OpenAI


Message = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage
Messages = Annotated[list[Message], Meta(min_length=1)]


class StreamOptions(_Body):
    include_usage: bool | None = None
    continuous_usage_stats: Annotated[Any, NotYet("usage comes in the last chunk", False)] = None


# ---------------------------------------------------------------------------------------------
# Request bodies


class _Sampling(_Body):
    """What chat and completions share: sampling as vLLM takes it (its extras at top level,
    where the openai client's `extra_body` puts them)."""

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0, description="0 is greedy.")] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=INT64_MAX, description="-1 or 0 disables top-k.")] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: LogitBias | None = None
    seed: Int64 | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Meta(ge=0, le=INT64_MAX, description="At most max_tokens.")] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    stream: bool | None = None
    stream_options: Annotated[StreamOptions, Meta(description="Only with stream: true.")] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    priority: Priority | None = None
    user: str | None = None  # metadata (module docstring)

    # Structured outputs (structured.py): at most one constraint per request.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Annotated[str | dict[str, Any], Meta(description="vLLM's older name for "
                                                                  "structured_outputs.json.")] | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[Text], Meta(min_length=1)] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Annotated[Any, NotYet("one backend, llguidance", "auto", "guidance")] = None
    guided_whitespace_pattern: Annotated[Any, NotYet("Rill's JSON is always compact")] = None
    structural_tag: Annotated[Any, NotYet("no structural tags")] = None
    bad_words: Annotated[Any, NotYet("no banned-word filter", [])] = None
    allowed_token_ids: Annotated[Any, NotYet("no allowed-token filter")] = None
    logits_processors: Annotated[Any, NotYet("no custom logits processors")] = None
    use_beam_search: Annotated[Any, NotYet(BEAM, False)] = None
    length_penalty: Annotated[Any, NotYet(BEAM, 1.0)] = None
    prompt_logprobs: Annotated[Any, NotYet("on /v1/completions, echo with logprobs "
                                           "scores the prompt")] = None
    truncate_prompt_tokens: Annotated[Any, NotYet("no prompt truncation")] = None
    spaces_between_special_tokens: Annotated[Any, NotYet("the detokenizer's spacing is fixed")] = None
    return_token_ids: Annotated[Any, NotYet("return_tokens_as_token_ids with logprobs "
                                            "gives the ids", False)] = None
    request_id: Annotated[Any, NotYet("the gateway names requests")] = None
    cache_salt: Annotated[Any, NotYet("no prefix-cache salts")] = None
    kv_transfer_params: Annotated[Any, NotYet("no external KV transfer")] = None
    vllm_xargs: Annotated[Any, NotYet("no extension arguments")] = None
    mm_processor_kwargs: Annotated[Any, NotYet("text-only models")] = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    """POST /v1/chat/completions."""

    messages: Messages
    max_completion_tokens: Annotated[MaxTokens, Meta(description="Wins over max_tokens.")] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[Logprobs, Meta(description="Needs logprobs: true.")] | None = None
    metadata: dict[str, str] | None = None  # metadata (module docstring)
    safety_identifier: str | None = None  # metadata
    prompt_cache_key: str | None = None  # metadata

    tools: Tools | None = None  # passed to the chat template
    tool_choice: ToolChoice | None = None  # tool_calls.py: forced through the grammar, or parsed
    parallel_tool_calls: bool | None = None  # false: at most one call
    functions: Annotated[Any, NotYet(TOOLS)] = None
    function_call: Annotated[Any, NotYet(TOOLS, "none")] = None
    chat_template: Annotated[Any, NotYet(TEMPLATES)] = None
    chat_template_kwargs: dict[str, Any] | None = None  # the ones the template reads reach it
    add_generation_prompt: Annotated[Any, NotYet(TEMPLATES, True)] = None
    continue_final_message: Annotated[Any, NotYet(TEMPLATES, False)] = None
    documents: Annotated[Any, NotYet(TEMPLATES)] = None
    add_special_tokens: Annotated[Any, NotYet(TEMPLATES, False)] = None  # the template brings its own
    echo: Annotated[Any, NotYet("no echo on chat", False)] = None
    reasoning_effort: Annotated[Any, NotYet("no reasoning models")] = None
    include_reasoning: Annotated[Any, NotYet("no reasoning models")] = None
    verbosity: Annotated[Any, NotYet("no verbosity control")] = None
    modalities: Annotated[Any, NotYet("text-only models", ["text"])] = None
    audio: Annotated[Any, NotYet("text-only models")] = None
    prediction: Annotated[Any, NotYet("no predicted outputs")] = None
    web_search_options: Annotated[Any, NotYet("no web search")] = None
    store: Annotated[Any, NotYet("Rill stores no completions", False)] = None
    service_tier: Annotated[Any, NotYet("one service tier", "auto", "default")] = None


class CompletionRequest(_Sampling, kw_only=True):
    """POST /v1/completions."""

    prompt: Annotated[Text | Annotated[list[TokenId | Text | TokenIds], Meta(min_length=1)],
                      Meta(description="Text, token ids, or a list of one of those.")]
    logprobs: Annotated[Logprobs, Meta(description="Top logprobs per output token (the sampled token's "
                                                   "always).")] | None = None
    echo: Annotated[bool, Meta(description="Prepend the prompt to the text.")] | None = None

    suffix: Annotated[Any, NotYet("no fill-in-the-middle", "")] = None
    best_of: Annotated[Any, NotYet("vLLM V1 dropped it too; use n", 1)] = None
    prompt_embeds: Annotated[Any, NotYet("no prompt embeddings")] = None
    add_special_tokens: Annotated[Any, NotYet("text prompts always get the special tokens", True)] = None


class ChatFrame(ChatCompletionRequest, tag_field="type", tag="chat", kw_only=True):
    """A WebSocket chat frame: the chat body plus `type` and the client's `id`."""

    id: WsId


class CompletionFrame(CompletionRequest, tag_field="type", tag="completion", kw_only=True):
    """A WebSocket completion frame: the completion body plus `type` and the client's `id`."""

    id: WsId


class FrameHead(Struct):
    """What every frame starts with, read first so an error frame can name the request."""

    id: WsId | None = None
    type: str | None = None


class TokenizeBody(_Body):
    """POST /tokenize: a text prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: Annotated[bool, Meta(description="Text prompts only.")] | None = None
    add_generation_prompt: Annotated[bool, Meta(description="Messages only.")] | None = None
    return_token_strs: Annotated[Any, NotYet("no token strings", False)] = None
    continue_final_message: Annotated[Any, NotYet(TEMPLATES, False)] = None
    chat_template: Annotated[Any, NotYet(TEMPLATES)] = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Tools | None = None


class DetokenizeBody(_Body, kw_only=True):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


GenerateBody = ChatCompletionRequest | CompletionRequest
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


def _refuse_not_yet(obj: Struct, path: str) -> None:
    """The first NotYet field (or non-text content part) set in `obj` or the Structs inside it."""
    if isinstance(obj, _InputPart):
        raise APIError(f"{path}: {obj.__struct_config__.tag} content parts are not supported yet ({obj.why}).",
                       400, param=path)
    for name, mark in not_yet_fields(type(obj)):
        if not mark.accepts(getattr(obj, name)):
            raise mark.refusal(f"{path}.{name}" if path else name)
    for name in obj.__struct_fields__:
        value = getattr(obj, name)
        if isinstance(value, Struct):
            _refuse_not_yet(value, f"{path}.{name}" if path else name)
        elif isinstance(value, list) and value and isinstance(value[0], Struct):  # messages, content parts
            for i, item in enumerate(value):
                _refuse_not_yet(item, f"{path}.{name}[{i}]" if path else f"{name}[{i}]")


def _bad(message: str, param: str | None) -> APIError:
    return APIError(message, 400, param=param)


def _check_model(model: str | None, model_name: str) -> None:
    if model is not None and model != model_name:
        raise APIError(f"The model `{model}` does not exist.", 404, type="NotFoundError",
                       param="model", code="model_not_found")


def _check_messages(messages: list[Message]) -> None:
    for i, m in enumerate(messages):
        if m.content is None and not isinstance(m, AssistantMessage):
            raise _bad(f"messages[{i}].content is required for role {m.__struct_config__.tag!r}.",
                       f"messages[{i}].content")


def _check_prompt(prompt: str | list[Any]) -> None:
    # A batch of one ("text" or [ids] in a list) is unwrapped; larger batches need fan-out (not yet).
    if isinstance(prompt, str) or all(type(t) is int for t in prompt):
        return
    if any(type(t) is int for t in prompt):
        raise _bad("prompt must be a string, a list of token ids, or a list of one of those.", "prompt")
    if len(prompt) > 1:
        raise _bad("Batched prompts are not supported yet; send one prompt per request.", "prompt")


def max_tokens_of(req: GenerateBody) -> tuple[str, int | None]:
    """(the field that sets the output limit, its value): max_completion_tokens wins, as in OpenAI."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return "max_completion_tokens", req.max_completion_tokens
    return "max_tokens", req.max_tokens


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
    if req.min_tokens is not None and max_tokens is not None and req.min_tokens > max_tokens:
        raise _bad(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {req.min_tokens}.",
                   "min_tokens")
    name, n = logprobs_of(req)
    if n is not None and n > max_logprobs:
        raise _bad(f"Requested sample logprobs of {n}, which is greater than max allowed: {max_logprobs}.", name)
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options is only allowed when stream is true.", "stream_options")


def _check_tools(req: ChatCompletionRequest) -> None:
    if not req.tools:  # as OpenAI: a choice among no tools is a mistake ("none" asks for nothing)
        for name in ("tool_choice", "parallel_tool_calls"):
            if getattr(req, name) not in (None, "none"):
                raise _bad(f"{name} is only allowed when tools are given.", name)
        return
    choice = tool_choice_name(req.tool_choice, req.tools)
    if choice not in ("none", "auto", "required") and all(t.function.name != choice for t in req.tools):
        raise _bad(f"tool_choice names {choice!r}, which is not among the tools.", "tool_choice")


def _check_size(req: GenerateBody, max_model_len: int) -> None:
    """Prompts that cannot fit the context whatever their tokens, refused before a tokenizer
    spends time on them: more ids than the context, or more characters than MAX_TOKEN_CHARS
    per token of it (no tokenizer's token is that long; the tokenizer checks the rest exactly)."""
    if max_model_len <= 0:
        return
    if isinstance(req, CompletionRequest):
        prompt = prompt_of(req.prompt)
        size, param = len(prompt), "prompt"
        unit, limit = ("token ids", max_model_len) if isinstance(prompt, list) else \
            ("characters", max_model_len * MAX_TOKEN_CHARS)
    else:
        size, param = sum(len(_text(m.content)) for m in req.messages), "messages"
        unit, limit = "characters", max_model_len * MAX_TOKEN_CHARS
    if size > limit:
        raise _bad(f"This model's maximum context length is {max_model_len} tokens; the {param} "
                   f"({size} {unit}) cannot fit in it.", param)


def _check_frame(req: GenerateBody) -> None:
    # Frames always stream, with usage in the done frame; these would change the text sent.
    for name in ("echo", "return_tokens_as_token_ids"):
        if getattr(req, name, None):
            raise _bad(f"{name} is not supported over the WebSocket yet.", name)


def _check_tokenize(req: TokenizeBody) -> None:
    if req.prompt is None and req.messages is None:
        raise _bad("prompt (a string) or messages is required.", "prompt")
    if req.prompt is not None and req.messages is not None:
        raise _bad("Give prompt or messages, not both.", "prompt")
    if req.messages is not None and req.add_special_tokens:
        raise _bad("add_special_tokens is not supported yet with messages (the chat template brings its own).",
                   "add_special_tokens")
    if req.prompt is not None and req.add_generation_prompt is not None:
        raise _bad("add_generation_prompt applies to messages only.", "add_generation_prompt")
    for name in ("tools", "chat_template_kwargs"):  # they reach the chat template, which text skips
        if req.prompt is not None and getattr(req, name) is not None:
            raise _bad(f"{name} applies to messages only.", name)


def check(req: Struct, gate: Admission) -> None:
    """The rules no single field can state; each raises a 400 (404 for the model) naming its field."""
    _check_model(getattr(req, "model", None), gate.model_name)
    _refuse_not_yet(req, "")
    if isinstance(req, ChatCompletionRequest):
        _check_messages(req.messages)
        _check_tools(req)
    elif isinstance(req, CompletionRequest):
        _check_prompt(req.prompt)
    elif isinstance(req, TokenizeBody):
        _check_tokenize(req)
        if req.messages is not None:
            _check_messages(req.messages)
    if isinstance(req, (ChatCompletionRequest, CompletionRequest)):
        _check_sampling(req, gate.max_logprobs)
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
                        tool_call_id=getattr(m, "tool_call_id", None)) for m in messages]


def prompt_of(prompt: str | list[Any]) -> str | list[int]:
    if isinstance(prompt, list) and not isinstance(prompt[0], int):
        return prompt[0]  # a batch of one (check refused larger ones)
    return prompt


def sampling_params(req: GenerateBody) -> SamplingParams:
    kw: dict[str, Any] = {name: getattr(req, name) for name in (
        "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
        "min_tokens", "n", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
        if getattr(req, name) is not None}
    kw["max_tokens"] = max_tokens_of(req)[1]
    kw["logprobs"] = logprobs_of(req)[1]
    if req.top_k is not None:
        kw["top_k"] = max(req.top_k, 0)  # -1 and 0 both disable
    stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
    kw["stop"] = [s for s in stop if s]  # an empty stop string would end every request at once
    kw["stop_token_ids"] = req.stop_token_ids or []
    kw["logit_bias"] = req.logit_bias or {}
    kw["grammar"] = grammar_of(req)
    if isinstance(req, CompletionRequest) and req.echo and kw["logprobs"] is not None:
        kw["prompt_logprobs"] = kw["logprobs"]  # echo scores the prompt's tokens too
    return SamplingParams(**kw)


def kind_of(req: GenerateBody) -> str:
    return "chat" if isinstance(req, ChatCompletionRequest) else "completion"


def generate_request(req: GenerateBody, request_id: str, reply_to: str) -> GenerateRequest:
    """The checked body as the message the tokenizer consumes."""
    chat = isinstance(req, ChatCompletionRequest)
    return GenerateRequest(request_id=request_id, reply_to=reply_to, kind=kind_of(req),
                           params=sampling_params(req), arrival_time=time.time(),
                           messages=chat_messages(req.messages) if chat else None,
                           prompt=None if chat else prompt_of(req.prompt), priority=req.priority or 0,
                           tools=tool_definitions(req.tools) if chat else None,
                           chat_template_kwargs=(req.chat_template_kwargs or {}) if chat else {})
