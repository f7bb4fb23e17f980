"""The gateway's beam search against a plain reference of vLLM's algorithm, over a toy model whose
next-token logprobs are a fixed function of the tokens so far: the same beams, and the search
stops once no live beam can still reach the answer instead of running on to max_tokens."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from rill.services.gateway.beam_search import search
from rill.services.gateway.responses import Output
from rill.shared.request_params import SamplingParams
from rill.shared.schema import GenerateRequest, TextDelta, TextLogprob, TopLogprob

VOCAB, END = 8, 7
PROMPT = [1, 2, 3]


def toy_logprobs(ids: list[int], end_bias: float) -> torch.Tensor:
    """Next-token logprobs of a toy model: random per prefix, the end token favoured by end_bias."""
    rng = random.Random(hash(tuple(ids)))
    logits = torch.tensor([rng.gauss(0, 2) for _ in range(VOCAB)], dtype=torch.float64)
    logits[END] += end_bias
    return torch.log_softmax(logits, -1)


def reference(width: int, max_tokens: int, penalty: float, end_bias: float) -> list[tuple[list[int], float]]:
    """vLLM's search, every step up to max_tokens: (output ids, score), best first."""
    live: list[tuple[list[int], float]] = [([], 0.0)]
    done: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        grown = []
        for toks, lp in live:
            top = toy_logprobs(PROMPT + toks, end_bias).topk(2 * width)
            for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                (done if t == END else grown).append((toks + [t], lp + v))
        live = sorted(grown, key=lambda b: b[1], reverse=True)[:width]
    scored = [(t, lp / (len(PROMPT) + len(t) - (t[-1] == END)) ** penalty) for t, lp in done + live]
    return sorted(scored, key=lambda b: b[1], reverse=True)[:width]


@pytest.mark.parametrize("penalty", [1.0, 0.0, -0.5, 2.0])
@pytest.mark.parametrize("end_bias", [0.0, 3.0])
def test_search_finds_the_reference_beams_and_stops_early(penalty: float, end_bias: float) -> None:
    width, max_tokens = 3, 40
    calls: list[int] = []

    async def run(reqs: list[GenerateRequest]) -> list[Output]:
        calls.append(len(reqs))
        outs = []
        for req in reqs:
            ids = list(req.prompt) if isinstance(req.prompt, list) else PROMPT
            lp = toy_logprobs(ids, end_bias)
            top = lp.topk(req.params.logprobs or 0)
            tops = [TopLogprob(str(t), v, t) for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True)]
            out = Output()
            out.add(TextDelta(request_id=req.request_id, offset=0, num_tokens=1, text="x", finish_reason="length",
                              logprobs=[TextLogprob("x", tops[0].logprob, tops[0].token_id, tops)],
                              prompt_token_ids=PROMPT))
            outs.append(out)
        return outs

    first = GenerateRequest(request_id="b", reply_to="r", kind="completion", prompt="text",
                            params=SamplingParams(max_tokens=max_tokens), arrival_time=0.0)
    head, beams = asyncio.run(search(run, first, width, 1000, {END}, penalty))
    want = reference(width, max_tokens, penalty, end_bias)
    assert head.prompt_token_ids == PROMPT
    assert [b.tokens for b in beams] == [t for t, _ in want]
    for b, (_, score) in zip(beams, want, strict=True):
        assert b.score(len(PROMPT), penalty) == pytest.approx(score, rel=1e-9)
    if end_bias and penalty <= 1.0:  # beams end early: the search saw the answer long before max_tokens
        assert len(calls) < max_tokens, calls
