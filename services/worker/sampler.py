"""Token sampling on the worker: greedy, temperature, top-k, top-p, per-request seeds.

Each sampled row draws one uniform number and inverts its (filtered) CDF: one random draw per
row, where an exponential race would need a whole vocabulary of them (~1 ms per row on CPU).
A seeded request draws from its own generator, re-seeded from (seed, output index) before every
draw, so its tokens depend only on its own logits: not on the batch it shares, nor on whether
it was preempted and resumed in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rill.shared.schema import SamplingParams

_MASK64 = (1 << 64) - 1


def _mix_seed(seed: int, index: int) -> int:
    """A well-spread 63-bit seed for draw `index` of a request seeded with `seed` (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class SampleRow:
    """What the sampler needs to know about one request."""

    params: SamplingParams
    output_index: int  # how many tokens this request has already generated
    generator: torch.Generator | None = None  # set for seeded requests


def check_params(p: SamplingParams) -> str | None:
    """Why these params cannot be sampled, or None."""
    if not p.temperature >= 0:  # also catches NaN
        return f"temperature must be >= 0, got {p.temperature}"
    if not 0 < p.top_p <= 1:
        return f"top_p must be in (0, 1], got {p.top_p}"
    if p.top_k < 0:
        return f"top_k must be >= 0, got {p.top_k}"
    return None


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", eos_token_ids: Sequence[int] = (),
                 seed: int = 0) -> None:
        self.device = torch.device(device)
        self.eos_token_ids = list(eos_token_ids)
        self._shared = torch.Generator(device=self.device)  # noise for unseeded requests
        self._shared.manual_seed(seed)

    def make_generator(self, params: SamplingParams) -> torch.Generator | None:
        return torch.Generator(device=self.device) if params.seed is not None else None

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[int]:
        """One token per row of fp32 logits [B, vocab]."""
        logits = self._ban_early_stops(logits, rows)
        temps = [r.params.temperature for r in rows]
        idx = [i for i, t in enumerate(temps) if t > 0]
        if not idx:
            return logits.argmax(dim=-1).tolist()
        vocab, dev = logits.shape[1], logits.device
        sub = [rows[i] for i in idx]
        # Rows are copied out only when some are left behind: each copy moves B x vocab floats.
        x = _take(logits, idx)
        probs = torch.softmax(x / torch.tensor([r.params.temperature for r in sub], device=dev)[:, None], dim=-1)
        u = self._uniforms(sub)
        filtered = [j for j, r in enumerate(sub) if 0 < r.params.top_k < vocab or r.params.top_p < 1.0]
        whole = sorted(set(range(len(sub))) - set(filtered))
        picks = torch.empty(len(sub), dtype=torch.int64, device=dev)
        if whole:
            picks[whole] = _inverse_cdf(_take(probs, whole), u[whole])
        if filtered:
            picks[filtered] = _sample_top_k_top_p(_take(probs, filtered), [sub[j].params.top_k for j in filtered],
                                                  [sub[j].params.top_p for j in filtered], u[filtered])
        if len(idx) == len(rows):
            return picks.tolist()
        out = logits.argmax(dim=-1)  # the greedy rows
        out[idx] = picks
        return out.tolist()

    def _ban_early_stops(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """Before min_tokens outputs, EOS and stop tokens cannot be sampled."""
        cells = [(i, t) for i, r in enumerate(rows) if r.output_index < r.params.min_tokens
                 for t in (*self.eos_token_ids, *r.params.stop_token_ids) if 0 <= t < logits.shape[1]]
        if not cells:
            return logits
        logits = logits.clone()  # the caller's logits stay as the model produced them
        r, c = zip(*cells, strict=True)
        logits[list(r), list(c)] = float("-inf")
        return logits

    def _uniforms(self, rows: Sequence[SampleRow]) -> torch.Tensor:
        """One U[0, 1) draw per row (fp64): from the request's own generator when seeded."""
        u = torch.rand(len(rows), dtype=torch.float64, generator=self._shared, device=self.device)
        for i, r in enumerate(rows):
            if r.generator is not None and r.params.seed is not None:
                r.generator.manual_seed(_mix_seed(r.params.seed, r.output_index))
                u[i] = torch.rand(1, dtype=torch.float64, generator=r.generator, device=self.device)[0]
        return u


# The candidates for top-k/top-p come from topk() in growing sizes, each stage only for the rows
# whose nucleus did not fit the previous one, rather than from a full sort (~2 ms per row at a
# 49k vocabulary on CPU).
_CANDIDATE_STAGES = (128, 1024, 4096)


def _take(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if len(rows) == t.shape[0]:
        return t  # every row, in order
    return t.index_select(0, torch.tensor(rows, device=t.device))


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index j of each row with cdf[j-1] <= u * total < cdf[j] (zero-weight entries never win)."""
    cdf = probs.float().cumsum(dim=-1)
    total = cdf[:, -1]
    # Strictly below the total, or rounding could land on a zero-weight tail entry.
    target = torch.minimum((u * total.double()).float(), torch.nextafter(total, torch.zeros_like(total)))
    j = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    return j.clamp_max_(probs.shape[1] - 1)


def _sample_top_k_top_p(probs: torch.Tensor, ks: list[int], ps: list[float], u: torch.Tensor) -> torch.Tensor:
    """Sample each row from its top-k tokens (0: all), then the smallest prefix of those, by
    renormalized probability, whose mass reaches top_p (as HF and vLLM apply them)."""
    vocab, dev = probs.shape[1], probs.device
    ks = [k if 0 < k < vocab else 0 for k in ks]
    out = torch.empty(probs.shape[0], dtype=torch.int64, device=dev)
    need = max(ks)
    sizes = sorted({min(vocab, max(need, s)) for s in _CANDIDATE_STAGES} | {vocab})
    pending = list(range(probs.shape[0]))
    for size in sizes:
        k_t = torch.tensor([ks[i] for i in pending], device=dev)
        p_t = torch.tensor([ps[i] if ps[i] < 1.0 else float("inf") for i in pending], device=dev)
        vals, order = _take(probs, pending).topk(size, dim=-1)  # descending
        in_k = torch.arange(size, device=dev)[None, :] < torch.where(k_t > 0, k_t, size)[:, None]
        vals = vals * in_k
        # top-k renormalizes; without top-k the candidates keep their share of the full vocabulary
        mass = torch.where(k_t > 0, vals.sum(-1), torch.ones_like(vals[:, 0]))
        vals = vals / mass[:, None]
        # Settled: the candidates hold the whole top-k, or reach top_p, or are the whole vocabulary.
        settled = (k_t > 0) | (vals.sum(-1) >= p_t) if size < vocab else torch.ones_like(k_t, dtype=torch.bool)
        done = settled.nonzero()[:, 0]
        if len(done):
            v, keep = vals[done], in_k[done]
            keep = keep & ((v.cumsum(dim=-1) - v) < p_t[done][:, None])  # the top token always stays
            rows = [pending[i] for i in done.tolist()]
            j = _inverse_cdf(v * keep, u[rows])
            out[rows] = order[done].gather(1, j[:, None])[:, 0]
        pending = [pending[i] for i in (~settled).nonzero()[:, 0].tolist()]
        if not pending:
            break
    return out
