"""Speculative decoding with a draft model: a smaller checkpoint of the same vocabulary proposes
each speculating request's drafts at the start of the step that verifies them.

The draft keeps its own KV cache, indexed by the target's block tables (same block ids, same
block size): the scheduler already gave every speculating request slots for its last token and
k drafts, which is where the draft writes while proposing. Its KV is brought up to date lazily:
a request's first pass runs every token the draft has not seen yet (the whole prompt the first
time; a prefix-cache hit computed by another request is recomputed, to the same values), then
k - 1 one-token passes. Most drafts are the draft's argmax, one fixed token per position,
verified by the target's sample-and-compare as n-gram drafts are; a sampled request's drafts (see
draws_from_q) are drawn from the draft's own distribution q (its sampling settings applied to the
draft's logits), returned with them for rejection sampling against the target's p (model_runner).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from rill.kernels.ops import make_attention_metadata
from rill.services.worker.llama import LlamaModel
from rill.services.worker.sampler import Sampler, SampleRow
from rill.shared.config import ModelConfig
from rill.shared.request_params import SamplingParams

log = logging.getLogger("rill.worker")


class DraftMismatch(ValueError):
    """A draft checkpoint that cannot propose for this target."""


@dataclass
class DraftRow:
    """One speculating request: its tokens so far, where its last one sits, its blocks."""

    request_id: str
    token_ids: list[int]
    num_computed: int  # target tokens computed: the last token sits at this position
    block_ids: list[int]
    num_drafts: int
    params: SamplingParams
    num_outputs: int  # output tokens so far: the first draft's output index
    history_slot: int | None = None  # its token counts in the sampler (penalties apply to q as to p)


@dataclass
class Proposal:
    """A row's drafts and, for a sampled request, the distributions they were drawn from [k, vocab]."""

    tokens: list[int]
    q: torch.Tensor | None


def check_draft(target: ModelConfig, draft: ModelConfig) -> None:
    """DraftMismatch when `draft` cannot propose tokens for `target`."""
    if draft.vocab_size != target.vocab_size:
        raise DraftMismatch(f"the draft model's vocabulary ({draft.vocab_size} tokens) is not the "
                            f"target's ({target.vocab_size})")


def draws_from_q(params: SamplingParams) -> bool:
    """Whether a request's drafts are drawn from q and rejection-sampled: sampled requests, but
    not those asking for logprobs (reported for the tokens the sampler draws) or bound by a
    grammar (the sampler applies its mask); those verify argmax drafts by sample-and-compare."""
    return params.temperature > 0 and params.logprobs is None and params.grammar is None


class DraftModel:
    def __init__(self, model_dir: str | Path, target: LlamaModel, max_positions: int) -> None:
        self.model = LlamaModel.load(model_dir, target.dtype, str(target.device), max_positions=max_positions)
        check_draft(target.cfg, self.model.cfg)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0
        self.seen: dict[str, int] = {}  # request id -> tokens whose draft KV is in the cache

    def resize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.seen.clear()
        self.kv_caches = []
        self.kv_caches = self.model.allocate_kv_cache(num_blocks, block_size)
        self.block_size = block_size

    def forget(self, request_id: str) -> None:
        self.seen.pop(request_id, None)

    def forget_all(self) -> None:
        self.seen.clear()

    def propose(self, rows: Sequence[DraftRow], sampler: Sampler) -> list[Proposal]:
        """Each row's drafts (`num_drafts` of them), all rows batched pass by pass."""
        out = [Proposal([], None) for _ in rows]
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        starts = [min(self.seen.get(r.request_id, 0), r.num_computed) for r in rows]
        inputs = [r.token_ids[s:r.num_computed + 1] for r, s in zip(rows, starts, strict=True)]
        live = list(range(len(rows)))
        with torch.inference_mode():
            while live:
                logits = self._pass([rows[i] for i in live], [starts[i] for i in live], [inputs[i] for i in live])
                tokens = logits.argmax(dim=-1)
                sampled = [j for j, i in enumerate(live) if draws_from_q(rows[i].params)]
                if sampled:
                    q = sampler.distributions(logits[sampled], [
                        SampleRow(rows[live[j]].params, rows[live[j]].num_outputs + len(out[live[j]].tokens), None,
                                  rows[live[j]].history_slot, tuple(out[live[j]].tokens), record=False)
                        for j in sampled])
                    tokens[sampled] = torch.multinomial(q, 1)[:, 0]
                    for j, q_row in zip(sampled, q, strict=True):
                        qs[live[j]].append(q_row)
                for i, tok in zip(live, tokens.tolist(), strict=True):
                    out[i].tokens.append(tok)
                    starts[i] += len(inputs[i])
                    inputs[i] = [tok]
                live = [i for i in live if len(out[i].tokens) < rows[i].num_drafts]
        for r, proposal, q_rows in zip(rows, out, qs, strict=True):
            # written: the last token and all drafts but the last
            self.seen[r.request_id] = r.num_computed + len(proposal.tokens)
            proposal.q = torch.stack(q_rows) if q_rows else None
        return out

    def accepted(self, request_id: str, num_computed: int) -> None:
        """After verification: draft KV past the accepted tokens (`num_computed` now) is stale."""
        if request_id in self.seen:
            self.seen[request_id] = min(self.seen[request_id], num_computed)

    def _pass(self, rows: list[DraftRow], starts: list[int], inputs: list[list[int]]) -> torch.Tensor:
        lens = [len(x) for x in inputs]
        positions, meta = make_attention_metadata([r.block_ids for r in rows], starts, lens, self.block_size,
                                                  self.model.device)
        ids = torch.tensor([t for x in inputs for t in x], dtype=torch.int64, device=self.model.device)
        last = torch.tensor(meta.query_start_loc_host[1:], dtype=torch.int64, device=self.model.device) - 1
        hidden = self.model.final_hidden(ids, positions, meta, self.kv_caches, last)
        return self.model.logits(hidden)
