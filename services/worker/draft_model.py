"""Speculative decoding with a draft model: a smaller checkpoint of the same vocabulary proposes
each speculating request's drafts at the start of the step that verifies them.

The draft keeps its own KV cache, indexed by the target's block tables (same block ids, same
block size): the scheduler already gave every speculating request slots for its last token and
k drafts, which is where the draft writes while proposing. Its KV is brought up to date lazily:
a request's first pass runs every token the draft has not seen yet (the whole prompt the first
time; a prefix-cache hit computed by another request is recomputed, to the same values), then
k - 1 one-token passes. Drafts are the draft's greedy tokens, so the proposal is one fixed token
per position and the target's sample-and-compare verification (model_runner) is rejection
sampling exactly, as for n-gram drafts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from rill.kernels.ops import make_attention_metadata
from rill.services.worker.llama import LlamaModel

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


class DraftModel:
    def __init__(self, model_dir: str | Path, target: LlamaModel, max_positions: int) -> None:
        self.model = LlamaModel.load(model_dir, target.dtype, str(target.device), max_positions=max_positions)
        if self.model.cfg.vocab_size != target.cfg.vocab_size:
            raise DraftMismatch(f"the draft model's vocabulary ({self.model.cfg.vocab_size} tokens) is not the "
                                f"target's ({target.cfg.vocab_size})")
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0
        self.seen: dict[str, int] = {}  # request id -> tokens whose draft KV is in the cache

    def kv_bytes_per_token(self) -> int:
        c = self.model.cfg
        return c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * self.model.dtype.itemsize

    def resize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.seen.clear()
        self.kv_caches = []
        self.kv_caches = self.model.allocate_kv_cache(num_blocks, block_size)
        self.block_size = block_size

    def forget(self, request_id: str) -> None:
        self.seen.pop(request_id, None)

    def forget_all(self) -> None:
        self.seen.clear()

    def propose(self, rows: Sequence[DraftRow]) -> list[list[int]]:
        """Each row's greedy drafts (`num_drafts` of them), all rows batched pass by pass."""
        drafts: list[list[int]] = [[] for _ in rows]
        starts = [min(self.seen.get(r.request_id, 0), r.num_computed) for r in rows]
        inputs = [r.token_ids[s:r.num_computed + 1] for r, s in zip(rows, starts, strict=True)]
        live = list(range(len(rows)))
        with torch.inference_mode():
            while live:
                tokens = self._pass([rows[i] for i in live], [starts[i] for i in live], [inputs[i] for i in live])
                for i, tok in zip(live, tokens, strict=True):
                    drafts[i].append(tok)
                    starts[i] += len(inputs[i])
                    inputs[i] = [tok]
                live = [i for i in live if len(drafts[i]) < rows[i].num_drafts]
        for r, d in zip(rows, drafts, strict=True):  # written: the last token and all drafts but the last
            self.seen[r.request_id] = r.num_computed + len(d)
        return drafts

    def accepted(self, request_id: str, num_computed: int) -> None:
        """After verification: draft KV past the accepted tokens (`num_computed` now) is stale."""
        if request_id in self.seen:
            self.seen[request_id] = min(self.seen[request_id], num_computed)

    def _pass(self, rows: list[DraftRow], starts: list[int], inputs: list[list[int]]) -> list[int]:
        lens = [len(x) for x in inputs]
        positions, meta = make_attention_metadata([r.block_ids for r in rows], starts, lens, self.block_size,
                                                  self.model.device)
        ids = torch.tensor([t for x in inputs for t in x], dtype=torch.int64, device=self.model.device)
        last = torch.tensor(meta.query_start_loc_host[1:], dtype=torch.int64, device=self.model.device) - 1
        hidden = self.model.final_hidden(ids, positions, meta, self.kv_caches, last)
        return self.model.logits(hidden).argmax(dim=-1).tolist()
