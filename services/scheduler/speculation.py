"""Speculative decoding, the scheduler's half: which decode rows run drafts, and how many.

With method "ngram" the drafts are proposed here: a request whose last tokens occurred earlier in
its prompt or output is guessed to go on as it did then (prompt lookup). With "draft_model" the
plan carries placeholders that the worker's draft model fills in (worker/draft_model.py). A request
with a prediction (OpenAI's predicted outputs) drafts from it alone, on any engine: where its
output's last tokens stand in the predicted text, the text after them.

Drafts run in the same step as the request's last token. The worker samples every one of those
positions exactly as it would without speculation and keeps the drafts up to the first one its
own sample disagrees with, plus that sample (or, all agreeing, the sample after the last draft).
For a draft that is one fixed token (a lookup, a draft model's greedy token) this *is* rejection
sampling: draft d survives with probability p(d), and otherwise the token is drawn from p without
d, renormalised, so every output token is distributed as p, and greedy output is the same token
for token. A draft model's drafts for a sampled request are drawn from its own distribution q and
verified with min(1, p/q) instead (model_runner._rejection_sample). KV written for rejected
drafts is rolled back by counting only accepted tokens as computed: their slots are overwritten
by the next step.

What a position's sampling reads from the tokens before it is taken as if drafts 1..i-1 stood:
a grammar's mask at draft i is the matcher's after them (the worker advances it through them and
rolls it back), and penalties count them as outputs (the sampler adds them to the request's
counts for that row; the counts keep only what stood).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from rill.services.scheduler.request import Request
from rill.shared.config import PREDICTION_DRAFTS, PREDICTION_NGRAM, SpeculativeConfig
from rill.shared.schema import DRAFT_PLACEHOLDER

PREDICTION_PAUSE = 16  # the most steps planned ahead, without a search, of an output off its prediction


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


def prediction_drafts(output: Sequence[int], prediction: bytes, at: int, k: int,
                      n_max: int = PREDICTION_NGRAM) -> tuple[list[int], int]:
    """Up to `k` tokens of a prediction (its ids as 4-byte ints) that follow the longest suffix of
    `output` found in it, and where they start (the next call's `at`); ([], at) when none is.

    The output usually goes on where it was in the prediction, so a suffix is first looked for from
    `at` on, then anywhere. It takes two tokens, but for the first output token: a lone common
    token found elsewhere would mostly draft what is then rejected, and a rejected draft costs
    nearly a token's compute on a CPU."""
    size = len(prediction) // 4
    tail = array("i", output[-n_max:]).tobytes()
    for n in range(min(n_max, len(output)), 0 if len(output) == 1 else 1, -1):
        pattern = tail[len(tail) - 4 * n:]
        for lo in (max(at - n, 0), 0):
            pos = prediction.find(pattern, lo * 4, (size - 1) * 4)  # at least one token must follow
            while pos >= 0 and pos % 4:  # matched across token boundaries
                pos = prediction.find(pattern, pos + 1, (size - 1) * 4)
            if pos >= 0:
                start = pos // 4 + n
                return array("i", prediction[start * 4:(start + k) * 4]).tolist(), start
    return [], at


def draft_room(req: Request, k: int, budget: int, max_model_len: int) -> int:
    """How many drafts (at most `k`) may run after the request's last token this step, within the
    step's `budget` (its last token included) and its length limits; 0 when it is not decoding or
    its last token is still unknown (in a plan in flight)."""
    if not req.output_token_ids or req.num_inflight_tokens or req.num_computed_tokens != req.num_tokens - 1:
        return 0
    return max(0, min(k, budget - 1, req.max_tokens - len(req.output_token_ids) - 1,
                      max_model_len - req.num_tokens - 1))


def prediction_request_drafts(req: Request, budget: int, max_model_len: int) -> list[int]:
    """A request with a prediction: drafts from it (see prediction_drafts), as many as
    `req.prediction_width` allows (next_prediction_width).

    Its next step is not planned ahead of this one's token (the search needs it), but an output
    that left its prediction would lose async scheduling for nothing: a search that finds no draft
    lets the next 1, 2, 4 ... PREDICTION_PAUSE steps (as the searches keep failing) be planned
    ahead without one (`prediction_pause`, read by Scheduler.may_plan_ahead), then it looks again."""
    if req.num_inflight_tokens:  # planned ahead of its last token: no search, a step of the pause
        req.prediction_pause = max(req.prediction_pause - 1, 0)
        return []
    room = draft_room(req, req.prediction_width, budget, max_model_len)
    if room < 1:
        return []
    drafts, req.prediction_at = prediction_drafts(req.output_token_ids, req.prediction, req.prediction_at, room)
    req.prediction_gap = req.prediction_pause = 0 if drafts else min(max(2 * req.prediction_gap, 1), PREDICTION_PAUSE)
    return drafts


def next_prediction_width(drafted: int, accepted: int) -> int:
    """How many drafts a request's prediction gets next, after `accepted` of `drafted` stood: twice
    as many while all stand (up to PREDICTION_DRAFTS), else as many as stood (one at least), so an
    output that left its prediction pays for few rejected drafts until it is back on it."""
    return min(2 * drafted, PREDICTION_DRAFTS) if accepted == drafted else max(accepted, 1)


class Speculator:
    """Drafts for the requests a step decodes, and the acceptance counters."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.num_drafts = 0  # (request, step) pairs that verified drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def active(self, running: int) -> bool:
        """Whether a step of an engine running `running` requests speculates at all."""
        limit = self.config.disable_by_batch_size
        return limit is None or running < limit

    def drafts(self, req: Request, budget: int, max_model_len: int) -> list[int]:
        """Drafts to run after the request's last token this step, within the step's `budget`
        (its last token included) and its length limits; [] when it is not speculated."""
        room = draft_room(req, self.config.num_speculative_tokens, budget, max_model_len)
        if room < 1:
            return []
        if self.config.method == "draft_model":
            return [DRAFT_PLACEHOLDER] * room
        return ngram_drafts(req.all_token_ids, room, self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
