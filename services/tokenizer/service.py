"""Tokenizer replicas: chat template + text -> token ids, validation, routing to an engine.

Stateless: replicas share the requests stream through one consumer group, so any replica
takes any request. A replica acks a request in the same atomic step that forwards it (or
answers it with an error), so a killed replica's requests stay pending: it redoes them itself
on restart, or a live replica claims them once idle for CLAIM_IDLE_MS. Either way a request
reaches the engine exactly once, since a step whose ack finds the entry already acked sends
nothing.
"""

from __future__ import annotations

import logging
import time

import msgspec
import redis
from msgspec import Struct

from rill.shared.bus import CLAIM_IDLE_MS, MAXLEN, TOKENIZER_GROUP, Backoff, Bus, Entry
from rill.shared.config import ModelConfig
from rill.shared.lifecycle import POLL_MS, StopFlag
from rill.shared.schema import ErrorReply, GenerateRequest, TokenizedRequest, generate_decoder

log = logging.getLogger("rill.tokenizer")


class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


class Tokenizer:
    """Turns a GenerateRequest into a TokenizedRequest, or raises RequestError."""

    def __init__(self, model_dir: str, max_model_len: int) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.config = ModelConfig.from_dir(model_dir)
        self.max_model_len = max_model_len
        eos = set(self.config.eos_token_ids)
        if self.tok.eos_token_id is not None:
            eos.add(self.tok.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self.vocab_size = max(self.config.vocab_size, len(self.tok))

    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.kind == "chat":
            if not req.messages:
                raise RequestError("messages must be a non-empty list", "messages")
            if self.tok.chat_template is None:
                raise RequestError("this model has no chat template; use /v1/completions", "messages")
            try:
                out = self.tok.apply_chat_template([{"role": m.role, "content": m.content} for m in req.messages],
                                                   add_generation_prompt=True, tokenize=True)
            except Exception as exc:  # a template can reject roles or orderings
                raise RequestError(f"the chat template rejected the messages: {exc}", "messages") from exc
            # transformers 5 returns a BatchEncoding here; older versions a plain list.
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        if isinstance(req.prompt, str):
            return list(self.tok(req.prompt, add_special_tokens=True)["input_ids"])
        if isinstance(req.prompt, list):
            bad = [t for t in req.prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"token id {bad[0]} is out of range [0, {self.vocab_size})", "prompt")
            return list(req.prompt)
        raise RequestError("prompt must be a string or a list of token ids", "prompt")

    def __call__(self, req: GenerateRequest) -> TokenizedRequest:
        ids = self.prompt_ids(req)
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        n = len(ids)
        max_tokens = req.params.max_tokens
        if n >= self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt has {n} tokens, leaving no room for the completion. Please shorten the prompt.",
                "messages" if req.kind == "chat" else "prompt")
        if max_tokens is None:
            max_tokens = self.max_model_len - n if req.kind == "chat" else min(16, self.max_model_len - n)
        if n + max_tokens > self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion). "
                "Please reduce the length of the prompt or completion.", "max_tokens")
        bad_stop = [t for t in req.params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise RequestError(f"stop token id {bad_stop[0]} is out of range", "stop_token_ids")
        params = msgspec.structs.replace(req.params, max_tokens=max_tokens)
        return TokenizedRequest(request_id=req.request_id, reply_to=req.reply_to, prompt_token_ids=ids,
                                params=params, eos_token_ids=self.eos_token_ids,
                                arrival_time=req.arrival_time, priority=req.priority)


class Router:
    """Picks an engine for each request: the one with the fewest requests we sent lately.

    Good enough for data-parallel replicas of equal size; the registry lives in Redis.
    """

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.sent: dict[int, int] = {}

    def pick(self) -> int:
        members = self.bus.r.smembers(self.bus.streams.engines_key())
        engines = sorted(int(m) for m in members) or [0]
        choice = min(engines, key=lambda e: self.sent.get(e, 0))
        self.sent[choice] = self.sent.get(choice, 0) + 1
        return choice


CLAIM_EVERY_S = 1.0  # how often a replica looks for a dead replica's requests
TRIM_EVERY_S = 2.0  # trimming requests every tokenizer has read and acked
REAP_EVERY_S = 30.0  # forgetting the consumer names of dead replicas


def run(redis_url: str, prefix: str, model_dir: str, max_model_len: int, consumer: str,
        stop: StopFlag | None = None, claim_idle_ms: int | None = CLAIM_IDLE_MS) -> None:
    """Serve until `stop` is set (SIGTERM/SIGINT by default). `claim_idle_ms`: take over other
    replicas' requests unacked that long (None: never). Broker errors never end the loop: it
    backs off, reconnects and first redoes its own unacked requests."""
    stop = stop if stop is not None else StopFlag()
    bus = Bus(redis_url, prefix, name=consumer)
    tokenizer = Tokenizer(model_dir, max_model_len)
    router = Router(bus)
    stream = bus.streams.requests
    backoff = Backoff()
    log.info("tokenizer %s ready (max_model_len=%d)", consumer, max_model_len)
    recover = True  # first finish what this consumer took before a restart or a broker error
    next_claim = next_trim = next_reap = time.monotonic()  # at start too: we may replace a dead replica
    try:
        while not stop:
            try:
                if recover:
                    bus.ensure_group(stream, TOKENIZER_GROUP)
                    while not stop:
                        mine = bus.read_group(stream, TOKENIZER_GROUP, consumer, block_ms=None, count=64,
                                              pending=True)
                        if not mine:
                            break
                        handle_entries(bus, tokenizer, router, mine)
                    recover = False
                entries = bus.read_group(stream, TOKENIZER_GROUP, consumer, block_ms=POLL_MS, count=64)
                handle_entries(bus, tokenizer, router, entries)
                now = time.monotonic()
                if claim_idle_ms is not None and now >= next_claim:
                    for batch in bus.claim(stream, TOKENIZER_GROUP, consumer, claim_idle_ms):
                        log.info("claimed %d requests abandoned by another tokenizer", len(batch))
                        handle_entries(bus, tokenizer, router, batch)
                    next_claim = now + CLAIM_EVERY_S
                if now >= next_trim:
                    bus.trim_consumed(stream)
                    next_trim = now + TRIM_EVERY_S
                if now >= next_reap:
                    bus.reap_consumers(stream, TOKENIZER_GROUP)
                    next_reap = now + REAP_EVERY_S
                backoff.reset()
            except redis.RedisError as exc:  # broker restarting or unreachable: retry, redo unacked work
                if not backoff.failures:  # once per outage; the retries that follow are quiet
                    log.warning("broker error, reconnecting with backoff: %r", exc)
                delay = backoff.next()
                recover = True
                stop.wait(delay)
    finally:
        bus.close()
        log.info("tokenizer %s stopped", consumer)


def handle_entries(bus: Bus, tokenizer: Tokenizer, router: Router, entries: list[Entry]) -> None:
    """Tokenize each entry; ack it and forward its output in one atomic step per entry, so an
    entry redone by another replica after a crash or a claim is forwarded exactly once."""
    if not entries:
        return
    items = [(entry_id, handle(bus, tokenizer, router, data)) for entry_id, data in entries]
    bus.ack_and_send_many(bus.streams.requests, TOKENIZER_GROUP, items)


def handle(bus: Bus, tokenizer: Tokenizer, router: Router, data: bytes) -> list[tuple[str, Struct, int]]:
    """What one request entry turns into: (stream, message, maxlen) sends, none if it is malformed."""
    try:
        req = generate_decoder.decode(data)
    except msgspec.DecodeError as exc:
        log.warning("dropping malformed request entry: %s", exc)
        return []
    try:
        out = tokenizer(req)
    except RequestError as exc:
        return [(req.reply_to, ErrorReply(request_id=req.request_id, message=str(exc), status=exc.status,
                                          param=exc.param), MAXLEN["reply"])]
    except Exception as exc:  # never let one request take the replica down
        log.exception("tokenizing %s failed", req.request_id)
        return [(req.reply_to, ErrorReply(request_id=req.request_id, message=f"tokenization failed: {exc}",
                                          status=500, type="server_error"), MAXLEN["reply"])]
    return [(bus.streams.engine_in(router.pick()), out, MAXLEN["engine_in"])]
