"""A request as the scheduler tracks it: its tokens, where its KV stands, its state."""

from __future__ import annotations

import enum
import itertools
from array import array
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from rill.shared.block_hash import extend_block_hashes
from rill.shared.config import PREDICTION_DRAFTS, detok_context_len
from rill.shared.request_params import SamplingParams, sample_request_id
from rill.shared.schema import TokenizedRequest


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"  # holds blocks, never scheduled: its KV is on its way to or from another engine
    FINISHED = "finished"


_arrivals = itertools.count()


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    reply_to: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float
    max_tokens: int
    priority: int = 0
    group_id: str = ""  # the client's request id; several samples share it when n > 1
    share_prompt_with: str | None = None  # sample 0 of the group, whose prompt blocks we reuse
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # KV computed, as far as results that came back say
    num_inflight_tokens: int = 0  # scheduled in plans whose results are not back yet
    num_inflight_samples: int = 0  # tokens those plans will sample: placeholders, not yet known
    status: Status = Status.WAITING
    known_to_worker: bool = False
    num_blocks_sent: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held at its first admission (usage)
    block_hashes: list[bytes] = field(default_factory=list)
    seq: int = field(default_factory=lambda: next(_arrivals))  # tie-break in arrival order
    detok_context: int = 8  # output tokens sent as decode context (covers the stop strings)
    worker_params: SamplingParams | None = None  # params without what only detokenizers read
    # A prediction's ids as 4-byte ints, searched for drafts (speculation.py), where in it the last
    # drafts started, how many the next may be, its last pause (steps planned ahead without a search,
    # after one found nothing) and the steps of it left, and its drafts proposed and accepted (usage).
    prediction: bytes = b""
    prediction_at: int = 0
    prediction_width: int = PREDICTION_DRAFTS
    prediction_gap: int = 0
    prediction_pause: int = 0
    num_prediction_drafts: int = 0
    num_prediction_accepted: int = 0

    def __post_init__(self) -> None:
        p = self.params
        if p.prediction_ids:
            self.prediction = array("i", p.prediction_ids).tobytes()
        if self.worker_params is None:  # the worker needs neither the stop strings nor the prediction
            self.worker_params = msgspec.structs.replace(p, stop=[], prediction_ids=[]) \
                if p.stop or p.prediction_ids else p

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Its tokens as the worker will know them once the plans in flight have run."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight_samples

    @property
    def num_planned_tokens(self) -> int:
        """Tokens whose KV is computed or scheduled in a plan in flight."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_unplanned_tokens(self) -> int:
        """Tokens the worker will know that no plan in flight runs: what the next plan may run.
        (num_known_tokens - num_planned_tokens in one call: it is read for every row of every step.)"""
        return (len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight_samples
                - self.num_computed_tokens - self.num_inflight_tokens)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def hashes(self, block_size: int, num_tokens: int) -> list[bytes]:
        """Chained hashes of the full blocks among the first `num_tokens` tokens (memoised: only
        the tokens of blocks not hashed yet are read, so a long context costs no more per block)."""
        start, num_prompt = len(self.block_hashes) * block_size, len(self.prompt_token_ids)
        if start + block_size <= num_tokens:
            tokens = (self.prompt_token_ids[start:num_tokens]
                      + self.output_token_ids[max(start - num_prompt, 0):max(num_tokens - num_prompt, 0)])
            extend_block_hashes(self.block_hashes, tokens, block_size, self.params.cache_salt)
        return self.block_hashes

    @classmethod
    def from_message(cls, msg: TokenizedRequest, max_model_len: int) -> list[Request]:
        """One Request per sample; samples after the first share the first one's prompt blocks."""
        p = msg.params
        stop_ids = set(p.stop_token_ids)
        eos = frozenset((set() if p.ignore_eos else set(msg.eos_token_ids)) | stop_ids)
        out: list[Request] = []
        for i in range(p.n):
            params = p if p.n == 1 else msgspec.structs.replace(
                p, n=1, seed=None if p.seed is None else p.seed + i)
            out.append(cls(request_id=sample_request_id(msg.request_id, i, p.n), reply_to=msg.reply_to,
                           prompt_token_ids=list(msg.prompt_token_ids), params=params, eos_token_ids=eos,
                           arrival_time=msg.arrival_time, max_tokens=resolved_max_tokens(msg, max_model_len),
                           priority=msg.priority, group_id=msg.request_id,
                           share_prompt_with=out[0].request_id if i else None,
                           detok_context=detok_context_len(p.stop)))
        return out


class Refusal(NamedTuple):
    """A request that can never run on this engine: the message for the client, the field at fault."""

    message: str
    param: str | None


def resolved_max_tokens(msg: TokenizedRequest, max_model_len: int) -> int:
    """The request's max_tokens; unset (chat's default) is the rest of the context this engine
    serves, which may be less than the model's (shared/config.py: fitted_max_model_len)."""
    asked = msg.params.max_tokens
    return asked if asked is not None else max_model_len - len(msg.prompt_token_ids)
