"""What a request asks for, as the request messages carry it: its sampling parameters, its chat
turns, and the engine-side id of each of its samples. schema.py holds the messages themselves.
"""

from __future__ import annotations

from msgspec import Struct

from rill.shared.kinds import ChatRole


class SamplingParams(Struct, omit_defaults=True, frozen=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    max_tokens: int | None = None  # None: fill the context (chat): the engine's own (scheduler/request.py)
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1  # parallel samples; they share the prompt's KV blocks
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # CTRL/HF: divides positive (multiplies negative) logits of
    #                                  tokens in the prompt or the output
    logit_bias: dict[int, float] = {}  # token id -> added to its logit
    allowed_token_ids: list[int] = []  # when set, every other token is masked (vLLM's)
    bad_words: list[str] = []  # vLLM's: words never to generate; the tokenizer turns them into bad_word_ids
    bad_word_ids: list[list[int]] = []  # each a word's ids: its last is banned right after the others
    logprobs: int | None = None  # per output token: the sampled token's logprob and this many top ones
    prompt_logprobs: int | None = None  # per prompt token likewise (prompt_logprobs; completions' echo + logprobs)
    # Structured outputs: an llguidance grammar (services/gateway/structured.py builds and checks
    # it); the worker masks every sampled token with it, EOS included.
    grammar: str | None = None
    cache_salt: str | None = None  # prefix-cache isolation: blocks are shared only under the same salt
    return_token_ids: bool = False  # the prompt's and the output's token ids in the response
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: the context's); the tokenizer's
    # OpenAI's predicted outputs: the text the output is expected to be, mostly; the tokenizer turns it
    # into prediction_ids, from which the scheduler drafts (speculation.py). A hint: output is unchanged.
    prediction: str | None = None
    prediction_ids: list[int] = []

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling reads the request's token history (repetition/frequency/presence)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


# Chat request fields that reach the chat template as variables of these names: a template that
# reads none of one refuses it (services/tokenizer/service.py) rather than drop it.
TEMPLATE_FIELDS = ("documents", "reasoning_effort")


def past_the_context(max_model_len: int, prompt_len: int, max_tokens: int | None = None) -> str:
    """OpenAI's words for a request longer than the context: the prompt alone (no max_tokens), or
    with its completion. The tokenizer says them of the model's context, an engine of its own."""
    head = f"This model's maximum context length is {max_model_len} tokens. However, "
    if max_tokens is None:
        return head + (f"your prompt has {prompt_len} tokens, leaving no room for the completion. "
                       "Please shorten the prompt.")
    return head + (f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                   "in the completion). Please reduce the length of the prompt or completion.")


def sample_request_id(request_id: str, index: int, n: int) -> str:
    """The engine-side id of sample `index` of a request with `n` samples (the id itself when n=1)."""
    return request_id if n == 1 else f"{request_id}:{index}"


class ChatToolCall(Struct, omit_defaults=True):
    """A function call of an earlier assistant turn, as the client sends it back in the history."""

    id: str
    name: str
    arguments: str = ""  # JSON text, as OpenAI sends it (the tokenizer parses it for the template)
    type: str = "function"


class ChatMessage(Struct, omit_defaults=True):
    role: ChatRole
    content: str
    name: str | None = None
    tool_calls: list[ChatToolCall] = []  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this result answers
    reasoning_content: str | None = None  # assistant turns of a thinking model (Qwen3's template reads it)
