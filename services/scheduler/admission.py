"""Admission: why a tokenized request can never run on this engine, checked before it is queued."""

from __future__ import annotations

from rill.services.scheduler.kv_cache_manager import KVCacheManager
from rill.services.scheduler.request import Refusal, resolved_max_tokens
from rill.shared.request_params import past_the_context
from rill.shared.schema import TokenizedRequest


def refusal(msg: TokenizedRequest, kv: KVCacheManager, max_model_len: int, max_num_seqs: int,
            verifies_drafts: bool = True) -> Refusal | None:
    """What can never run here however long it waits (and which request field to blame), or None."""
    p, n = msg.params, len(msg.prompt_token_ids)
    if not n:
        return Refusal("the prompt is empty", "prompt")
    if p.prediction_ids and not verifies_drafts:
        return Refusal("a prediction needs speculative decoding, which this engine's tensor-parallel "
                       "workers do not run yet", "prediction")
    if p.n < 1:
        return Refusal("n must be at least 1", "n")
    if p.max_tokens is None and n >= max_model_len:  # chat's default: the prompt alone is too long
        return Refusal(past_the_context(max_model_len, n), "messages")
    total = n + resolved_max_tokens(msg, max_model_len)
    if total > max_model_len:
        return Refusal(past_the_context(max_model_len, n, p.max_tokens), "max_tokens")
    if p.n > max_num_seqs:
        return Refusal(f"n={p.n} is more than this engine runs at once (max_num_seqs={max_num_seqs})", "n")
    if not kv.can_ever_fit(total):
        return Refusal(f"the request needs {total} tokens of KV cache but the whole cache holds "
                       f"{kv.num_blocks * kv.block_size}", "max_tokens")
    return None
