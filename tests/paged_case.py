"""Random paged-KV attention cases with a float64 reference, shared by the kernel tests."""

from __future__ import annotations

import torch


def close(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> None:
    got64 = got.double().cpu()
    want = want.double().cpu()
    assert not torch.isnan(got64).any(), "NaN in the output (unwritten poison or a read past the end)"
    err = (got64 - want).abs()
    bound = atol + rtol * want.abs()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (f"max err {err.max().item():.3e} (at {worst.item()}: got "
                                  f"{got64.flatten()[worst].item():.6f}, want {want.flatten()[worst].item():.6f})")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------- paged fixtures


class PagedCase:
    """Sequences with their KV in shuffled blocks; every slot no sequence owns holds NaN, and
    block-table padding points at an all-NaN block."""

    def __init__(self, seq_lens: list[int], query_lens: list[int], block_size: int, num_kv_heads: int,
                 group: int, head_dim: int, dtype: torch.dtype, seed: int,
                 device: str = "cpu") -> None:
        g = gen(seed)
        self.seq_lens, self.query_lens, self.bs = seq_lens, query_lens, block_size
        self.heads = num_kv_heads * group
        self.scale = head_dim ** -0.5
        need = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(need) + 3
        perm = torch.randperm(num_blocks, generator=g).tolist()
        self.poison_block = perm.pop()
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k = torch.randn(shape, generator=g)
        # A few keys with large norms: their logits dominate and move the running max late.
        k[torch.rand(shape[:3], generator=g) < 0.05] *= 4.0
        v = torch.randn(shape, generator=g)
        k_cache = torch.full(shape, float("nan"))
        v_cache = torch.full(shape, float("nan"))
        width = max(need) + 2
        tables = torch.full((len(seq_lens), width), self.poison_block, dtype=torch.int32)
        for i, (n, nb) in enumerate(zip(seq_lens, need, strict=True)):
            ids = [perm.pop() for _ in range(nb)]
            tables[i, :nb] = torch.tensor(ids, dtype=torch.int32)
            for p in range(n):
                b, o = ids[p // block_size], p % block_size
                k_cache[b, o], v_cache[b, o] = k[b, o], v[b, o]
        self.k_cache = k_cache.to(dtype).to(device)
        self.v_cache = v_cache.to(dtype).to(device)
        self.tables = tables.to(device)
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        self.qsl = torch.tensor(qsl, dtype=torch.int32, device=device)
        self.q = (torch.randn((qsl[-1], self.heads, head_dim), generator=g) * 1.5).to(dtype).to(device)

    def release_before_window(self, window: int) -> None:
        """Point every table entry of a block wholly before each sequence's sliding window (as
        seen by its first query row) at the all-NaN block, as if the scheduler had released it:
        a kernel that reads one shows NaN."""
        for i, (n, qn) in enumerate(zip(self.seq_lens, self.query_lens, strict=True)):
            first = max(0, n - qn - window + 1) // self.bs
            self.tables[i, :first] = self.poison_block

    def reference(self, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """float64 attention from explicitly gathered pages, GQA by head repetition; `window`: a
        query at p sees keys p - window + 1 .. p (transformers' sliding window); `softcap`: scores
        s become softcap * tanh(s / softcap) before the mask (Gemma 2)."""
        q = self.q.double().cpu()
        kc, vc, tables = self.k_cache.double().cpu(), self.v_cache.double().cpu(), self.tables.cpu()
        group = self.heads // kc.shape[2]
        out = torch.empty_like(q)
        start = 0
        for i, (n, qn) in enumerate(zip(self.seq_lens, self.query_lens, strict=True)):
            q_pos = n - qn + torch.arange(qn)
            lo = max(0, n - qn - window + 1) if window else 0
            pos = torch.arange(lo, n)
            blocks = tables[i, pos // self.bs].long()
            k = kc[blocks, pos % self.bs].repeat_interleave(group, dim=1)  # [n, H, D]
            v = vc[blocks, pos % self.bs].repeat_interleave(group, dim=1)
            qi = q[start:start + qn]
            s = torch.einsum("thd,khd->htk", qi, k) * self.scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            hidden = pos[None, None, :] > q_pos[None, :, None]
            if window:
                hidden |= pos[None, None, :] <= q_pos[None, :, None] - window
            s = s.masked_fill(hidden, float("-inf"))
            out[start:start + qn] = torch.einsum("htk,khd->thd", s.softmax(-1), v)
            start += qn
        return out

    def poisoned_out(self) -> torch.Tensor:
        return torch.full_like(self.q, float("nan"))


def decode_lengths(bs: int) -> list[int]:
    # 1 token, ends one short of a block, exactly a block, one past, mid-block after a few, many blocks
    return [1, bs - 1, bs, bs + 1, 3 * bs + 5, 8 * bs - 3]


def kv_heads_for(group: int) -> int:
    return 1 if group == 8 else 2
