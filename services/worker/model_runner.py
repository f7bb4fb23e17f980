"""The worker's persistent per-request state and one step of the model.

As in vLLM V1, the scheduler sends a request's full data once (NewRequestData) and then only
diffs (new block ids, how many tokens to run). The runner keeps each request's tokens, block
table and progress, builds the flattened batch for a StepPlan, runs the model, and samples one
token for every request that reached the end of its known tokens. A request with speculative
drafts runs them after its last token, samples every one of those positions as it would without
them, and keeps the drafts its samples agree with (services/scheduler/speculation.py says why
that is exact).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from rill.kernels.ops import make_attention_metadata
from rill.services.worker.cpu_setup import (
    choose_cpu_kernels,
    configure_cpu_threads,
    cpu_has_int8_dot,
    keep_freed_memory,
    resolve_device,
)
from rill.services.worker.cuda_graphs import DecodeGraphs, graphs_wanted
from rill.services.worker.draft_model import DraftModel, DraftRow
from rill.services.worker.dtype_choice import resolve_dtype
from rill.services.worker.llama import TORCH_DTYPES, LlamaModel
from rill.services.worker.plan_check import Limits, PlanError, check_plan
from rill.services.worker.sampler import Sampler, SampleRow, TokenMask, bad_word_tail, mix_seed
from rill.services.worker.structured import GrammarError, Grammars
from rill.services.worker.tensor_parallel import Shard, TPGroup
from rill.shared.config import ModelConfig
from rill.shared.request_params import SamplingParams
from rill.shared.schema import DRAFT_PLACEHOLDER, NewRequestData, StepPlan, StepResult, TokenLogprobs

log = logging.getLogger("rill.worker")


PROMPT_LOGPROB_ROWS = 256  # prompt positions scored per LM-head slice


@dataclass
class RequestState:
    request_id: str
    token_ids: list[int]  # prompt + every sampled token
    block_ids: list[int]
    num_computed: int  # tokens whose KV is in the cache
    params: SamplingParams
    num_prompt: int  # token_ids[:num_prompt] is the prompt; the rest are outputs
    generator: torch.Generator | None
    history_slot: int | None = None  # its token statistics in the sampler (requests with penalties)
    # Prompt logprobs gathered chunk by chunk (first token: no logprobs), sent with the first
    # output token; None when not asked for or not computable here (a prompt whose KV came
    # from elsewhere: a shared prefix, another sample, a resume).
    prompt_lps: list[TokenLogprobs] | None = None
    matcher: Any = None  # structured outputs: its llguidance matcher (structured.py)
    error: str | None = None  # why it cannot go on (a grammar that broke); reported when sampled


@dataclass
class Sampled:
    """What a step returns (see StepResult): request ids, their tokens, logprobs, tokens per request."""

    request_ids: list[str]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    num_tokens: list[int]  # empty: one token each

    @classmethod
    def nothing(cls) -> Sampled:
        return cls([], [], [], [])


class ModelRunner:
    def __init__(self, model_dir: str, dtype: str = "auto", device: str = "auto", num_blocks: int = 256,
                 block_size: int = 16, max_model_len: int | None = None, seed: int = 0,
                 model: LlamaModel | None = None, quantization: str = "none", tp: TPGroup | None = None,
                 draft_model: str | None = None) -> None:
        """quantization: "none", "int8" (W8A8 linear layers, CPU only) or "gguf" (the file's own
        blocks; see LlamaModel.load). A
        `model` passed in is used as loaded, its own quantization included. `tp`: this process is
        one rank of a tensor-parallel group; it loads its shard, and only rank 0 samples.
        `draft_model`: a checkpoint of the same vocabulary that proposes speculative drafts."""
        self.device = resolve_device(device)
        self.tp = tp
        if self.device == "cpu":
            # first: "auto" measures GEMMs with the threads that will serve
            configure_cpu_threads(tp.size if tp else 1)
            keep_freed_memory()
        self.dtype = resolve_dtype(dtype, self.device)
        cfg = model.cfg if model is not None else ModelConfig.from_dir(model_dir)
        if self.device == "cpu" and model is None:
            # Before the layers are built: each one reads its measured GEMM choice when built.
            choose_cpu_kernels(Shard.plan(cfg, tp.rank, tp.size).kernel_config(cfg) if tp else cfg,
                               TORCH_DTYPES[self.dtype], quantization, model_dir)
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.model = model or LlamaModel.load(model_dir, TORCH_DTYPES[self.dtype], self.device,
                                              max_positions=self.max_model_len, quantization=quantization, tp=tp)
        self.quantization = self.model.quantization
        if self.quantization == "int8" and self.device == "cpu" and not cpu_has_int8_dot():
            log.warning("--quantization int8 on a CPU without VNNI/AMX int8 instructions: its int8 GEMMs "
                        "run far slower than %s ones here (scripts/benchmarks.md); serve with --quantization none", self.dtype)
        self.cfg = self.model.cfg
        self.draft = DraftModel(draft_model, self.model, self.max_model_len) if draft_model else None
        self.block_size = block_size
        self.num_blocks = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.requests: dict[str, RequestState] = {}
        self.graphs: DecodeGraphs | None = None  # captured decode steps (CUDA + Triton only)
        self.sampler = Sampler(self.device, self.cfg.eos_token_ids, seed, vocab_size=self.cfg.vocab_size)
        self.grammars = Grammars(model_dir, self.cfg.vocab_size)
        self.resize_kv_cache(num_blocks)
        # Logits of the rows sampled by the last step, in result order (for tests and debugging).
        self.last_logits: torch.Tensor | None = None
        self._prompt_out: dict[str, list[TokenLogprobs]] = {}  # this step's finished prompt logprobs
        self._errors: dict[str, str] = {}  # this step's requests that failed on their own

    def resize_kv_cache(self, num_blocks: int) -> None:
        """(Re)allocate the cache, as at start-up; every request is forgotten with its KV."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self._forget_all()
        self.graphs = None  # captured against the old cache
        self.kv_caches = []  # drop the old cache before allocating the new one
        self.kv_caches = self.model.allocate_kv_cache(num_blocks, self.block_size)
        if self.draft is not None:
            self.draft.resize_kv_cache(num_blocks, self.block_size)
        self.num_blocks = num_blocks

    def reset(self) -> None:
        """Forget every request (the scheduler restarted)."""
        self._forget_all()
        self.last_logits = None

    def _forget_all(self) -> None:
        self.requests.clear()
        self.sampler.release_all()
        if self.draft is not None:
            self.draft.forget_all()

    def _forget(self, rid: str) -> None:
        state = self.requests.pop(rid, None)
        if state is not None:
            self.sampler.release(state.history_slot)
        if self.draft is not None:
            self.draft.forget(rid)

    # --------------------------------------------------------------------------------- a step

    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        try:
            check_plan(plan, self.requests, Limits(self.cfg.vocab_size, self.num_blocks, self.block_size,
                                                   self.max_model_len, self.tp is not None, self.draft is not None))
        except PlanError as exc:
            log.warning("step %d refused: %s", plan.step_id, exc)
            return StepResult(step_id=plan.step_id, request_ids=[], token_ids=[], error=str(exc))
        self._prompt_out.clear()
        self._errors = {}
        try:
            self._apply_diffs(plan)
            out = self._run(plan)
        except Exception as exc:  # one bad step must not take the worker down
            if self.tp is not None:  # ...but a rank that failed has left its peers mid-collective
                raise
            log.exception("step %d failed", plan.step_id)
            return StepResult(step_id=plan.step_id, request_ids=[], token_ids=[],
                              error=f"{type(exc).__name__}: {exc}")
        prompt = [self._prompt_out.get(rid, []) for rid in out.request_ids] if self._prompt_out else []
        return StepResult(step_id=plan.step_id, request_ids=out.request_ids, token_ids=out.token_ids,
                          forward_ms=(time.perf_counter() - start) * 1e3, logprobs=out.logprobs,
                          prompt_logprobs=prompt, errors=self._errors, num_tokens=out.num_tokens)

    def _apply_diffs(self, plan: StepPlan) -> None:
        for rid in plan.finished_request_ids:
            self._forget(rid)
        for new in plan.new_requests:
            self._forget(new.request_id)  # sent again without being finished: start over
            num_prompt = len(new.token_ids) - new.num_output_tokens
            self.requests[new.request_id] = state = RequestState(
                request_id=new.request_id, token_ids=list(new.token_ids), block_ids=list(new.block_ids),
                num_computed=new.num_computed_tokens, params=new.params, num_prompt=num_prompt,
                generator=self.sampler.make_generator(new.params),
                # A resumed request's outputs so far count for its penalties too.
                history_slot=self.sampler.track(new.params, new.token_ids[:num_prompt],
                                                new.token_ids[num_prompt:]),
                prompt_lps=[TokenLogprobs([new.token_ids[0]], [])]
                if new.params.prompt_logprobs is not None and new.num_output_tokens == 0
                and new.num_computed_tokens == 0 else None)
            if new.params.grammar is not None:
                try:  # a resumed or handed-over request replays its outputs so far
                    state.matcher = self.grammars.matcher(new.params.grammar, new.token_ids[num_prompt:])
                except GrammarError as exc:
                    state.error = f"structured output: {exc}"
        for rid, blocks in zip(plan.cached_request_ids, plan.cached_new_block_ids, strict=True):
            self.requests[rid].block_ids.extend(blocks)

    def _run(self, plan: StepPlan) -> Sampled:
        self.last_logits = None
        if not plan.scheduled_request_ids:
            return Sampled.nothing()
        states = [self.requests[rid] for rid in plan.scheduled_request_ids]
        counts = plan.num_scheduled_tokens
        drafts, draft_q = self._propose(states, plan.spec_token_ids) if plan.spec_token_ids \
            else ([[] for _ in states], {})
        if self.graphs is not None and self.graphs.fits(counts):
            return self._run_graph(states)
        input_ids: list[int] = []
        for s, n, d in zip(states, counts, drafts, strict=True):
            input_ids.extend(s.token_ids[s.num_computed:s.num_computed + n - len(d)])
            input_ids.extend(d)
        positions, meta = make_attention_metadata(
            [s.block_ids for s in states], [s.num_computed for s in states], counts, self.block_size,
            self.device)
        # A request samples when this step reaches the end of its known tokens; a partial
        # prompt chunk does not. One with drafts samples at its last token and every draft.
        sampled = [i for i, (s, n, d) in enumerate(zip(states, counts, drafts, strict=True))
                   if s.num_computed + n - len(d) == len(s.token_ids)]
        qsl = meta.query_start_loc_host
        rows = [r for i in sampled for r in range(qsl[i + 1] - 1 - len(drafts[i]), qsl[i + 1])]
        num_sample_rows = len(rows)
        # Prompt logprobs: position p's logits score prompt token p + 1.
        prompt_spans: list[tuple[RequestState, int, int, int]] = []  # (request, first row, rows, position)
        for i, (s, n) in enumerate(zip(states, counts, strict=True)):
            scored = min(s.num_computed + n, s.num_prompt - 1) - s.num_computed
            if s.prompt_lps is not None and scored > 0:
                prompt_spans.append((s, len(rows), scored, s.num_computed))
                rows.extend(range(qsl[i], qsl[i] + scored))
        with torch.inference_mode():
            hidden = self.model.final_hidden(torch.tensor(input_ids, dtype=torch.int64, device=self.device),
                                             positions, meta, self.kv_caches,
                                             torch.tensor(rows, dtype=torch.int64, device=self.device))
            for s, n in zip(states, counts, strict=True):
                s.num_computed += n
            for s, first, num, start in prompt_spans:
                self._score_prompt(s, hidden[first:first + num], start)
            if not sampled:
                return Sampled.nothing()
            out = self._sample(states, sampled, self.model.logits(hidden[:num_sample_rows]),
                               [drafts[i] for i in sampled], [draft_q.get(i) for i in sampled])
            if self.draft is not None:
                for s, d in zip(states, drafts, strict=True):
                    if d:
                        self.draft.accepted(s.request_id, s.num_computed)
            return out

    def _propose(self, states: list[RequestState],
                 spec: list[list[int]]) -> tuple[list[list[int]], dict[int, torch.Tensor]]:
        """The plan's drafts, placeholders filled in by the draft model, and the distributions
        the sampled requests' drafts were drawn from (by batch index)."""
        wanted = [i for i, d in enumerate(spec) if d and d[0] == DRAFT_PLACEHOLDER]
        if not wanted or self.draft is None:
            return spec, {}
        rows = [DraftRow(states[i].request_id, states[i].token_ids, states[i].num_computed, states[i].block_ids,
                         len(spec[i]), states[i].params, len(states[i].token_ids) - states[i].num_prompt,
                         states[i].history_slot)
                for i in wanted]
        drafts, qs = list(spec), {}
        for i, proposal in zip(wanted, self.draft.propose(rows, self.sampler), strict=True):
            drafts[i] = proposal.tokens
            if proposal.q is not None:
                qs[i] = proposal.q
        return drafts, qs

    def _score_prompt(self, s: RequestState, hidden: torch.Tensor, start: int) -> None:
        """Append the logprobs of prompt tokens start + 1 .. start + len(hidden) (slices of rows, so
        a long chunk never holds a whole [rows, vocab] logits matrix)."""
        assert s.prompt_lps is not None and s.params.prompt_logprobs is not None
        top = min(s.params.prompt_logprobs, self.cfg.vocab_size)
        for lo in range(0, hidden.shape[0], PROMPT_LOGPROB_ROWS):
            logits = self.model.logits(hidden[lo:lo + PROMPT_LOGPROB_ROWS])
            if self.tp is not None and not self.tp.lead:
                continue  # its part of the gather; rank 0 scores
            lp = torch.log_softmax(logits, dim=-1)
            targets = s.token_ids[start + lo + 1:start + lo + 1 + lp.shape[0]]
            chosen = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])
            ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()  # vLLM's: 1 + the tokens likelier than it
            top_lp, top_ids = lp.topk(top, dim=-1) if top else (lp[:, :0], lp[:, :0].long())
            for t, c, tl, ti, r in zip(targets, chosen[:, 0].tolist(), top_lp.tolist(), top_ids.tolist(), ranks,
                                       strict=True):
                s.prompt_lps.append(TokenLogprobs(token_ids=[t, *ti], logprobs=[c, *tl], rank=r))

    def _run_graph(self, states: list[RequestState]) -> Sampled:
        """A pure-decode step through a captured CUDA graph (same results as `_run`)."""
        assert self.graphs is not None
        sampled = [i for i, s in enumerate(states) if s.num_computed + 1 == len(s.token_ids)]
        with torch.inference_mode():
            all_logits = self.graphs.run([s.token_ids[s.num_computed] for s in states],
                                         [s.num_computed for s in states], [s.block_ids for s in states])
            for s in states:
                s.num_computed += 1
            if not sampled:
                return Sampled.nothing()
            # A copy: the graph's output buffer is overwritten by the next replay.
            logits = all_logits.clone() if len(sampled) == len(states) else \
                all_logits.index_select(0, torch.tensor(sampled, device=all_logits.device))
            return self._sample(states, sampled, logits)

    def _sample(self, states: list[RequestState], sampled: list[int], logits: torch.Tensor,
                drafts: list[list[int]] | None = None, draft_q: list[torch.Tensor | None] | None = None) -> Sampled:
        """Sample every row of `logits`: one per request at `sampled`, then one per draft of the
        request (`drafts`, aligned with `sampled`). Each request keeps its drafts up to the first
        its sample disagrees with, plus that sample; drafts drawn from a distribution q
        (`draft_q`) are verified by rejection sampling instead. Kept tokens are appended."""
        drafts = drafts or [[] for _ in sampled]
        draft_q = draft_q or [None for _ in sampled]
        if self.tp is not None and not self.tp.lead:  # rank 0 samples; the others append its tokens
            for i, tok in zip(sampled, self.tp.broadcast_tokens(None, len(sampled)), strict=True):
                states[i].token_ids.append(tok)
            return Sampled.nothing()
        rows: list[SampleRow] = []
        for i, d in zip(sampled, drafts, strict=True):
            s = states[i]
            first = len(s.token_ids) - s.num_prompt  # output index of its next token
            tail = bad_word_tail(s.params, s.token_ids, s.num_prompt)
            rows += [SampleRow(s.params, first + j, s.generator, s.history_slot, tuple(d[:j]), record=not d,
                               recent=tail) for j in range(len(d) + 1)]
        out = self.sampler.sample_batch(logits, rows, self._token_mask([states[i] for i in sampled], drafts))
        if self.tp is not None:
            self.tp.broadcast_tokens(out.token_ids, len(sampled))
        result = Sampled.nothing()
        kept_rows: list[int] = []
        at = 0
        for i, d, q in zip(sampled, drafts, draft_q, strict=True):
            s = states[i]
            picks = out.token_ids[at:at + len(d) + 1]
            if q is not None:  # the drafts that stand, then a replacement or the sample after the last
                picks = self._rejection_sample(logits[at:at + len(d)], rows[at:at + len(d)], d, q) or [*d, picks[-1]]
            accepted = next((j for j, (tok, draft) in enumerate(zip(picks, d, strict=False)) if tok != draft), len(d))
            s.num_computed -= len(d) - accepted  # rejected drafts' KV: overwritten by later steps
            if s.prompt_lps is not None and len(s.token_ids) == s.num_prompt:  # its first output token
                self._prompt_out[s.request_id], s.prompt_lps = s.prompt_lps, None
            if d and s.history_slot is not None and self.sampler.history is not None:  # penalties count what stood
                self.sampler.history.record([s.history_slot] * (accepted + 1),
                                            torch.tensor(picks[:accepted + 1], device=logits.device))
            for tok in picks[:accepted + 1]:
                if s.matcher is not None and s.error is None:
                    why = Grammars.advance(s.matcher, tok)
                    if why is not None:
                        s.error = f"structured output: {why}"
                s.token_ids.append(tok)
            if s.error is not None:  # a request whose grammar broke fails alone; the batch goes on
                self._errors[s.request_id] = s.error
            else:
                result.request_ids.append(s.request_id)
                result.token_ids.extend(picks[:accepted + 1])
                result.num_tokens.append(accepted + 1)
                kept_rows.extend(range(at, at + accepted + 1))
            at += len(d) + 1
        # Raw logits of the returned tokens (for tests and debugging): the sampler never writes into them.
        self.last_logits = logits if len(kept_rows) == logits.shape[0] else \
            logits.index_select(0, torch.tensor(kept_rows, dtype=torch.int64, device=logits.device))
        if out.logprobs:
            result.logprobs = [out.logprobs[r] for r in kept_rows]
        if len(result.token_ids) == len(result.request_ids):
            result.num_tokens = []  # one each: the common case carries nothing extra
        return result

    def _rejection_sample(self, logits: torch.Tensor, rows: list[SampleRow], drafts: list[int],
                          q: torch.Tensor) -> list[int]:
        """Speculative sampling (Leviathan et al.) of drafts drawn from q: draft j stands with
        probability min(1, p_j(d) / q_j(d)); the first that does not is replaced by a draw from
        max(p_j - q_j, 0), renormalised (it never holds d_j, whose p_j(d) < q_j(d) then). Returns
        the drafts kept and that replacement, or [] when every draft stands."""
        p = self.sampler.distributions(logits, rows)
        index = torch.arange(len(drafts), device=p.device)
        tokens = torch.tensor(drafts, device=p.device)
        ratio = (p[index, tokens] / q[index, tokens].to(p.device)).tolist()
        gen = self._draw_generator(rows[0])
        u = torch.rand(len(drafts), dtype=torch.float64, generator=gen, device=p.device).tolist()
        for j, (r, uj) in enumerate(zip(ratio, u, strict=True)):
            if uj < r:
                continue
            residual = (p[j] - q[j].to(p.device)).clamp_min_(0)
            if float(residual.sum()) <= 0:  # p_j == q_j up to rounding: the draft stands
                continue
            replacement = int(torch.multinomial(residual / residual.sum(), 1, generator=gen)[0])
            return [*drafts[:j], replacement]
        return []

    def _draw_generator(self, row: SampleRow) -> torch.Generator | None:
        """Rejection sampling's draws for a seeded request: from its generator, seeded apart
        from the sampler's own draws (so they stay reproducible)."""
        if row.generator is None or row.params.seed is None:
            return None
        row.generator.manual_seed(mix_seed(row.params.seed ^ 0x5EC0DE, row.output_index))
        return row.generator

    def _token_mask(self, states: list[RequestState], drafts: list[list[int]]) -> TokenMask | None:
        """The grammar masks of the constrained sampling rows: one per request in `states`, then
        one per draft, each for the matcher's state after the drafts before it. A draft the grammar
        refuses is masked out of its own row, so it is rejected there; the rows after it are left
        unmasked (never kept). The matchers end where they started."""
        rows: list[int] = []
        masks: list[torch.Tensor] = []
        at = 0
        for s, d in zip(states, drafts, strict=True):
            if s.matcher is not None and s.error is None:
                consumed = 0
                for j in range(len(d) + 1):
                    rows.append(at + j)
                    masks.append(self.grammars.bitmask([s.matcher]))
                    if j == len(d) or s.matcher.try_consume_tokens([d[j]]) != 1:  # (consume_token would break it)
                        break
                    consumed += 1
                if consumed:
                    s.matcher.rollback(consumed)
            at += len(d) + 1
        return TokenMask(rows, torch.cat(masks)) if rows else None

    # ------------------------------------------------------------------------------ warm-up

    @property
    def room(self) -> int:
        """The most tokens one request can hold: its context length, or the whole KV cache."""
        return min(self.max_model_len, self.num_blocks * self.block_size)

    def warmup(self, num_tokens: int = 16, context: int = 0) -> float:
        """Run one throwaway prompt step of `num_tokens` (first-call kernel set-up, memory
        profiling, timing), after `context` tokens of the same prompt run first in steps of at
        most `num_tokens`; returns the seconds of that last step."""
        num_tokens = max(1, min(num_tokens, self.room))
        context = max(0, min(context, self.room - num_tokens))
        rid, total = "__rill_warmup__", context + num_tokens
        new = NewRequestData(request_id=rid, token_ids=[0] * total, params=SamplingParams(temperature=0.0),
                             block_ids=list(range(-(-total // self.block_size))))
        chunks = [min(num_tokens, context - at) for at in range(0, context, num_tokens)] + [num_tokens]
        seconds = 0.0
        try:
            for i, n in enumerate(chunks):
                plan = StepPlan(step_id=-1, new_requests=[new] if i == 0 else [], cached_request_ids=[] if i == 0 else [rid],
                                cached_new_block_ids=[] if i == 0 else [[]], scheduled_request_ids=[rid],
                                num_scheduled_tokens=[n])
                start = time.perf_counter()
                result = self.execute(plan)
                seconds = time.perf_counter() - start
                if result.error:
                    raise RuntimeError(f"warm-up step failed: {result.error}")
        finally:
            self._forget(rid)
            self.last_logits = None
        if self.graphs is None and graphs_wanted(self.device, self.model):
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, self.max_model_len)
            self.graphs.capture()
        return seconds
