"""Whether a StepPlan fits the worker's state: checked whole, before anything changes, so a plan
that does not fit is refused and the worker's state stays as it was."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

from rill.services.worker.sampler import check_params
from rill.shared.schema import DRAFT_PLACEHOLDER, NewRequestData, StepPlan


class PlanError(ValueError):
    """A StepPlan that does not fit the worker's state (the step is refused, state untouched)."""


class Known(Protocol):
    """What the check reads of a request the worker knows (model_runner.RequestState)."""

    token_ids: list[int]
    num_computed: int
    block_ids: list[int]


class Limits(NamedTuple):
    vocab_size: int
    num_blocks: int
    block_size: int
    max_model_len: int
    tensor_parallel: bool  # drafts are not verified across ranks
    draft_model: bool  # placeholder drafts are proposed here


def check_plan(plan: StepPlan, requests: Mapping[str, Known], limits: Limits) -> None:
    """Validate the whole plan against the state it would produce, before changing anything."""
    if len(plan.cached_request_ids) != len(plan.cached_new_block_ids):
        raise PlanError("cached_request_ids and cached_new_block_ids differ in length")
    if len(plan.scheduled_request_ids) != len(plan.num_scheduled_tokens):
        raise PlanError("scheduled_request_ids and num_scheduled_tokens differ in length")
    # (tokens known, tokens computed, blocks) of every request after this plan's diffs
    forget = set(plan.finished_request_ids)
    view: dict[str, tuple[int, int, int]] = {
        rid: (len(s.token_ids), s.num_computed, len(s.block_ids)) for rid, s in requests.items()
        if rid not in forget}
    for new in plan.new_requests:
        _check_new(new, limits)
        view[new.request_id] = (len(new.token_ids), new.num_computed_tokens, len(new.block_ids))
    for rid, blocks in zip(plan.cached_request_ids, plan.cached_new_block_ids, strict=True):
        if rid not in view:
            raise PlanError(f"unknown request id {rid!r} in cached_request_ids")
        _check_blocks(rid, blocks, limits)
        n_tok, n_done, n_blocks = view[rid]
        view[rid] = (n_tok, n_done, n_blocks + len(blocks))
    if len(set(plan.scheduled_request_ids)) != len(plan.scheduled_request_ids):
        raise PlanError("a request is scheduled twice in one step")
    drafts = _check_drafts(plan, limits)
    for rid, n, k in zip(plan.scheduled_request_ids, plan.num_scheduled_tokens, drafts, strict=True):
        if rid not in view:
            raise PlanError(f"unknown request id {rid!r} in scheduled_request_ids")
        n_tok, n_done, n_blocks = view[rid]
        if k and (n != k + 1 or n_done + 1 != n_tok):
            raise PlanError(f"request {rid!r}: {k} drafts need {k + 1} tokens scheduled after all but its last")
        n_tok += k
        if n < 1 or n_done + n > n_tok:
            raise PlanError(f"request {rid!r}: {n} tokens scheduled, {n_tok - n_done} left to compute")
        if n_done + n > limits.max_model_len:
            raise PlanError(f"request {rid!r}: {n_done + n} tokens exceed max_model_len {limits.max_model_len}")
        if n_done + n > n_blocks * limits.block_size:
            raise PlanError(f"request {rid!r}: {n_blocks} blocks cannot hold {n_done + n} tokens")


def _check_drafts(plan: StepPlan, limits: Limits) -> list[int]:
    """Draft counts per scheduled request, after checking the drafts can be verified here."""
    if not plan.spec_token_ids:
        return plan.num_drafts()
    if len(plan.spec_token_ids) != len(plan.scheduled_request_ids):
        raise PlanError("spec_token_ids and scheduled_request_ids differ in length")
    for rid, drafts in zip(plan.scheduled_request_ids, plan.spec_token_ids, strict=True):
        if not drafts:
            continue
        if limits.tensor_parallel:
            raise PlanError("speculative drafts with tensor parallelism")
        if drafts[0] == DRAFT_PLACEHOLDER and limits.draft_model:
            if any(d != DRAFT_PLACEHOLDER for d in drafts):
                raise PlanError(f"request {rid!r} mixes draft tokens and placeholders")
        elif min(drafts) < 0 or max(drafts) >= limits.vocab_size:
            raise PlanError(f"request {rid!r} has draft tokens outside the vocabulary")
    return plan.num_drafts()


def _check_new(new: NewRequestData, limits: Limits) -> None:
    rid = new.request_id
    if not new.token_ids:
        raise PlanError(f"request {rid!r} has no tokens")
    if min(new.token_ids) < 0 or max(new.token_ids) >= limits.vocab_size:
        raise PlanError(f"request {rid!r} has token ids outside the vocabulary (size {limits.vocab_size})")
    if not 0 <= new.num_computed_tokens <= len(new.token_ids):
        raise PlanError(f"request {rid!r}: num_computed_tokens {new.num_computed_tokens} out of range")
    if not 0 <= new.num_output_tokens <= len(new.token_ids):
        raise PlanError(f"request {rid!r}: num_output_tokens {new.num_output_tokens} out of range")
    why = check_params(new.params)
    if why:
        raise PlanError(f"request {rid!r}: {why}")
    _check_blocks(rid, new.block_ids, limits)


def _check_blocks(rid: str, blocks: Sequence[int], limits: Limits) -> None:
    if blocks and (min(blocks) < 0 or max(blocks) >= limits.num_blocks):
        raise PlanError(f"request {rid!r}: block id outside 0..{limits.num_blocks - 1}")
