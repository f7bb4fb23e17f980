"""The OpenAI request bodies as typed msgspec Structs: the one home of every request rule.

Each field's type and range is declared once, on the field (a `Meta` constraint); msgspec checks
them while it decodes the raw body, and /openapi.json is generated from the same Structs
(openapi_spec.py). The rules that span fields or depend on this gateway (the model name,
--max-logprobs) live in requests.py's `check`. Downstream services may assert what is
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
from typing import Annotated, Any, ClassVar, Literal

from msgspec import Meta, Struct

from rill.services.gateway.chat_tools import (
    FunctionTool,
    ToolCall,
    ToolChoice,
)
from rill.services.gateway.fields import Body as _Body
from rill.services.gateway.fields import NotYet
from rill.services.gateway.structured import ResponseFormat, StructuredOutputs

log = logging.getLogger("rill.gateway.requests")

INT64_MAX = 2**63 - 1
MAX_TOKEN_ID = 2**31 - 1
MAX_STOP = 16
# A request's stop strings ride with each of its rows to the detokenizer every step (any replica
# may decode any row); these bounds keep that, and the worker's min_tokens bans, small.
MAX_STOP_LEN = 256
MAX_STOP_TOKEN_IDS = 128
MAX_SALT_LEN = 1024  # a cache_salt rides in the request's parameters to the engine
MAX_TOKEN_CHARS = 256  # longer than any vocabulary's longest token (SmolLM2's: 81 characters)
MAX_N = 128  # OpenAI's bound on parallel samples
MAX_LOGIT_BIAS = 1024
MAX_REPETITION_PENALTY = 100.0
DEFAULT_MAX_LOGPROBS = 20  # --max-logprobs, as in vLLM
MAX_WS_ID_LEN = 128
MAX_SUFFIX_CHARS = 1 << 20  # completions' suffix: tokenized whole, so bounded before it reaches a tokenizer
MAX_PREDICTION_CHARS = 1 << 20  # likewise a prediction's text (its parts together)
MAX_TEMPLATE_CHARS = 64 * 1024  # a request's chat_template (models' own: a few to ~20 KB)
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
RequestTemplate = Annotated[str, Meta(min_length=1, max_length=MAX_TEMPLATE_CHARS, description=(
    "vLLM's: a Jinja chat template used instead of the server's; only where it was started with "
    "--trust-request-chat-template."))]


FUNCTIONS = "the legacy functions API is not supported; use tools and tool_choice"
BEAM_FRAMES = "beam search answers with whole sequences: use HTTP"
GENERATION_PROMPT = "Open the assistant's turn after the messages (default: true, unless continue_final_message)."
CONTINUE = ("End the prompt inside the final message, with no end of turn, so the output goes on with it (an "
            "assistant reply the client began); not with add_generation_prompt: true. A grammar "
            "(response_format, structured_outputs, a forced tool) shapes the continuation only.")


# ---------------------------------------------------------------------------------------------
# Chat messages


class TextPart(_Body, tag_field="type", tag="text"):
    text: str


class UnreadPart(Struct, tag_field="type"):
    """A non-text content part: recognised so that the 400 can say so, never read."""

    why: ClassVar[str] = "Rill serves text-only models"


class ImageURLPart(UnreadPart, tag="image_url"):
    pass


class InputAudioPart(UnreadPart, tag="input_audio"):
    pass


class FilePart(UnreadPart, tag="file"):
    pass


class RefusalPart(UnreadPart, tag="refusal"):
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
    reasoning_content: str | None = None  # what a thinking model reasoned: passed to the chat template
    function_call: Annotated[Any, NotYet(FUNCTIONS)] = None
    refusal: Annotated[Any, NotYet("no refusal turns in the chat template")] = None
    audio: Annotated[Any, NotYet("text-only models")] = None


class ToolMessage(_Message, tag="tool", kw_only=True):
    tool_call_id: str  # required, as in OpenAI


Message = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage
Messages = Annotated[list[Message], Meta(min_length=1)]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]  # OpenAI's


class StreamOptions(_Body):
    include_usage: bool | None = None
    continuous_usage_stats: Annotated[bool, Meta(description="vLLM's: every chunk carries the usage so far "
                                                             "(with include_usage).")] | None = None


class Prediction(_Body, tag_field="type", tag="content"):
    """OpenAI's predicted outputs: text the output is expected to be, mostly (a file being edited)."""

    content: str | Annotated[list[TextPart], Meta(min_length=1)]

    def __post_init__(self) -> None:
        if len(self.text) > MAX_PREDICTION_CHARS:  # text or parts: tokenized whole
            raise ValueError(f"longer than {MAX_PREDICTION_CHARS} characters")

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


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
    bad_words: Annotated[list[Annotated[str, Meta(min_length=1, max_length=MAX_STOP_LEN)]], Meta(
        max_length=MAX_STOP_TOKEN_IDS, description=(
            "Words never to generate (vLLM's): the token that would complete one, as text opens with it or "
            "after a space, is banned; not with structured outputs or allowed_token_ids."))] | None = None
    allowed_token_ids: Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_LOGIT_BIAS, description=(
        "Only these tokens may be sampled (EOS too only if listed); not with structured outputs or "
        "bad_words."))] | None = None
    logits_processors: Annotated[Any, NotYet("no custom logits processors")] = None
    use_beam_search: Annotated[bool, Meta(description=(
        "vLLM's: the n likeliest sequences by beam search of width n (beam_search.py), not streamed; "
        "with no sampling fields."))] | None = None
    length_penalty: Annotated[float, Meta(ge=-10.0, le=10.0, description=(
        "Beam search's: a sequence scores its cumulative logprob / length ** length_penalty."))] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, description=(
        "vLLM's: per prompt token (the first: null), by token id, its logprob, rank (1: likeliest) and "
        "text, and the k likeliest tokens' likewise. Not with stream."))] | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, description=(
        "Keep only the prompt's last k tokens (the chat template's output for chat); -1: as many as the "
        "context holds. Not with echo."))] | None = None
    spaces_between_special_tokens: Annotated[bool, Meta(description=(
        "As vLLM takes it with a fast tokenizer (Rill's kind): no spaces are added between special tokens, "
        "whatever the value."))] | None = None
    return_token_ids: Annotated[bool, Meta(description=(
        "The prompt's and the output's token ids in the response (vLLM's prompt_token_ids and token_ids); "
        "streamed: each chunk's ids, the prompt's in the first."))] | None = None
    request_id: Annotated[Any, NotYet("the gateway names requests")] = None
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_SALT_LEN, description=(
        "Prefix-cache isolation: the prompt's cached blocks are shared only with requests that send the "
        "same salt (e.g. one per tenant), so cache timing tells nothing across salts."))] | None = None
    prediction: Annotated[Prediction, Meta(description=(
        "OpenAI's predicted outputs, on completions too: drafts from this text are verified as the output is "
        "decoded (speculative decoding), so the output is as without it (GGUF: where decode rows are pinned, "
        "logged at start, or under RILL_BATCH_INVARIANT), "
        "only sooner where it matches; usage counts the accepted and rejected ones."))] | None = None
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
    functions: Annotated[Any, NotYet(FUNCTIONS)] = None
    function_call: Annotated[Any, NotYet(FUNCTIONS, "none")] = None
    chat_template: RequestTemplate | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # the ones the template reads reach it
    add_generation_prompt: Annotated[bool, Meta(description=GENERATION_PROMPT)] | None = None
    continue_final_message: Annotated[bool, Meta(description=CONTINUE)] | None = None
    documents: Annotated[list[dict[str, str]], Meta(description=(
        "For a chat template that reads them (retrieval-augmented generation): typically each with a title and "
        "a text. A template that reads none: 400."))] | None = None
    add_special_tokens: Annotated[bool, Meta(description=(
        "Also add the tokenizer's special tokens (e.g. BOS) to what the chat template writes (default: "
        "false, the template brings its own)."))] | None = None
    echo: Annotated[bool, Meta(description=(
        "The reply opens with the final message's text when the reply is in its role: an assistant message "
        "continued (continue_final_message), or any final message with add_generation_prompt false (as vLLM)."))
    ] | None = None
    reasoning_effort: Annotated[ReasoningEffort, Meta(description=(
        "For a chat template that reads it (gpt-oss's). A template that reads none: 400; a template's own "
        "switch (Qwen3's enable_thinking) goes in chat_template_kwargs."))] | None = None
    include_reasoning: bool | None = None  # reasoning.py: false leaves reasoning_content out
    verbosity: Annotated[Any, NotYet("no verbosity control")] = None
    modalities: Annotated[Any, NotYet("text-only models", ["text"])] = None
    audio: Annotated[Any, NotYet("text-only models")] = None
    web_search_options: Annotated[Any, NotYet("no web search")] = None
    store: Annotated[Any, NotYet("Rill stores no completions", False)] = None
    service_tier: Annotated[Any, NotYet("one service tier", "auto", "default")] = None


class CompletionRequest(_Sampling, kw_only=True):
    """POST /v1/completions."""

    prompt: Annotated[Text | Annotated[list[TokenId | Text | TokenIds], Meta(min_length=1)],
                      Meta(description="Text, token ids, or a batch: a list of either (a request each).")]
    logprobs: Annotated[Logprobs, Meta(description="Top logprobs per output token (the sampled token's "
                                                   "always).")] | None = None
    echo: Annotated[bool, Meta(description="Prepend the prompt to the text.")] | None = None
    max_tokens: Annotated[int, Meta(ge=0, le=INT64_MAX, description="As on chat; 0 with echo scores the prompt "
                                                                    "and generates nothing.")] | None = None

    suffix: Annotated[str, Meta(max_length=MAX_SUFFIX_CHARS, description=(
        "Fill in the middle: the text generated goes between the prompt and this, in the model's FIM "
        "format (<fim_prefix>... or <|fim_prefix|>...); a model without FIM tokens refuses it. Empty: "
        "none."))] | None = None
    best_of: Annotated[Any, NotYet("vLLM V1 dropped it too; use n", 1)] = None
    prompt_embeds: Annotated[Any, NotYet("no prompt embeddings")] = None
    add_special_tokens: Annotated[bool, Meta(description=(
        "Add the tokenizer's special tokens (e.g. BOS) to a text prompt (default: true); token ids are "
        "used as given."))] | None = None


class ChatFrame(ChatCompletionRequest, tag_field="type", tag="chat", kw_only=True):
    """A WebSocket chat frame: the chat body plus `type` and the client's `id`."""

    id: WsId
    use_beam_search: Annotated[Any, NotYet(BEAM_FRAMES, False)] = None
    length_penalty: Annotated[Any, NotYet(BEAM_FRAMES, 1.0)] = None


class CompletionFrame(CompletionRequest, tag_field="type", tag="completion", kw_only=True):
    """A WebSocket completion frame: the completion body plus `type` and the client's `id`."""

    id: WsId
    use_beam_search: Annotated[Any, NotYet(BEAM_FRAMES, False)] = None
    length_penalty: Annotated[Any, NotYet(BEAM_FRAMES, 1.0)] = None


class FrameHead(Struct):
    """What every frame starts with, read first so an error frame can name the request."""

    id: WsId | None = None
    type: str | None = None


class TokenizeBody(_Body):
    """POST /tokenize: a text prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: Annotated[bool, Meta(description=(
        "Add the tokenizer's special tokens (e.g. BOS): a text prompt's default true, messages' false (the "
        "chat template brings its own)."))] | None = None
    add_generation_prompt: Annotated[bool, Meta(description=f"Messages only. {GENERATION_PROMPT}")] | None = None
    return_token_strs: Annotated[Any, NotYet("no token strings", False)] = None
    continue_final_message: Annotated[bool, Meta(description=f"Messages only. {CONTINUE}")] | None = None
    chat_template: RequestTemplate | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Tools | None = None


class DetokenizeBody(_Body, kw_only=True):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


GenerateBody = ChatCompletionRequest | CompletionRequest
