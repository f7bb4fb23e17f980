"""CUDA graphs for pure-decode steps (every sequence runs one token).

A decode step launches a few hundred small kernels; on a GPU their launch cost rivals the
step's memory time at small batches, so the whole forward is captured once per padded batch size
and replayed. Everything a captured step reads lives in static buffers sized for the largest
batch: token ids, positions, slot mapping, seq lens and a block table as wide as max_model_len.
A batch of n runs the graph of the next captured size up; its padding lanes have seq_len 0 (the
attention kernels write zeros for them) and slot -1 (the cache write skips them).

What makes the forward capturable: the Triton backend sizes its launch grids from tensor shapes
and from `max_seq_len`, which is pinned to max_model_len here so the split-K decode grid is the
same on every replay (the kernels derive each sequence's split length from its real seq_len on
the device); no op syncs with the host. The torch backend is not capturable (it plans on host
lists), so graphs are only used with the Triton kernels, and never on CPU: there `run` executes
the same padded step eagerly, which lets the CPU tests check the padding logic.

With tensor parallelism every rank captures the same sizes in the same order, its layers'
all-reduces included (NCCL collectives are capturable once the communicator exists, which the
eager run before each capture ensures); the logits' gather on rank 0 runs after the replay, since
its result has a different shape on each rank.

RILL_CUDA_GRAPHS=0 turns graphs off; RILL_CUDA_GRAPH_MAX_BATCH (default 256) caps the sizes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from rill.kernels import ops
from rill.kernels.ops import AttentionMetadata
from rill.services.worker.llama import LlamaModel
from rill.shared import envs

log = logging.getLogger("rill.worker")


def capture_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes, ascending: fine steps where batches are small, coarser further up."""
    sizes = [1, 2, 4] + list(range(8, 64, 8)) + list(range(64, 128, 16)) + list(range(128, 1025, 32))
    out = [s for s in sizes if s < max_batch]
    return out + [max_batch]


def graphs_wanted(device: str, model: LlamaModel) -> bool:
    """CUDA device, Triton kernels, and not switched off by RILL_CUDA_GRAPHS=0."""
    if device != "cuda" or not envs.RILL_CUDA_GRAPHS:
        return False
    return ops.uses_triton(model.embed)


def default_max_batch() -> int:
    return max(1, envs.RILL_CUDA_GRAPH_MAX_BATCH)


class DecodeGraphs:
    """Captured decode steps of one model over one KV cache (recapture if the cache changes)."""

    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_model_len: int, max_batch: int | None = None, sizes: Sequence[int] | None = None) -> None:
        if not ops.uses_triton(model.embed):
            raise ValueError("decode graphs need the Triton kernels (the torch ones plan on host-side lists)")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = sorted(set(sizes)) if sizes else capture_sizes(max_batch or default_max_batch())
        self.max_batch = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        dev = model.device
        big = self.max_batch
        self.ids = torch.zeros(big, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(big, dtype=torch.int64, device=dev)
        self.slots = torch.full((big,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(big, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((big, self.max_blocks), dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(big + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(big, dtype=torch.int64, device=dev)
        pin = dev.type == "cuda"
        # Host staging: one int64 copy (ids | positions | slots) and one int32 copy (seq lens |
        # the used columns of the block table) per step.
        self._host64 = torch.zeros(3 * big, dtype=torch.int64, pin_memory=pin)
        self._host32 = torch.zeros(big + big * self.max_blocks, dtype=torch.int32, pin_memory=pin)
        self._dev32 = torch.zeros_like(self._host32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.captured = False
        # Marks when the last step's host->device copies were done, so that the staging buffers
        # are not overwritten under a copy still in flight.
        self._copied: torch.cuda.Event | None = None

    # ------------------------------------------------------------------------------ capture

    def _meta(self, n: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:n], query_start_loc=self.query_start_loc[:n + 1], seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n], max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc_host=list(range(n + 1)), seq_lens_host=[1] * n)

    def _forward(self, n: int) -> torch.Tensor:
        """This rank's logits of n lanes; the cross-rank gather of tensor parallelism is left to
        `run`, after the replay (the all-reduces inside the layers are captured)."""
        hidden = self.model.final_hidden(self.ids[:n], self.positions[:n], self._meta(n), self.kv_caches,
                                         self.logits_indices[:n])
        return self.model.local_logits(hidden)

    def capture(self) -> None:
        """Capture every size (largest first, one shared memory pool). CUDA only."""
        if self.model.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        start = time.perf_counter()
        self._reset_lanes(self.max_batch)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for n in reversed(self.sizes):
                self._forward(n)  # compiles the kernels for this shape outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(n)
                self.graphs[n] = (graph, out)
        torch.cuda.synchronize()
        self.captured = True
        log.info("captured %d decode CUDA graphs (batch %d..%d) in %.1fs", len(self.graphs), self.sizes[0],
                 self.max_batch, time.perf_counter() - start)

    def _reset_lanes(self, n: int) -> None:
        self.ids[:n].zero_()
        self.positions[:n].zero_()
        self.slots[:n].fill_(-1)
        self.seq_lens[:n].zero_()

    # ------------------------------------------------------------------------------ replay

    def fits(self, query_lens: Sequence[int]) -> bool:
        """Whether a step with these per-sequence token counts can run from a graph."""
        return 0 < len(query_lens) <= self.max_batch and all(n == 1 for n in query_lens)

    def padded_size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def run(self, token_ids: Sequence[int], num_computed: Sequence[int],
            block_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Decode one token per sequence (the token at position num_computed[i]); returns fp32
        logits [n, vocab], valid until the next call."""
        n = len(token_ids)
        size = self.padded_size(n)
        bs = self.block_size
        pos = np.asarray(num_computed, dtype=np.int64)
        if n and int(pos.max()) >= self.max_model_len:
            raise ValueError(f"position {int(pos.max())} is past max_model_len {self.max_model_len}")
        lens = pos + 1
        width = int(-(-lens.max() // bs)) if n else 1
        if self._copied is not None:
            self._copied.synchronize()
        h64 = self._host64.numpy()
        h64[:3 * size] = 0
        h64[2 * size:3 * size] = -1
        h64[:n] = token_ids
        h64[size:size + n] = pos
        h32 = self._host32.numpy()
        h32[:size + size * width] = 0
        h32[:n] = lens
        table = h32[size:size + size * width].reshape(size, width)
        for i, ids in enumerate(block_ids):
            need = int(-(-lens[i] // bs))
            if need > len(ids):
                raise ValueError(f"sequence {i} needs {need} blocks, has {len(ids)}")
            table[i, :need] = ids[:need]
        h64[2 * size:2 * size + n] = table[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        # Two host->device copies, then device-side scatter into the static buffers.
        dev64 = self._host64[:3 * size].to(self.ids.device, non_blocking=True).view(3, size)
        self.ids[:size].copy_(dev64[0])
        self.positions[:size].copy_(dev64[1])
        self.slots[:size].copy_(dev64[2])
        dev32 = self._dev32[:size + size * width]
        dev32.copy_(self._host32[:size + size * width], non_blocking=True)
        self.seq_lens[:size].copy_(dev32[:size])
        self.block_tables[:size, :width].copy_(dev32[size:].view(size, width))
        if self.ids.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        if self.captured:
            graph, out = self.graphs[size]
            graph.replay()
            return self.model.gather_logits(out[:n])
        with torch.inference_mode():
            return self.model.gather_logits(self._forward(size)[:n])
