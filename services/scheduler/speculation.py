"""Speculative decoding, the scheduler's half: n-gram prompt lookup proposes draft tokens.

A decoding request whose last tokens occurred earlier in its prompt or output is guessed to go on
as it did then: the tokens that followed that earlier occurrence become drafts, run in the same
step as its last token. The worker samples every one of those positions exactly as it would
without speculation and keeps the drafts up to the first one its own sample disagrees with, plus
that sample (or, all agreeing, the sample after the last draft). For a draft that is one fixed
token this *is* rejection sampling: draft d survives with probability p(d), and otherwise the
token is drawn from p without d, renormalised, so every output token is distributed as p, and
greedy output is the same token for token. KV written for rejected drafts is rolled back by
counting only accepted tokens as computed: their slots are overwritten by the next step.

Not speculated (they decode one token a step, as without speculation): requests with
penalties or a grammar, whose sampling at draft i would depend on drafts 1..i-1.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from rill.services.scheduler.request import Request

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config for method "ngram": k drafts from the longest suffix n-gram
    (prompt_lookup_max down to prompt_lookup_min tokens) seen before."""

    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    method: str = "ngram"

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From the flag's JSON; ValueError naming the field at fault."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        method = raw.get("method", "ngram" if "model" not in raw else "draft_model")
        if method not in METHODS:
            raise ValueError(f"--speculative-config method {method!r} is not supported (supported: "
                             f"{', '.join(METHODS)}); a draft model is not served yet")
        unknown = sorted(set(raw) - {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"})
        if unknown:
            raise ValueError(f"--speculative-config: unknown field {unknown[0]!r}")
        if "num_speculative_tokens" not in raw:
            raise ValueError("--speculative-config needs num_speculative_tokens")
        fields = {k: raw[k] for k in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min") if k in raw}
        for name, value in fields.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--speculative-config {name} must be a positive integer, got {value!r}")
        if "prompt_lookup_max" in fields and "prompt_lookup_min" not in fields:
            fields["prompt_lookup_min"] = min(cls.prompt_lookup_min, fields["prompt_lookup_max"])
        if "prompt_lookup_min" in fields and "prompt_lookup_max" not in fields:
            fields["prompt_lookup_max"] = max(cls.prompt_lookup_max, fields["prompt_lookup_min"])
        cfg = cls(method=method, **fields)
        if cfg.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--speculative-config num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}")
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise ValueError("--speculative-config prompt_lookup_min must not exceed prompt_lookup_max")
        return cfg


def ngram_drafts(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` with n_min..n_max tokens; [] when none occurred. The search runs in C (bytes.rfind
    over 4-byte tokens), so a long context costs microseconds, not a Python loop."""
    size = len(tokens)
    if k < 1 or size < n_min + 1:
        return []
    buf = array("i", tokens).tobytes()
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        pattern = buf[(size - n) * 4:]
        end = (size - 1) * 4  # an occurrence must leave at least one token after it
        while (pos := buf.rfind(pattern, 0, end)) >= 0:
            if pos % 4 == 0:
                start = pos // 4 + n
                return list(tokens[start:start + k])
            end = pos + len(pattern) - 1  # matched across token boundaries: look further left
    return []


class Speculator:
    """Drafts for the requests a step decodes, and the acceptance counters."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.num_drafts = 0  # (request, step) pairs that verified drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def drafts(self, req: Request, budget: int, max_model_len: int) -> list[int]:
        """Drafts to run after the request's last token this step, within the step's `budget`
        (its last token included) and its length limits; [] when it is not speculated."""
        p = req.params
        if (not req.output_token_ids or req.num_inflight_tokens or p.uses_penalties or p.grammar is not None
                or req.num_computed_tokens != req.num_tokens - 1):
            return []  # not decoding, its last token still unknown, or sampling that reads the drafts
        room = min(self.config.num_speculative_tokens, budget - 1,
                   req.max_tokens - len(req.output_token_ids) - 1, max_model_len - req.num_tokens - 1)
        if room < 1:
            return []
        return ngram_drafts(req.all_token_ids, room, self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
