"""Beam search (vLLM's `use_beam_search`), run by the gateway over the pipeline as vLLM runs it
over its engine: each step asks for every live beam's next token with the 2 x width likeliest
tokens' logprobs (raw, as the worker scores them), keeps the width likeliest continuations and
sets aside those that end in an end token. The prefix cache holds each beam's tokens so far, so a
step computes one new token per beam. The answer is the best `n` (the width) of the finished and
live beams by vLLM's score: cumulative logprob / length ** length_penalty, the length counting
the prompt and not a final end token.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from rill.services.gateway import info_api
from rill.services.gateway.bodies import CompletionRequest, GenerateBody
from rill.services.gateway.errors import APIError
from rill.services.gateway.fields import NotYet
from rill.services.gateway.requests import prompts_of
from rill.services.gateway.responses import Output
from rill.shared.request_params import SamplingParams, past_the_context
from rill.shared.schema import GenerateRequest, TextDelta

if TYPE_CHECKING:
    from rill.services.gateway.gateway import Gateway

# Runs requests to their end: their outputs in order (openai_api wires the gateway's).
Runner = Callable[[list[GenerateRequest]], Awaitable[list[Output]]]

# Fields beam search cannot honour, with the values that ask nothing of it (kind-aware, as a
# NotYet field's: logprobs 0 asks for logprobs where false does not).
_WHY = "beam search scores the model's own logprobs and answers whole sequences"
_ALONE = {name: NotYet(_WHY, *ok) for name, ok in {
    "temperature": (0.0,), "top_p": (1.0,), "top_k": (0.0, -1.0), "min_p": (0.0,), "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,), "repetition_penalty": (1.0,), "min_tokens": (0.0,), "stream": (False,),
    "echo": (False,), "include_stop_str_in_output": (False,), "logprobs": (False,), "top_logprobs": (),
    "prompt_logprobs": (), "seed": (), "stop": (), "stop_token_ids": (), "logit_bias": (), "allowed_token_ids": (),
    "bad_words": (), "response_format": (), "structured_outputs": (), "guided_json": (), "guided_regex": (),
    "guided_choice": (), "guided_grammar": (), "tools": (), "tool_choice": (), "truncate_prompt_tokens": (),
    "prediction": (),
}.items()}


def check(req: GenerateBody, max_logprobs: int) -> None:
    """The 400 for a field beam search would leave unheeded, naming it (frames refuse it: bodies.py),
    or a width whose 2 x width logprobs a step the server's --max-logprobs does not allow (as vLLM)."""
    if not req.use_beam_search:
        if req.length_penalty not in (None, 1.0):
            raise APIError("length_penalty applies to beam search only (use_beam_search: true).",
                           param="length_penalty")
        return
    if isinstance(req, CompletionRequest) and len(prompts_of(req.prompt)) > 1:
        raise APIError("Beam search takes one prompt.", param="prompt")
    if 2 * (req.n or 1) > max_logprobs:
        raise APIError(f"Beam search of width n asks 2n logprobs a step; this server's --max-logprobs "
                       f"({max_logprobs}) allows n up to {max_logprobs // 2}.", param="n")
    for name, mark in _ALONE.items():
        value = getattr(req, name, None)
        if not mark.accepts(value):
            raise APIError(f"{name} {msgspec.json.encode(value).decode()[:80]} cannot be used with beam search "
                           f"({_WHY}).", param=name)


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)  # the output so far (an end token last when finished)
    logprob: float = 0.0  # cumulative
    finished: bool = False

    def score(self, prompt_len: int, length_penalty: float) -> float:
        length = prompt_len + len(self.tokens) - (1 if self.finished else 0)
        return self.logprob / (length ** length_penalty)

    def best_score(self, prompt_len: int, max_tokens: int, length_penalty: float) -> float:
        """The most a live beam can still score: its logprob only falls as it grows, so at best it
        keeps today's over the length that divides it least (the longest for a positive penalty,
        ending at the next token otherwise)."""
        longest = length_penalty > 0
        length = prompt_len + (max_tokens if longest else len(self.tokens))
        return self.logprob / (length ** length_penalty)


async def search(run: Runner, first: GenerateRequest, width: int, context: int, ends: set[int],
                 length_penalty: float) -> tuple[Output, list[Beam]]:
    """(the first step's output: the prompt's ids and what the prefix cache held of them; the
    best `width` beams, best first). `first` is the request as the body makes it (max_tokens None:
    up to the `context`); each step's requests ask one token with 2 x width logprobs."""
    asked = first.params.max_tokens
    first = msgspec.structs.replace(first, params=SamplingParams(
        temperature=0.0, max_tokens=1, logprobs=2 * width, ignore_eos=True, return_token_ids=True,
        cache_salt=first.params.cache_salt))
    outs = await run([first])
    head, prompt = outs[0], outs[0].prompt_token_ids
    room = context - len(prompt)  # a chat's default fills the context, a completion's is 16 (as the tokenizer's)
    max_tokens = asked or (room if first.kind == "chat" else min(16, room))
    if len(prompt) + max_tokens > context:
        raise APIError(past_the_context(context, len(prompt), max_tokens), param="max_tokens")
    live, done = [Beam()], []
    for step in range(max_tokens):
        if step:
            outs = await run([msgspec.structs.replace(
                first, request_id=f"{first.request_id}-s{step}-{j}", kind="completion", prompt=prompt + b.tokens,
                messages=None, tools=None, add_special_tokens=False) for j, b in enumerate(live)])
        grown: list[Beam] = []
        for beam, out in zip(live, outs, strict=True):
            for top in out.choices[0].logprobs[0].top:
                ended = top.token_id in ends
                (done if ended else grown).append(Beam(beam.tokens + [top.token_id], beam.logprob + top.logprob, ended))
        live = sorted(grown, key=lambda b: b.logprob, reverse=True)[:width]  # one length: the score's order
        if not live or _settled(done, live, width, len(prompt), max_tokens, length_penalty):
            break
    best = sorted(done + live, key=lambda b: b.score(len(prompt), length_penalty), reverse=True)[:width]
    return head, best


def _settled(done: list[Beam], live: list[Beam], width: int, prompt_len: int, max_tokens: int,
             length_penalty: float) -> bool:
    """Whether no live beam can still reach the best `width` finished ones: the answer is known,
    as running on to max_tokens would find it (vLLM's search does)."""
    if len(done) < width:
        return False
    floor = sorted((b.score(prompt_len, length_penalty) for b in done), reverse=True)[width - 1]
    return all(b.best_score(prompt_len, max_tokens, length_penalty) < floor for b in live)


async def end_tokens(gw: Gateway, ignore_eos: bool) -> set[int]:
    """The ids that finish a beam: the tokenizer's end tokens (live replicas publish them)."""
    if ignore_eos:
        return set()
    return set(json.loads(await info_api.tokenizer_info_json(gw))["eos_token_ids"])


async def output(gw: Gateway, body: GenerateBody, first: GenerateRequest, run: Runner) -> Output:
    """The body's beams as an Output of n choices (finish "stop" at an end token, else "length")."""
    ends = await end_tokens(gw, bool(body.ignore_eos))
    penalty = 1.0 if body.length_penalty is None else body.length_penalty
    context = await info_api.served_max_model_len(gw)
    head, beams = await search(run, first, body.n or 1, context, ends, penalty)
    prompt = head.prompt_token_ids
    texts = [reply.text for reply in await asyncio.gather(*(gw.detokenize(_shown(b)) for b in beams))]
    out = Output(len(beams))
    ids = bool(body.return_token_ids)
    for i, (b, text) in enumerate(zip(beams, texts, strict=True)):
        out.add(TextDelta(request_id=first.request_id, offset=0, num_tokens=len(b.tokens), text=text,
                          finish_reason="stop" if b.finished else "length", prompt_tokens=len(prompt),
                          completion_tokens=len(b.tokens), token_ids=b.tokens if ids else [],
                          prompt_token_ids=prompt if ids else [], cached_tokens=head.cached_tokens), i)
    return out


def _shown(beam: Beam) -> Sequence[int]:
    return beam.tokens[:-1] if beam.finished else beam.tokens  # the end token is not text
