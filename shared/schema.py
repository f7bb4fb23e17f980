"""Every message that crosses the broker. This module is the contract between services.

Hot-path messages (StepPlan, StepResult, DetokBatch, ReplyBatch) are one message per
destination per step, with columnar fields, so broker cost does not grow per token.
Messages sharing a stream are members of a tagged union so a reader decodes them in one call.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from rill.shared.kinds import AbortReason, EngineRole, FinishReason, HandoffStatus, RequestKind
from rill.shared.request_params import ChatMessage, SamplingParams

# ---------------------------------------------------------------------------------------------
# Request level (what a request asks for, its parameters and chat turns: request_params.py)


class GenerateRequest(Struct, tag_field="_t", tag="generate", omit_defaults=True):
    """Gateway -> tokenizer: raw text in, before templating and tokenization."""

    request_id: str
    reply_to: str  # the gateway's reply stream
    kind: RequestKind
    params: SamplingParams
    arrival_time: float
    messages: list[ChatMessage] | None = None
    prompt: str | list[int] | None = None
    priority: int = 0  # with --scheduling-policy priority: lower runs first
    tools: list[dict[str, Any]] | None = None  # OpenAI tool definitions, for the chat template
    chat_template_kwargs: dict[str, Any] = {}  # the body's, and its documents
    add_generation_prompt: bool = True  # the template's opening of the assistant's turn
    continue_final_message: bool = False  # the prompt ends inside the final message: the output goes on with it
    add_special_tokens: bool | None = None  # None: a text prompt's yes, a chat template's no (as vLLM)
    suffix: str | None = None  # completions: the text after the one to fill in (the model's FIM tokens)
    avoid_engine: int = -1  # sent again after this engine lost it: elsewhere while another runs


class TokenizedRequest(Struct, tag_field="_t", tag="tokenized", omit_defaults=True):
    """Tokenizer -> scheduler: everything the engine needs to run the request."""

    request_id: str
    reply_to: str
    prompt_token_ids: list[int]
    params: SamplingParams  # max_tokens None: the rest of the context the engine serves (chat's default)
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0


class AbortRequest(Struct, tag_field="_t", tag="abort", omit_defaults=True):
    """Anyone -> scheduler: drop these requests, whole or one sample each (request_params.sample_request_id),
    and free their blocks (idempotent)."""

    request_ids: list[str]
    reason: AbortReason = "abort"


class TokenizeRequest(Struct, tag_field="_t", tag="tokenize", omit_defaults=True):
    """Gateway -> tokenizer (/tokenize): text or chat messages to token ids, nothing generated."""

    request_id: str
    reply_to: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # as GenerateRequest's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] = {}


class DetokenizeRequest(Struct, tag_field="_t", tag="detokenize", omit_defaults=True):
    """Gateway -> tokenizer (/detokenize, and echo of a token-id prompt)."""

    request_id: str
    reply_to: str
    token_ids: list[int]


# ---------------------------------------------------------------------------------------------
# Prefill/decode disaggregation: a prefill engine hands a request and its KV to a decode engine


class KVManifest(Struct, omit_defaults=True):
    """One exported KV payload: a request's blocks from every layer, as one array of `shape`
    [layers, 2 (K, V), blocks, block_size, kv_heads, head_dim] in `dtype`, cut into chunks that
    each carry a checksum. `transport` names the KVTransport that stored it (and can fetch it)."""

    transfer_id: str
    transport: str = "redis"
    num_tokens: int = 0  # leading positions whose KV is valid
    block_size: int = 0
    dtype: str = ""
    shape: list[int] = []
    chunk_bytes: list[int] = []
    checksums: list[str] = []  # blake2b-128 of each chunk, hex
    nbytes: int = 0
    export_ms: float = 0.0
    error: str | None = None  # the export failed; the prefill engine still holds the blocks


class KVHandoff(Struct, tag_field="_t", tag="kv_handoff", omit_defaults=True):
    """Prefill engine -> decode engine: continue this request; the KV of its first
    `num_computed_tokens` tokens is in `manifest`. The decode engine allocates its own blocks,
    has its worker import the KV, then decodes; it answers with a KVTransferAck."""

    request_id: str  # engine-side (sample) id
    group_id: str  # the client's request id (error replies and aborts use it)
    reply_to: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # sampled on the prefill engine (the first token, normally)
    params: SamplingParams  # this sample's (n = 1)
    eos_token_ids: list[int]  # every id that stops it (stop_token_ids included, eos unless ignored)
    max_tokens: int
    arrival_time: float
    num_computed_tokens: int
    source_engine: int
    manifest: KVManifest
    priority: int = 0
    attempt: int = 1
    first_token_at: float = 0.0  # wall clock when the prefill engine sampled the last output token


class KVTransferAck(Struct, tag_field="_t", tag="kv_ack", omit_defaults=True):
    """Decode engine -> prefill engine: what became of a hand-off. "ok": the KV is imported and the request
    decodes there (the prefill engine frees its blocks); "aborted": it ended on the decode engine (cancelled,
    or failed with its own error reply); "failed": the import failed (`retryable`: a new export may work)."""

    transfer_id: str
    request_id: str
    decode_engine: int
    status: HandoffStatus
    error: str = ""
    retryable: bool = False


TokenizerInput = GenerateRequest | TokenizeRequest | DetokenizeRequest
EngineInput = TokenizedRequest | AbortRequest | KVHandoff | KVTransferAck

# ---------------------------------------------------------------------------------------------
# Scheduler <-> worker, once per step


class NewRequestData(Struct, array_like=True, omit_defaults=True):
    """Sent the first time a request is scheduled (and again when it resumes after preemption)."""

    request_id: str
    token_ids: list[int]  # prompt (+ tokens already generated, when resuming)
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int = 0  # tokens whose KV is already in the blocks (prefix-cache hit)
    num_output_tokens: int = 0  # of token_ids, how many are outputs (for seeded sampling)


class KVExport(Struct, array_like=True):
    """Export the KV of these blocks (the first `num_tokens` positions of a request)."""

    transfer_id: str
    block_ids: list[int]
    num_tokens: int


class KVImport(Struct, array_like=True):
    """Fetch a transfer and write it into these (freshly allocated) blocks."""

    manifest: KVManifest
    block_ids: list[int]


class KVImportResult(Struct, array_like=True, omit_defaults=True):
    transfer_id: str
    error: str | None = None
    retryable: bool = False
    nbytes: int = 0
    import_ms: float = 0.0


class StepPlan(Struct, tag_field="_t", tag="plan", array_like=True, omit_defaults=True):
    """Scheduler -> worker: one fused step. Running requests come as columnar diffs."""

    step_id: int
    new_requests: list[NewRequestData]
    # Cached (already known to the worker) requests scheduled this step, columnar.
    cached_request_ids: list[str]
    cached_new_block_ids: list[list[int]]  # blocks appended to each block table this step
    # Every scheduled request in batch order (new ones included) and how many tokens it runs.
    scheduled_request_ids: list[str]
    num_scheduled_tokens: list[int]
    # Requests the worker must forget (finished, aborted or preempted).
    finished_request_ids: list[str] = []
    # Disaggregation: KV to export (prefill engine) or import (decode engine) after the step.
    kv_exports: list[KVExport] = []
    kv_imports: list[KVImport] = []
    # Speculative decoding: drafts each scheduled request verifies after its last token (empty when
    # none has any); DRAFT_PLACEHOLDER drafts are the worker's draft model's to propose.
    spec_token_ids: list[list[int]] = []

    def num_drafts(self) -> list[int]:
        """Draft tokens each scheduled request verifies, aligned with scheduled_request_ids."""
        return [len(d) for d in self.spec_token_ids] or [0] * len(self.scheduled_request_ids)


DRAFT_PLACEHOLDER = -1


class Hello(Struct, tag_field="_t", tag="hello", array_like=True):
    """Scheduler -> worker at start: forget all request state and announce yourself again (with
    the worker's unsolicited WorkerReady at its own start, the handshake works whichever starts first)."""

    scheduler_id: str


class Shutdown(Struct, tag_field="_t", tag="shutdown", array_like=True):
    reason: str = ""


WorkerInput = StepPlan | Hello | Shutdown


class WorkerReady(Struct, tag_field="_t", tag="ready", array_like=True, omit_defaults=True):
    """Worker -> scheduler at start: the worker sized the KV cache, so it owns these numbers."""

    worker_id: str
    num_blocks: int
    block_size: int
    max_model_len: int
    dtype: str
    device: str
    quantization: str = "none"  # of the linear layers ("int8": W8A8); the KV cache stays in `dtype`
    sliding_window: int = 0  # every layer's window when all slide (0: none): blocks behind it are released
    max_num_batched_tokens: int = 0  # its step budget, measured (worker/step_budget.py) or given; 0: default
    step_cost: list[float] = []  # its prompt steps' cost (StepCost: worker/step_budget.py); [] unmeasured
    # The most rows of a decode step whose rows all get the bits they would alone (0: no such bound).
    agreeing_rows: int = 0


class TokenLogprobs(Struct, array_like=True):
    """Log-probabilities (log_softmax of the model's raw logits) around one sampled token:
    index 0 is the sampled token, then the `logprobs` most likely tokens, most likely first."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int = 0  # token_ids[0]'s in the vocabulary (1: likeliest): prompt tokens', else 0


class StepResult(Struct, tag_field="_t", tag="result", array_like=True, omit_defaults=True):
    """Worker -> scheduler: sampled tokens of the requests that finished their prompt."""

    step_id: int
    request_ids: list[str]
    token_ids: list[int]
    forward_ms: float = 0.0
    error: str | None = None  # a failed step; the scheduler fails the step's requests
    # Aligned with token_ids when any sampled row asked for logprobs (None for others); else empty.
    logprobs: list[TokenLogprobs | None] = []
    kv_exports: list[KVManifest] = []  # one per KVExport / KVImport of the plan, in any order
    kv_imports: list[KVImportResult] = []
    # With the first output token of a request that asked for prompt_logprobs: one entry per
    # prompt token (the first has no logprobs), aligned with request_ids; empty when none did.
    prompt_logprobs: list[list[TokenLogprobs]] = []
    errors: dict[str, str] = {}  # requests that failed on their own (not in request_ids): id -> why
    # Speculative decoding: tokens (and logprobs) each request got, its accepted drafts + 1; empty: one each.
    num_tokens: list[int] = []


WorkerOutput = WorkerReady | StepResult

# ---------------------------------------------------------------------------------------------
# Scheduler -> detokenizer -> gateway, once per step


class DetokBatch(Struct, tag_field="_t", tag="detok", array_like=True, omit_defaults=True):
    """New output tokens of every request that produced some this step, columnar. Each row carries its
    own decode context (the output tokens before `offsets[i]`, up to a window), so any detokenizer
    replica can decode it without memory of earlier messages."""

    engine_id: int
    step_id: int
    request_ids: list[str]
    reply_to: list[str]
    offsets: list[int]  # index in the output of the first new token
    new_token_ids: list[list[int]]
    context_ids: list[list[int]]
    finish_reasons: list[FinishReason | None]
    prompt_tokens: list[int]
    stop: list[list[str]]
    skip_special_tokens: list[bool]
    include_stop_str: list[bool]
    # Per row, one entry per new token (empty for rows without logprobs); empty when no row has any.
    logprobs: list[list[TokenLogprobs]] = []
    # Per row, with its first output token only (empty when no row has any): its prompt's logprobs,
    # and the prompt tokens the prefix cache held.
    prompt_logprobs: list[list[TokenLogprobs]] = []
    cached_tokens: list[int] = []
    # Per row: None unless it asked for token ids, then its prompt's with its first token, else [].
    prompt_ids: list[list[int] | None] = []
    # Per row of a request with a prediction: [accepted, rejected] of its drafts from it so far; else [].
    prediction_tokens: list[list[int]] = []


class TopLogprob(Struct, array_like=True):
    token: str  # the token decoded on its own
    logprob: float
    token_id: int


class TextLogprob(Struct, array_like=True):
    """A token, its logprob and the likeliest alternatives there (a prompt's first: None, none)."""

    token: str
    logprob: float | None
    token_id: int
    top: list[TopLogprob]
    rank: int = 0  # as TokenLogprobs'


class TextDelta(Struct, array_like=True, omit_defaults=True):
    request_id: str
    offset: int  # token offset of this delta; the gateway applies offsets in order, once
    num_tokens: int
    text: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TextLogprob] = []  # one per token of this delta, when the request asked
    prompt_logprobs: list[TextLogprob] = []  # with the first delta, when the request asked
    cached_tokens: int = 0  # with the first delta: prompt tokens the prefix cache held
    token_ids: list[int] = []  # this delta's tokens, when the request asked (return_token_ids)
    prompt_token_ids: list[int] = []  # with the first delta, when it asked
    prediction_tokens: list[int] = []  # a request with a prediction: [accepted, rejected] drafts so far


class ReplyBatch(Struct, tag_field="_t", tag="reply", array_like=True):
    """Detokenizer -> one gateway: every delta for that gateway from one step."""

    deltas: list[TextDelta]


# A 503 ErrorReply starting so: its engine was lost (a gateway resends a request that released nothing).
ENGINE_LOST_PREFIX = "the engine is not available"


class ErrorReply(Struct, tag_field="_t", tag="error", array_like=True, omit_defaults=True):
    """Any service -> gateway: the request failed; the message is shown to the client."""

    request_id: str
    message: str
    status: int = 400
    type: str = "invalid_request_error"
    param: str | None = None

    @classmethod
    def of(cls, request_id: str, message: str, status: int) -> ErrorReply:  # the type the status implies
        return cls(request_id, message, status, "server_error" if status >= 500 else "invalid_request_error")


class TokenizeReply(Struct, tag_field="_t", tag="tokenized_text", array_like=True, omit_defaults=True):
    """Tokenizer -> gateway: the answer to a TokenizeRequest or a DetokenizeRequest."""

    request_id: str
    token_ids: list[int] = []
    text: str = ""


class Routed(Struct, tag_field="_t", tag="routed", array_like=True):
    """Tokenizer -> gateway: the engine a request was sent to, so that the gateway fails it at once if
    that engine dies while others live. Not sent for a prefill engine (disagg.py watches its hand-off)."""

    request_id: str
    engine: int


GatewayInput = ReplyBatch | ErrorReply | TokenizeReply | Routed

# ---------------------------------------------------------------------------------------------
# Observability


class EngineStats(Struct, omit_defaults=True):
    """Written by the scheduler to a key after every step; read by the gateway and tests."""

    engine_id: int
    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    block_size: int = 0
    max_model_len: int = 0  # the context it serves (the model's, or what its KV cache holds)
    steps: int = 0
    mixed_steps: int = 0  # steps that ran prefill and decode tokens together
    prefill_tokens: int = 0
    decode_tokens: int = 0
    max_step_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    last_step_tokens: int = 0
    preemptions: int = 0
    kv_usage: float = 0.0  # fraction of blocks owned by requests
    num_cached_blocks: int = 0  # unowned blocks still holding reusable prefix-cache data
    released_blocks: int = 0  # blocks given back from behind a sliding window, ever
    prefix_cache_queries: int = 0  # prompt tokens looked up by a request's first lookup
    prefix_cache_hits: int = 0  # of those, tokens found; a preempted request's lookups again apart:
    prefix_cache_preempted_queries: int = 0
    prefix_cache_preempted_hits: int = 0
    updated_at: float = 0.0
    # Queue time (first schedule - gateway arrival), cumulative: counts[i] requests waited <= bounds[i],
    # the last count (past the bounds) the total; the gateway's rill:request_queue_time_seconds.
    queue_time_bounds: list[float] = []
    queue_time_counts: list[int] = []
    queue_time_sum: float = 0.0
    # Prefill/decode disaggregation (services/scheduler/disagg.py): role, requests whose KV is on its
    # way, totals. Sent: hand-offs acked (seconds: first token sampled -> ack, the blocks held);
    # received: imports done (seconds: first token sampled there -> in this batch, wall clocks).
    role: EngineRole = "both"
    num_transferring: int = 0
    kv_transfers_sent: int = 0
    kv_transfers_received: int = 0
    kv_transfer_failures: int = 0
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0
    kv_transfer_seconds_sum: float = 0.0
    kv_export_seconds_sum: float = 0.0
    kv_import_seconds_sum: float = 0.0
    kv_handoff_seconds_sum: float = 0.0
    # Speculative decoding: steps that verified drafts, draft tokens proposed, of those accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


# Codecs: one encoder/decoder per union, built once per process. -------------------------------
_encoder = msgspec.msgpack.Encoder()


def encode(msg: Struct) -> bytes:
    return _encoder.encode(msg)


engine_input_decoder = msgspec.msgpack.Decoder(EngineInput)
worker_input_decoder = msgspec.msgpack.Decoder(WorkerInput)
worker_output_decoder = msgspec.msgpack.Decoder(WorkerOutput)
detok_decoder = msgspec.msgpack.Decoder(DetokBatch)
gateway_input_decoder = msgspec.msgpack.Decoder(GatewayInput)
generate_decoder = msgspec.msgpack.Decoder(GenerateRequest)
tokenizer_input_decoder = msgspec.msgpack.Decoder(TokenizerInput)
stats_decoder = msgspec.msgpack.Decoder(EngineStats)
