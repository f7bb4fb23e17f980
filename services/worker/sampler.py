"""Token sampling on the worker: greedy, temperature, top-k, top-p, min_p, penalties, logit_bias,
per-request seeds, logprobs and grammar masks.

The order is vLLM's: the structured-output mask, min_tokens bans and logit_bias, then the repetition, frequency and presence
penalties (greedy rows take their argmax here, so bias and penalties steer them too), then
temperature, min_p, top-k and top-p, then the draw. Logprobs are log_softmax of the raw logits,
before any of this (vLLM's default "raw_logprobs"). Every step is batched over rows; per-row
Python work only builds index tensors, and a batch whose rows use none of the extras pays nothing
for them.

Each sampled row draws one uniform number and inverts its (filtered) CDF: one random draw per
row, where an exponential race would need a whole vocabulary of them.
A seeded request draws from its own generator, re-seeded from (seed, output index) before every
draw, so its tokens depend only on its own logits: not on the batch it shares, nor on whether
it was preempted and resumed in between.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rill.kernels import cpu_native
from rill.services.worker.structured import apply_bitmask
from rill.shared.request_params import SamplingParams
from rill.shared.schema import TokenLogprobs

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, index: int) -> int:
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
    history_slot: int | None = None  # its row in the sampler's TokenHistory (requests with penalties)
    # A speculated position: the drafts before it, outputs for its penalties as if already sampled;
    # its history is recorded by the caller once it knows which drafts stood (record False).
    drafted: tuple[int, ...] = ()
    record: bool = True
    recent: tuple[int, ...] = ()  # its last output tokens before `drafted`, as many as its bad words need


@dataclass
class TokenMask:
    """Structured outputs: rows[i] may only sample the tokens whose bit is set in bits[i]."""

    rows: list[int]
    bits: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32, on the CPU


@dataclass
class SampledBatch:
    token_ids: list[int]
    # Aligned with the rows when any row asked for logprobs (None for the others), else empty.
    logprobs: list[TokenLogprobs | None]


def check_params(p: SamplingParams) -> str | None:
    """Why these params cannot be sampled, or None. The comparisons are written so NaN fails."""
    if not p.temperature >= 0:
        return f"temperature must be >= 0, got {p.temperature}"
    if not 0 < p.top_p <= 1:
        return f"top_p must be in (0, 1], got {p.top_p}"
    if p.top_k < 0:
        return f"top_k must be >= 0, got {p.top_k}"
    if not 0 <= p.min_p <= 1:
        return f"min_p must be in [0, 1], got {p.min_p}"
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not -2 <= value <= 2:
            return f"{name} must be in [-2, 2], got {value}"
    if not (p.repetition_penalty > 0 and math.isfinite(p.repetition_penalty)):
        return f"repetition_penalty must be a finite number > 0, got {p.repetition_penalty}"
    bad = [t for t, b in p.logit_bias.items() if not math.isfinite(b)]
    if bad:
        return f"logit_bias of token {bad[0]} must be a finite number, got {p.logit_bias[bad[0]]}"
    if p.logprobs is not None and p.logprobs < 0:
        return f"logprobs must be >= 0, got {p.logprobs}"
    if p.prompt_logprobs is not None and p.prompt_logprobs < 0:
        return f"prompt_logprobs must be >= 0, got {p.prompt_logprobs}"
    return None


class TokenHistory:
    """What the penalties need from each tracked request's tokens, one row per request in two
    pooled [slots, vocab] tensors: how often each token occurs in the output, and which tokens
    occur in the prompt. A step gathers its rows with one index_select and adds its sampled
    tokens with one index_put_, so a step costs O(batch x vocab) however long the outputs grow;
    recounting the histories every step would cost (and copy to the device) O(tokens so far)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.clear()

    def clear(self) -> None:
        """Forget every request and give the memory back."""
        self.counts = torch.zeros(0, self.vocab_size, dtype=torch.int32, device=self.device)
        self.in_prompt = torch.zeros(0, self.vocab_size, dtype=torch.bool, device=self.device)
        self._free: list[int] = []

    def add(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> int:
        """Track a request (also a resumed one, outputs so far included); returns its slot."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.counts[slot].zero_()
        self.in_prompt[slot].zero_()
        if prompt_ids:
            self.in_prompt[slot, self._ids(prompt_ids)] = True
        if output_ids:
            out = self._ids(output_ids)
            self.counts[slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def record(self, slots: Sequence[int], tokens: torch.Tensor) -> None:
        """Count one more output occurrence of tokens[i] for the request at slots[i]."""
        self.counts.index_put_((self._ids(slots), tokens),
                               torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    def _ids(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def _grow(self) -> None:
        """Double the pool (amortized: slots are reused, so this happens O(log peak) times)."""
        old = self.counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        in_prompt[:old] = self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt
        self._free.extend(range(new - 1, old - 1, -1))  # lowest slots first


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", eos_token_ids: Sequence[int] = (),
                 seed: int = 0, vocab_size: int = 0) -> None:
        self.device = torch.device(device)
        self.eos_token_ids = list(eos_token_ids)
        self._shared = torch.Generator(device=self.device)  # noise for unseeded requests
        self._shared.manual_seed(seed)
        # Token statistics for penalties; needs the vocabulary size, known to the model runner.
        self.history = TokenHistory(vocab_size, self.device) if vocab_size > 0 else None

    def make_generator(self, params: SamplingParams) -> torch.Generator | None:
        return torch.Generator(device=self.device) if params.seed is not None else None

    def track(self, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> int | None:
        """Start the token history of a request whose params need one; its slot, else None."""
        if not params.uses_penalties:
            return None
        if self.history is None:
            raise ValueError("penalties need a sampler built with vocab_size")
        return self.history.add(prompt_ids, output_ids)

    def release(self, slot: int | None) -> None:
        if slot is not None and self.history is not None:
            self.history.release(slot)

    def release_all(self) -> None:
        if self.history is not None:
            self.history.clear()

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[int]:
        """One token per row of fp32 logits [B, vocab]."""
        return self.sample_batch(logits, rows).token_ids

    def sample_batch(self, logits: torch.Tensor, rows: Sequence[SampleRow],
                     mask: TokenMask | None = None) -> SampledBatch:
        """One token per row of fp32 logits [B, vocab], with logprobs for the rows that ask.
        Tracked rows get their token counted in their history."""
        picks = self._pick(self.process(logits, rows, mask), rows)
        tracked = [(i, r.history_slot) for i, r in enumerate(rows) if r.history_slot is not None and r.record]
        if tracked and self.history is not None:  # a slot comes from track(), so history exists
            self.history.record([slot for _, slot in tracked], _take(picks, [i for i, _ in tracked]))
        logprobs = _logprobs(logits, picks, rows)
        return SampledBatch(picks.tolist(), logprobs)

    def process(self, logits: torch.Tensor, rows: Sequence[SampleRow], mask: TokenMask | None = None) -> torch.Tensor:
        """The logits after the grammar's mask, min_tokens bans, logit_bias and penalties: what
        greedy rows take the argmax of and the others divide by their temperature (a masked
        token stays -inf through all of them). `logits` itself stays untouched."""
        x = logits
        if mask is not None and mask.rows:
            x = logits.clone()
            apply_bitmask(x, mask.rows, mask.bits)
        return self._penalize(self._bias_and_bans(x, rows), rows, logits)

    def probabilities(self, x: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """What rows with temperature > 0 sample from before top-k/top-p, given processed logits:
        the softmax at their temperature, without the tokens below min_p x the top probability
        (renormalized, so that top-p then reads the remaining mass as vLLM's does)."""
        temps = torch.tensor([r.params.temperature for r in rows], dtype=x.dtype, device=x.device)
        probs = torch.softmax(x / temps[:, None], dim=-1)
        filtered = [j for j, r in enumerate(rows) if r.params.min_p > 0]
        if not filtered:
            return probs
        sub = _take(probs, filtered)
        min_p = torch.tensor([rows[j].params.min_p for j in filtered], dtype=x.dtype, device=x.device)
        sub = torch.where(sub >= sub.amax(dim=-1, keepdim=True) * min_p[:, None], sub, 0.0)
        sub = sub / sub.sum(dim=-1, keepdim=True)
        if len(filtered) == len(rows):
            return sub
        return probs.index_copy_(0, torch.tensor(filtered, device=x.device), sub)  # probs is ours

    def distributions(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """The whole distribution each row (temperature > 0, no grammar) samples from, [B, vocab]
        fp32 summing to 1: what _pick draws from, top-k and top-p included (a full sort per row,
        which _pick avoids; speculative decoding's rejection sampling needs every probability)."""
        probs = self.probabilities(self.process(logits, rows), rows).float()
        vocab = probs.shape[1]
        ks = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in rows]
        ps = [r.params.top_p for r in rows]
        if any(ks) or any(p < 1.0 for p in ps):
            vals, order = probs.sort(dim=-1, descending=True)
            k_t = torch.tensor(ks, device=probs.device)
            in_k = torch.arange(vocab, device=probs.device)[None, :] < torch.where(k_t > 0, k_t, vocab)[:, None]
            vals = vals * in_k
            vals = torch.where(k_t[:, None] > 0, vals / vals.sum(-1, keepdim=True), vals)
            p_t = torch.tensor([p if p < 1.0 else float("inf") for p in ps], device=probs.device)
            vals = vals * (in_k & ((vals.cumsum(dim=-1) - vals) < p_t[:, None]))  # as _sample_top_k_top_p
            probs = torch.zeros_like(probs).scatter_(1, order, vals)
        return probs / probs.sum(-1, keepdim=True)

    def _bias_and_bans(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """Only allowed_token_ids kept where given, logit_bias added; before min_tokens outputs, EOS
        and stop tokens cannot be sampled, nor ever the token that would complete a bad word."""
        vocab = logits.shape[1]
        bias = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias.items() if 0 <= t < vocab]
        bans = [(i, t) for i, r in enumerate(rows) if r.output_index < r.params.min_tokens
                for t in (*self.eos_token_ids, *r.params.stop_token_ids) if 0 <= t < vocab]
        bans += [(i, t) for i, r in enumerate(rows) for t in _bad_word_bans(r) if 0 <= t < vocab]
        allowed = [(i, [t for t in r.params.allowed_token_ids if 0 <= t < vocab])
                   for i, r in enumerate(rows) if r.params.allowed_token_ids]
        if not bias and not bans and not allowed:
            return logits
        x = logits.clone()  # the caller's logits stay as the model produced them
        dev = x.device
        for i, ids in allowed:
            keep = torch.full((vocab,), float("-inf"), dtype=x.dtype, device=dev)
            keep[ids] = 0.0
            x[i] += keep
        if bias:
            r, c, b = zip(*bias, strict=True)
            x.index_put_((torch.tensor(r, device=dev), torch.tensor(c, device=dev)),
                         torch.tensor(b, dtype=x.dtype, device=dev), accumulate=True)
        if bans:
            r, c = zip(*bans, strict=True)
            x[list(r), list(c)] = float("-inf")
        return x

    def _penalize(self, x: torch.Tensor, rows: Sequence[SampleRow], raw: torch.Tensor) -> torch.Tensor:
        """Repetition penalty over prompt and output tokens, then frequency and presence penalties
        over output tokens, on the rows that set any (`raw` is the caller's, never written)."""
        idx = [i for i, r in enumerate(rows) if r.params.uses_penalties]
        if not idx:
            return x
        if self.history is None or any(rows[i].history_slot is None for i in idx):
            raise ValueError("a row with penalties has no token history (see Sampler.track)")
        dev = x.device
        params = [rows[i].params for i in idx]
        slots = torch.tensor([rows[i].history_slot for i in idx], device=dev)
        counts = self.history.counts.index_select(0, slots)  # a copy: the drafts are added to it
        drafted = [(j, t) for j, i in enumerate(idx) for t in rows[i].drafted]
        if drafted:
            r, c = zip(*drafted, strict=True)
            counts.index_put_((torch.tensor(r, device=dev), torch.tensor(c, device=dev)),
                              torch.ones(len(r), dtype=counts.dtype, device=dev), accumulate=True)
        in_output = counts > 0
        sub = _take(x, idx)
        if any(p.repetition_penalty != 1.0 for p in params):
            rep = torch.tensor([p.repetition_penalty for p in params], dtype=x.dtype, device=dev)[:, None]
            seen = in_output | self.history.in_prompt.index_select(0, slots)
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            freq = torch.tensor([p.frequency_penalty for p in params], dtype=x.dtype, device=dev)[:, None]
            pres = torch.tensor([p.presence_penalty for p in params], dtype=x.dtype, device=dev)[:, None]
            sub = sub - freq * counts - pres * in_output
        if len(idx) == len(rows):
            return sub
        x = x.clone() if x is raw else x
        return x.index_copy_(0, torch.tensor(idx, device=dev), sub)

    def _pick(self, x: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """One token id per row of processed logits (int64, on their device)."""
        idx = [i for i, r in enumerate(rows) if r.params.temperature > 0]
        if not idx:
            return _argmax(x)
        vocab, dev = x.shape[1], x.device
        sub = [rows[i] for i in idx]
        # Rows are copied out only when some are left behind: each copy moves B x vocab floats.
        probs = self.probabilities(_take(x, idx), sub)
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
            return picks
        out = _argmax(x)  # the greedy rows
        out[idx] = picks
        return out

    def _uniforms(self, rows: Sequence[SampleRow]) -> torch.Tensor:
        """One U[0, 1) draw per row (fp64): from the request's own generator when seeded."""
        u = torch.rand(len(rows), dtype=torch.float64, generator=self._shared, device=self.device)
        for i, r in enumerate(rows):
            if r.generator is not None and r.params.seed is not None:
                r.generator.manual_seed(mix_seed(r.params.seed, r.output_index))
                u[i] = torch.rand(1, dtype=torch.float64, generator=r.generator, device=self.device)[0]
        return u


def bad_word_tail(params: SamplingParams, token_ids: Sequence[int], num_prompt: int) -> tuple[int, ...]:
    """The last outputs (of token_ids[num_prompt:]) that matching the bad words' other tokens needs."""
    need = max((len(w) for w in params.bad_word_ids), default=1) - 1
    return tuple(token_ids[max(num_prompt, len(token_ids) - need):]) if need > 0 else ()


def _bad_word_bans(row: SampleRow) -> list[int]:
    """The last token of each bad word whose other tokens end the row's output (vLLM's rule:
    output tokens only, so a word the prompt ends half-way is not banned)."""
    if not row.params.bad_word_ids:
        return []
    tail = row.recent + row.drafted
    n = len(tail)  # the last-token test first: most words are ruled out there
    return [w[-1] for w in row.params.bad_word_ids
            if len(w) == 1 or (len(w) - 1 <= n and tail[-1] == w[-2] and tail[n - len(w) + 1:] == tuple(w[:-1]))]


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1): natively for CPU logits (one vector pass per row, ~10x torch's)."""
    return cpu_native.argmax_rows(x) if cpu_native.argmax_supported(x) else x.argmax(dim=-1)


def _logprobs(raw: torch.Tensor, picks: torch.Tensor, rows: Sequence[SampleRow]) -> list[TokenLogprobs | None]:
    """For the rows that ask: log_softmax of the raw logits at the sampled token, then at the
    row's `logprobs` most likely tokens, most likely first. Empty when no row asks."""
    idx = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not idx:
        return []
    vocab = raw.shape[1]
    wants = [min(rows[i].params.logprobs or 0, vocab) for i in idx]
    lp = torch.log_softmax(_take(raw, idx).float(), dim=-1)
    chosen_ids = _take(picks, idx)
    chosen = lp.gather(1, chosen_ids[:, None])[:, 0].tolist()
    top_lp, top_ids = lp.topk(max(wants), dim=-1)  # one topk at the largest n; rows keep their own
    top_lp_rows, top_id_rows = top_lp.tolist(), top_ids.tolist()
    out: list[TokenLogprobs | None] = [None] * len(rows)
    for j, (i, tok) in enumerate(zip(idx, chosen_ids.tolist(), strict=True)):
        n = wants[j]
        out[i] = TokenLogprobs(token_ids=[tok, *top_id_rows[j][:n]], logprobs=[chosen[j], *top_lp_rows[j][:n]])
    return out


# The candidates for top-k/top-p come from topk() in growing sizes, each stage only for the rows
# whose nucleus did not fit the previous one, rather than from a full sort of the vocabulary.
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
