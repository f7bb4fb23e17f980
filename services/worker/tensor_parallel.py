"""Tensor parallelism: one engine's worker as N ranks joined by torch.distributed (gloo on CPU,
NCCL on CUDA), Megatron-style.

Each rank loads only its slice of every weight (`ShardedCheckpoint`): q/k/v and gate/up split
by output rows (column-parallel), o and down by input columns (row-parallel, each followed by
one all-reduce; their bias added by rank 0 alone, so the sum holds it once), the embedding and
the LM head by vocabulary rows (a masked lookup plus an all-reduce; the head's logits gathered on
rank 0, which samples). KV heads are split in contiguous runs with their query heads, the first
ranks taking one more when they do not divide; with fewer KV heads than ranks, each KV head is
replicated on the ranks that share its query heads. `llama.py` knows none of this beyond three
hooks: the checkpoint it reads, the per-rank config, and `shard_model` applied after load.

The rendezvous is a TCP address (rank 0 listens): `--tp-address HOST:PORT`, else
$RILL_TP_ADDRESS; a rank that cannot join within $RILL_TP_JOIN_TIMEOUT seconds fails start-up.
A collective that fails (a peer died) is fatal to the rank: a dead rank is a dead engine.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rill.services.worker.tp_support import TensorParallelError
from rill.shared import envs
from rill.shared.config import ModelConfig

log = logging.getLogger("rill.worker")

DEFAULT_JOIN_TIMEOUT_S = 60.0
# A collective waits this long for a peer that is alive but stuck; a dead peer fails it at once.
COLLECTIVE_TIMEOUT_S = 600.0


def _balanced(n: int, parts: int, i: int) -> range:
    """Part i of 0..n-1 cut into `parts` contiguous runs, the first n % parts one longer."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return range(start, start + base + (i < extra))


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `size` holds, as global indices."""

    rank: int
    size: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range
    vocab_part: int  # every rank's vocabulary slice padded to this, so the gather is uniform

    @classmethod
    def plan(cls, cfg: ModelConfig, rank: int, size: int) -> Shard:
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        group = heads // kv
        if kv >= size:
            kv_heads = _balanced(kv, size, rank)
            q_heads = range(kv_heads.start * group, kv_heads.stop * group)
        else:
            share = size // kv  # ranks per KV head
            if size % kv or group % share:
                raise TensorParallelError(
                    f"--tensor-parallel-size {size} cannot split {heads} query heads over {kv} KV heads "
                    f"(with fewer KV heads than ranks, the ranks must divide evenly among them)")
            head, j = divmod(rank, share)
            kv_heads = range(head, head + 1)
            per = group // share
            q_heads = range(head * group + j * per, head * group + (j + 1) * per)
        part = -(-cfg.vocab_size // size)
        vocab = range(min(rank * part, cfg.vocab_size), min((rank + 1) * part, cfg.vocab_size))
        return cls(rank, size, q_heads, kv_heads, _balanced(cfg.intermediate_size, size, rank), vocab, part)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config this rank's forward runs: its own head counts (vocabulary and hidden size
        stay the model's)."""
        return dataclasses.replace(cfg, num_attention_heads=len(self.q_heads),
                                   num_key_value_heads=len(self.kv_heads))

    def kernel_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shapes this rank's GEMMs run, for the CPU kernel measurements."""
        return dataclasses.replace(self.local_config(cfg), intermediate_size=len(self.intermediate),
                                   vocab_size=self.vocab_part)


class ShardedCheckpoint:
    """A llama_weights.Checkpoint read through one rank's `Shard`: each tensor's slice only."""

    def __init__(self, ckpt: Any, cfg: ModelConfig, shard: Shard) -> None:
        self.ckpt = ckpt
        self.shard = shard
        d = cfg.head_dim
        q, kv = shard.q_heads, shard.kv_heads
        q_rows = slice(q.start * d, q.stop * d)
        kv_rows = slice(kv.start * d, kv.stop * d)
        ff = slice(shard.intermediate.start, shard.intermediate.stop)
        q_all, kv_all, ff_all = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size

        def shifted(s: slice, by: int) -> slice:
            return slice(s.start + by, s.stop + by)

        # name suffix -> (the rows of the output dimension it keeps, in order) or a column slice
        self._rows: dict[str, list[slice]] = {
            "self_attn.q_proj": [q_rows], "self_attn.k_proj": [kv_rows], "self_attn.v_proj": [kv_rows],
            "self_attn.qkv_proj": [q_rows, shifted(kv_rows, q_all), shifted(kv_rows, q_all + kv_all)],
            "mlp.gate_proj": [ff], "mlp.up_proj": [ff], "mlp.gate_up_proj": [ff, shifted(ff, ff_all)],
            "embed_tokens": [slice(shard.vocab.start, shard.vocab.stop)],
            "lm_head": [slice(shard.vocab.start, shard.vocab.stop)]}
        self._cols: dict[str, slice] = {"self_attn.o_proj": q_rows, "mlp.down_proj": ff}

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt

    def names(self) -> set[str]:
        return self.ckpt.names()

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self.ckpt else None

    def get(self, name: str) -> torch.Tensor:
        module, _, kind = name.rpartition(".")
        for suffix, rows in self._rows.items():
            if module.endswith(suffix):
                return torch.cat([self.ckpt.part(name, r) for r in rows])
        for suffix, cols in self._cols.items():
            if module.endswith(suffix):
                if kind == "bias":  # a row-parallel bias is added once, by rank 0
                    full = self.ckpt.get(name)
                    return full if self.shard.rank == 0 else torch.zeros_like(full)
                return self.ckpt.part(name, slice(None), cols)
        return self.ckpt.get(name)  # norms: replicated


# --------------------------------------------------------------------------- the process group


def join_timeout_s() -> float:
    return envs.RILL_TP_JOIN_TIMEOUT or DEFAULT_JOIN_TIMEOUT_S


class TPGroup:
    """This process's rank in the engine's group, and the collectives the forward uses."""

    def __init__(self, rank: int, size: int, device: str) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        # Control messages (the plan stream's start id) are Python objects: gloo, on any device.
        self.control = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        self.allreduce_calls = 0
        self.allreduce_s = 0.0  # summed only when timing is on (bench_tp.py)
        self.timing = False

    @property
    def lead(self) -> bool:
        return self.rank == 0

    @classmethod
    def join(cls, rank: int, size: int, address: str, device: str, timeout_s: float | None = None) -> TPGroup:
        """Join (rank 0: host) the group at `address` (HOST:PORT); a clear error when the other
        ranks do not come within the timeout."""
        if not 0 <= rank < size:
            raise TensorParallelError(f"--tp-rank {rank} is outside 0..{size - 1}")
        if not address or ":" not in address:
            raise TensorParallelError(f"tensor parallelism needs a rendezvous HOST:PORT (--tp-address or "
                                      f"$RILL_TP_ADDRESS), got {address!r}")
        timeout = join_timeout_s() if timeout_s is None else timeout_s
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())  # one GPU per rank of a machine
        try:
            store = dist.TCPStore(address.rsplit(":", 1)[0], int(address.rsplit(":", 1)[1]), size, rank == 0,
                                  timeout=timedelta(seconds=timeout), wait_for_workers=True)
            dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                    timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
            dist.barrier()
        except (RuntimeError, ValueError, OSError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise TensorParallelError(f"tensor-parallel rank {rank} of {size}: the group at {address} did not form "
                                      f"within {timeout:g} s ({first})") from None
        log.info("tensor parallel: rank %d of %d joined at %s (%s)", rank, size, address, backend)
        return cls(rank, size, device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.timing:
            import time

            start = time.perf_counter()
            dist.all_reduce(x)
            self.allreduce_s += time.perf_counter() - start
        else:
            dist.all_reduce(x)
        self.allreduce_calls += 1
        return x

    def all_reduce_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """Rank 0: every rank's [rows, part] slice side by side, cut to `width` columns; other
        ranks: an empty [rows, 0] (they do not sample)."""
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.lead else None
        dist.gather(x.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=1)[:, :width] if parts is not None else x[:, :0]

    def broadcast_tokens(self, tokens: list[int] | None, n: int) -> list[int]:
        """Rank 0's sampled tokens, on every rank (so each appends what was sampled)."""
        t = torch.tensor(tokens, dtype=torch.int64, device=self.device) if self.lead else \
            torch.empty(n, dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return t.tolist()

    def share(self, obj: Any) -> Any:
        """Rank 0's `obj`, on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------- the sharded model


class RowParallel:
    """A row-parallel linear layer: this rank's partial product, summed over the ranks."""

    def __init__(self, linear: Callable[[torch.Tensor], torch.Tensor], group: TPGroup) -> None:
        self.linear = linear
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x))


class VocabParallelEmbedding:
    """Lookup in this rank's vocabulary rows; ids elsewhere give zeros, and the sum over ranks
    gives each id its one row."""

    def __init__(self, weight: torch.Tensor, vocab: range, group: TPGroup) -> None:
        self.weight = weight
        self.vocab = vocab
        self.group = group

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab.start
        outside = (local < 0) | (local >= len(self.vocab))
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(h.masked_fill_(outside[:, None], 0))


class GatheredHead:
    """The LM head over this rank's vocabulary rows, its logits gathered on rank 0."""

    def __init__(self, head: Any, shard: Shard, vocab_size: int, group: TPGroup) -> None:
        self.head = head
        self.pad = shard.vocab_part - len(shard.vocab)
        self.vocab_size = vocab_size
        self.group = group

    def float_out(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.gather(self.local(hidden))

    def local(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the logits, padded to the common width (no collective: a CUDA
        graph captures this part, and the gather runs after its replay)."""
        logits = self.head.float_out(hidden)
        return F.pad(logits, (0, self.pad)) if self.pad else logits

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        return self.group.gather_columns(local, self.vocab_size)


def shard_model(model: Any, shard: Shard, full_cfg: ModelConfig, group: TPGroup) -> None:
    """Turn a LlamaModel loaded from this rank's slices into its part of the whole: all-reduces
    after the row-parallel layers and the embedding, the LM head's logits gathered."""
    for layer in model.layers:
        layer.o = RowParallel(layer.o, group)
        layer.down = RowParallel(layer.down, group)
    model.embed_lookup = VocabParallelEmbedding(model.embed, shard.vocab, group)
    if model.lm_head is not None:
        model.lm_head = GatheredHead(model.lm_head, shard, full_cfg.vocab_size, group)
