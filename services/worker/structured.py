"""Structured outputs on the worker: one llguidance matcher per constrained request.

The worker holds the matchers because it samples: a matcher is advanced by the token sampled
in the same step, before the next step's mask is computed, so the scheduler's plan-ahead
(async scheduling) never samples past an unapplied mask. A request that arrives again (resumed
after preemption, or handed over from a prefill engine) replays its outputs so far into a fresh
matcher, so matcher state needs no transfer. Grammars come checked by the gateway
(services/gateway/structured.py) as llguidance grammar strings; each is compiled once into a
template matcher (LRU cache) that requests deep-copy (n > 1 samples share it).

llguidance over xgrammar, chosen by measurement (scripts/benchmarks.md, "Structured outputs"):
its mask fill and apply cost less per step on CPU, and it needs no torch, so the gateway
validates grammars with it too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from rill.kernels import cpu_native

log = logging.getLogger("rill.worker.structured")

TEMPLATE_CACHE = 128  # compiled grammars kept (most recently used)


class GrammarError(ValueError):
    """The grammar cannot run with this model's tokenizer, or a token broke it."""


class Grammars:
    """Compiled grammars and the token bitmask for a batch of matchers."""

    def __init__(self, model_dir: str, vocab_size: int) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._tokenizer: Any = None  # llguidance.LLTokenizer, built on first use (seconds)
        self._templates: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._failed: str | None = None  # why the tokenizer could not be built
        self._preparing: threading.Thread | None = None

    def prepare_in_background(self) -> None:
        """Start building the tokenizer's token tables (seconds for a large vocabulary) while
        the worker loads and warms up; `wait_prepared` before serving, so that no constrained
        request stalls its whole batch for them."""
        self._preparing = threading.Thread(target=self._prepare, name="grammar-tokenizer", daemon=True)
        self._preparing.start()

    def wait_prepared(self) -> None:
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None

    def _prepare(self) -> None:
        try:
            self._tok()
        except GrammarError:
            pass  # logged; requests with a grammar fail with the reason

    def _tok(self) -> Any:  # llguidance.LLTokenizer
        with self._lock:
            if self._tokenizer is None and self._failed is None:
                try:
                    self._build_tokenizer()
                except Exception as exc:  # a checkpoint without a usable tokenizer serves, unconstrained
                    self._failed = f"this model's tokenizer cannot drive a grammar ({type(exc).__name__}: {exc})"
                    log.info("structured outputs unavailable: %s", self._failed)
            if self._failed is not None:
                raise GrammarError(self._failed)
            return self._tokenizer

    def _build_tokenizer(self) -> None:
        if self._tokenizer is None:
            import llguidance

            from rill.shared.tokenizer_files import load_tokenizer

            start = time.perf_counter()
            model_tok = load_tokenizer(self.model_dir)  # the replicas' loader: the same ids
            backend = model_tok.tokenizer
            backend.no_padding()
            backend.no_truncation()
            # Every id that ends the model's output counts as EOS for the grammar too.
            self._tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=model_tok.eos_token_ids)
            # The first mask computed sets up the tokenizer's tables: here, not in a step.
            first = llguidance.LLMatcher(self._tokenizer, llguidance.LLMatcher.grammar_from_regex("a"), log_level=0)
            first.compute_bitmask()
            log.info("structured outputs ready (llguidance, %d tokens) in %.2f s", self.vocab_size,
                     time.perf_counter() - start)

    def matcher(self, grammar: str, outputs: Sequence[int] = ()) -> Any:  # llguidance.LLMatcher
        """A matcher for `grammar` that has consumed `outputs` (the tokens generated so far)."""
        import llguidance

        template = self._templates.get(grammar)
        if template is None:
            template = llguidance.LLMatcher(self._tok(), grammar, log_level=0)
            if template.is_error():
                raise GrammarError(template.get_error())
            self._templates[grammar] = template
            if len(self._templates) > TEMPLATE_CACHE:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(grammar)
        m = template.deep_copy()
        if outputs and not m.consume_tokens(list(outputs)):
            raise GrammarError(f"the output so far does not match the grammar: {m.get_error()}")
        return m

    def bitmask(self, matchers: Sequence[Any]) -> torch.Tensor:
        """[len(matchers), words] int32: bit t of a row is set when its matcher allows token t
        next (only EOS once the grammar is complete)."""
        mask = torch.full((len(matchers), self.words), -1, dtype=torch.int32)
        # In this thread, one row after another: llguidance's thread pool (LLExecutor) measured
        # ~100x slower per step here, its threads contending with torch's spinning OpenMP ones.
        # (Not llguidance.torch's helpers: importing them sets up torch.compile, seconds.)
        row_bytes = self.words * 4
        base = mask.data_ptr()
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
        return mask

    @staticmethod
    def advance(matcher: Any, token: int) -> str | None:
        """Feed the sampled token; why the matcher broke, or None."""
        if matcher.consume_token(token):
            return None
        return matcher.get_error() or f"token {token} is not allowed here"


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, rows: Sequence[int], mask: torch.Tensor) -> None:
    """In place: rows[i] of logits keeps only the tokens mask[i] allows (the rest -inf)."""
    idx = torch.tensor(rows, dtype=torch.int64)
    if cpu_native.argmax_supported(logits):
        cpu_native.apply_token_bitmask(logits, idx, mask)
        return
    dev = logits.device
    shifts = _SHIFTS.setdefault(dev, torch.arange(32, dtype=torch.int32, device=dev))
    m = mask.to(dev, non_blocking=True)
    allowed = ((m.unsqueeze(-1) >> shifts) & 1).view(m.shape[0], -1)[:, :logits.shape[1]].bool()
    if allowed.shape[1] < logits.shape[1]:  # columns past the mask are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, logits.shape[1] - allowed.shape[1]))
    idx = idx.to(dev)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
