"""Tokenizer replicas: chat template + text -> token ids, validation, routing to an engine.

Stateless: replicas share every gateway's requests stream through one consumer group, so any
replica takes any request. A replica acks a request in the same atomic step that forwards it (or
answers it with an error), so a killed replica's requests stay pending: it redoes them itself
on restart, or a live replica claims them once idle for CLAIM_IDLE_MS. Either way a request
reaches the engine exactly once, since a step whose ack finds the entry already acked sends
nothing.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import redis
from msgspec import Struct

from rill.services.tokenizer.chat_template import (
    ChatTemplate,
    ContinueError,
    TemplateError,
    load_templates,
    request_template,
    template_kwargs,
    template_messages,
)
from rill.services.tokenizer.router import DEFAULT_POLICY, Router
from rill.services.tokenizer.tool_prompt import calls_in_content, history_as_text, tools_in_system, with_tools
from rill.shared.bus import CLAIM_IDLE_MS, Bus, Entry
from rill.shared.config import ModelConfig
from rill.shared.group_consumer import serve_streams
from rill.shared.heartbeat import gateway_request_streams, replica_heartbeat
from rill.shared.lifecycle import StopFlag
from rill.shared.request_params import TEMPLATE_FIELDS, ChatMessage, past_the_context
from rill.shared.schema import (
    DetokenizeRequest,
    ErrorReply,
    GenerateRequest,
    Routed,
    TokenizedRequest,
    TokenizeReply,
    TokenizeRequest,
    tokenizer_input_decoder,
)
from rill.shared.streams import TOKENIZER_GROUP
from rill.shared.tokenizer_files import fim_tokens, load_tokenizer

log = logging.getLogger("rill.tokenizer")


class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


class Tokenizer:
    """Turns a GenerateRequest into a TokenizedRequest, or raises RequestError. Uses the
    `tokenizers` library and jinja2 only (shared/tokenizer_files.py, chat_template.py): a replica
    imports neither transformers nor torch, so it starts in about a second in ~100 MB."""

    def __init__(self, model_dir: str, max_model_len: int, chat_template: str | None = None,
                 trust_request_chat_template: bool = False) -> None:
        self.tok = load_tokenizer(model_dir)
        self.templates = load_templates(model_dir, chat_template, self.tok.config)
        self.trust_request_chat_template = trust_request_chat_template  # a template is code run here
        self.config = ModelConfig.from_dir(model_dir)
        self.max_model_len = max_model_len
        self.eos_token_ids = self.tok.eos_token_ids
        # One rule for token ids, the worker's: the model embeds and emits ids below its
        # config's vocab_size (a tokenizer may know more, e.g. added tokens the embedding lacks).
        self.vocab_size = self.config.vocab_size
        self.fim = fim_tokens(self.tok)

    def render(self, messages: list[ChatMessage] | None, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, kwargs: dict[str, Any] | None = None,
               continue_final_message: bool = False) -> str:
        """The prompt text the chat template makes of these messages (and tools)."""
        if not messages:
            raise RequestError("messages must be a non-empty list", "messages")
        kwargs = dict(kwargs or {})
        own = kwargs.pop("chat_template", None)
        template = self._template(own, tools is not None)
        try:
            extra = template_kwargs(template, kwargs)
        except TemplateError as exc:
            raise RequestError(str(exc), "chat_template_kwargs") from exc
        for name in TEMPLATE_FIELDS:
            if (kwargs or {}).get(name) is not None and name not in extra:
                raise RequestError(f"this model's chat template never reads {name}: it has no place for that field", name)
        msgs, special = template_messages(messages), self.tok.special_tokens

        def render(msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
            return template.render(msgs, tools, add_generation_prompt, special, extra, continue_final_message)

        try:
            if template.reads_tools:
                return render(msgs, tools)
            if template.takes_system_tools:  # Phi-4-mini's: tools in its system message, calls in content
                return render(tools_in_system(msgs, tools) if tools else calls_in_content(msgs))
            if not tools:  # none offered (an empty list describes none): earlier calls and results as text
                return render(history_as_text(msgs))
            try:  # the template would drop the tools: they go in as text (tool_prompt.py)
                return render(with_tools(msgs, tools))
            except TemplateError:  # e.g. "System role not supported"
                return render(with_tools(msgs, tools, in_system=False))
        except ContinueError as exc:
            raise RequestError(str(exc), "continue_final_message") from exc
        except TemplateError as exc:  # a template can reject roles or orderings
            raise RequestError(f"the chat template rejected the messages: {exc}",
                               "messages" if own is None else "chat_template") from exc

    def _template(self, source: Any, has_tools: bool) -> ChatTemplate:
        """The request's own template (vLLM's chat_template; only with --trust-request-chat-template),
        else the server's."""
        if source is not None:
            if not self.trust_request_chat_template:
                raise RequestError("a request's chat_template runs only on a server started with "
                                   "--trust-request-chat-template; leave it out to use the server's", "chat_template")
            try:
                return request_template(str(source))
            except TemplateError as exc:
                raise RequestError(str(exc), "chat_template") from exc
        if not self.templates:
            raise RequestError("this model has no chat template; start the server with --chat-template FILE, or use /v1/completions", "messages")
        try:
            return self.templates.pick(has_tools)
        except TemplateError as exc:
            raise RequestError(str(exc), "chat_template_kwargs") from exc

    def info(self) -> dict[str, Any]:
        """What GET /tokenizer_info serves (vLLM's endpoint; lm-eval's remote tokenizer reads it):
        the special tokens, the context length and the default chat template."""
        try:
            template = self.templates.pick(False).source if self.templates else None
        except TemplateError:
            template = None
        flags = {k: self.tok.config[k] for k in ("add_bos_token", "add_eos_token") if k in self.tok.config}
        return {"tokenizer_class": self.tok.config.get("tokenizer_class"), **self.tok.special_tokens, **flags,
                "eos_token_ids": self.eos_token_ids, "model_max_length": self.max_model_len,
                "chat_template": template}

    def chat_ids(self, messages: list[ChatMessage] | None, add_generation_prompt: bool = True,
                 tools: list[dict[str, Any]] | None = None, kwargs: dict[str, Any] | None = None,
                 continue_final_message: bool = False, add_special_tokens: bool = False) -> list[int]:
        # The template writes its own special tokens, so none are added unless asked (as vLLM).
        text = self.render(messages, add_generation_prompt, tools, kwargs, continue_final_message)
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def _chat_ids(self, req: GenerateRequest | TokenizeRequest) -> list[int]:
        return self.chat_ids(req.messages, req.add_generation_prompt, req.tools, req.chat_template_kwargs,
                             req.continue_final_message, bool(req.add_special_tokens))

    def _text_ids(self, prompt: str, add_special_tokens: bool | None) -> list[int]:
        # A text prompt gets the tokenizer's special tokens (e.g. BOS) unless told not to (as vLLM).
        return self.tok.encode(prompt, add_special_tokens=add_special_tokens is not False)

    def check_ids(self, ids: list[int], param: str, what: str = "token id") -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"{what} {bad[0]} is out of range [0, {self.vocab_size})", param)
        return ids

    def bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's ids as text opening with it and, where they differ, as a later word (after
        a space), as vLLM reads them; vLLM drops the second when its length differs, so " Danube"
        (one token) would pass where "Danube" is two: here both are banned."""
        out: list[list[int]] = []
        for word in words:
            bare = self.tok.encode(word.lstrip(), add_special_tokens=False)
            if not bare:
                raise RequestError(f"bad word {word!r} has no tokens once its leading whitespace is dropped",
                                   "bad_words")
            spaced = self.tok.encode(" " + word.lstrip(), add_special_tokens=False)
            out += [bare, spaced] if spaced != bare else [bare]
        return out

    def prediction_ids(self, prediction: str | None) -> list[int]:
        """A prediction's ids, as the output would hold its text; no longer than the context."""
        ids = self.tok.encode(prediction, add_special_tokens=False) if prediction else []
        if len(ids) > self.max_model_len:
            raise RequestError(f"the prediction has {len(ids)} tokens, more than the model's context "
                               f"({self.max_model_len})", "prediction")
        return ids

    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.kind == "chat":
            return self.check_ids(self._chat_ids(req), "messages")
        if req.suffix is not None:
            return self.check_ids(self._fill_in_the_middle(req.prompt, req.suffix, req.add_special_tokens),
                                  "prompt")
        if isinstance(req.prompt, str):
            return self.check_ids(self._text_ids(req.prompt, req.add_special_tokens), "prompt")
        if isinstance(req.prompt, list):
            return self.check_ids(list(req.prompt), "prompt")
        raise RequestError("prompt must be a string or a list of token ids", "prompt")

    def _fill_in_the_middle(self, prompt: str | list[int] | None, suffix: str,
                            add_special_tokens: bool | None) -> list[int]:
        """The prompt, then the suffix, each after its FIM marker, then the marker of the middle the
        model writes (prefix-suffix-middle order); a text prompt's BOS stays first."""
        if self.fim is None:
            raise RequestError("this model's vocabulary has no fill-in-the-middle tokens (<fim_prefix>, "
                               "<|fim_prefix|>, ...), so it cannot take a suffix", "suffix")
        pre, suf, mid = self.fim
        if isinstance(prompt, str):
            head = self._text_ids("", add_special_tokens)  # BOS, where the tokenizer adds one
            body = self.tok.encode(prompt, add_special_tokens=False)
        else:
            head, body = [], list(prompt or [])
        return [*head, pre, *body, suf, *self.tok.encode(suffix, add_special_tokens=False), mid]

    def tokenize(self, req: TokenizeRequest) -> TokenizeReply:
        """/tokenize: the ids a generate request with this prompt or these messages would run."""
        if req.messages is not None:
            ids = self._chat_ids(req)
        elif req.prompt is not None:
            ids = self._text_ids(req.prompt, req.add_special_tokens)
        else:
            raise RequestError("either prompt or messages is required", "prompt")
        return TokenizeReply(request_id=req.request_id, token_ids=ids)

    def detokenize(self, req: DetokenizeRequest) -> TokenizeReply:
        ids = self.check_ids(list(req.token_ids), "tokens")
        return TokenizeReply(request_id=req.request_id, text=self.tok.decode(ids))

    def __call__(self, req: GenerateRequest) -> TokenizedRequest:
        ids, p = self.prompt_ids(req), req.params
        keep = p.truncate_prompt_tokens
        if keep is not None:  # the last `keep` (all of them if fewer)
            ids = ids[-(self.max_model_len if keep == -1 else keep):]
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        n = len(ids)
        max_tokens = p.max_tokens
        if n >= self.max_model_len:
            raise RequestError(past_the_context(self.max_model_len, n), "messages" if req.kind == "chat" else "prompt")
        if max_tokens is None and req.kind != "chat":  # chat's fills the context its engine serves
            max_tokens = min(16, self.max_model_len - n)
        if max_tokens is not None and n + max_tokens > self.max_model_len:
            raise RequestError(past_the_context(self.max_model_len, n, max_tokens), "max_tokens")
        self.check_ids(p.stop_token_ids, "stop_token_ids", "stop token id")
        self.check_ids(p.allowed_token_ids, "allowed_token_ids", "allowed token id")
        self.check_ids(list(p.logit_bias), "logit_bias", "logit_bias token id")
        ends = {*self.eos_token_ids, *p.stop_token_ids}  # banned before min_tokens
        if p.min_tokens and p.allowed_token_ids and set(p.allowed_token_ids) <= ends:
            raise RequestError("allowed_token_ids leaves no token to sample before min_tokens (only end tokens)",
                               "allowed_token_ids")
        params = msgspec.structs.replace(p, max_tokens=max_tokens, truncate_prompt_tokens=None, bad_words=[],
                                         bad_word_ids=self.bad_word_ids(p.bad_words), prediction=None,
                                         prediction_ids=self.prediction_ids(p.prediction))
        return TokenizedRequest(request_id=req.request_id, reply_to=req.reply_to, prompt_token_ids=ids,
                                params=params, eos_token_ids=self.eos_token_ids,
                                arrival_time=req.arrival_time, priority=req.priority)


def run(redis_url: str, prefix: str, model_dir: str, max_model_len: int, consumer: str,
        stop: StopFlag | None = None, claim_idle_ms: int | None = CLAIM_IDLE_MS,
        chat_template: str | None = None, routing: str = DEFAULT_POLICY, trust_request_chat_template: bool = False) -> None:
    """Serve until `stop` is set (SIGTERM/SIGINT by default). `claim_idle_ms`: take over other
    replicas' requests unacked that long (None: never); `chat_template`: a template file used
    instead of the model's (`trust_request_chat_template`: a request may bring its own); `routing`: the policy that picks each request's engine (router.py). Broker errors never end the loop: it backs off, reconnects and
    first redoes its own unacked requests."""
    stop = stop if stop is not None else StopFlag()
    bus = Bus(redis_url, prefix, name=consumer)  # the router's
    tokenizer = Tokenizer(model_dir, max_model_len, chat_template, trust_request_chat_template)
    router = Router(bus, routing)
    heartbeat = replica_heartbeat(redis_url, prefix, "tokenizer", consumer,
                                  [(bus.streams.tokenizer_info_key(), msgspec.json.encode(tokenizer.info()))])
    log.info("tokenizer %s ready (max_model_len=%d, routing %s)", consumer, max_model_len, routing)
    if not tokenizer.templates:
        log.warning("the model has no chat template (a base model?): chat requests get a 400; serve one with "
                    "--chat-template FILE, or use /v1/completions")
    elif any(t.takes_system_tools for t in tokenizer.templates.templates.values()):
        log.info("the chat template takes tools in the system message (Phi-4-mini's way): a request's tools go there")
    elif not any(t.reads_tools for t in tokenizer.templates.templates.values()):
        log.info("the chat template renders no tools: a request's tools go in as text (hermes format)")
    try:
        # Every gateway's requests stream; handle_entries runs one batch at a time.
        serve_streams(redis_url, prefix, TOKENIZER_GROUP, consumer, gateway_request_streams,
                      lambda rbus, stream, entries: handle_entries(rbus, stream, tokenizer, router, entries),
                      stop, claim_idle_ms, log=log)
    finally:
        heartbeat.stop()
        bus.close()
        log.info("tokenizer %s stopped", consumer)


def handle_entries(bus: Bus, stream: str, tokenizer: Tokenizer, router: Router, entries: list[Entry]) -> None:
    """Tokenize each entry of `stream`; ack it and forward its output in one atomic step per
    entry, so an entry redone by another replica after a crash or a claim is forwarded exactly once."""
    if not entries:
        return
    items = [(entry_id, handle(bus, tokenizer, router, data)) for entry_id, data in entries]
    bus.ack_and_send_many(stream, TOKENIZER_GROUP, items)


def handle(bus: Bus, tokenizer: Tokenizer, router: Router, data: bytes) -> list[tuple[str, Struct]]:
    """What one request entry turns into: (stream, message) sends, none if it is malformed."""
    try:
        req = tokenizer_input_decoder.decode(data)
    except msgspec.DecodeError as exc:
        log.warning("dropping malformed request entry: %s", exc)
        return []
    try:
        if isinstance(req, TokenizeRequest):
            return [(req.reply_to, tokenizer.tokenize(req))]
        if isinstance(req, DetokenizeRequest):
            return [(req.reply_to, tokenizer.detokenize(req))]
        out = tokenizer(req)
    except RequestError as exc:
        return [(req.reply_to, ErrorReply(request_id=req.request_id, message=str(exc), status=exc.status,
                                          param=exc.param))]
    except Exception as exc:  # never let one request take the replica down
        log.exception("tokenizing %s failed", req.request_id)
        return [(req.reply_to, ErrorReply.of(req.request_id, f"tokenization failed: {exc}", 500))]
    try:
        engine = router.pick(out.prompt_token_ids, avoid=req.avoid_engine, salt=out.params.cache_salt)
    except redis.RedisError:
        raise  # the loop rides out the outage and redoes this entry
    except Exception as exc:  # a routing bug must not end the replica's read loop
        log.exception("routing %s failed", req.request_id)
        return [(req.reply_to, ErrorReply.of(req.request_id, f"routing failed: {exc}", 500))]
    sends: list[tuple[str, Struct]] = [(bus.streams.engine_in(engine), out)]
    if router.role(engine) != "prefill":  # a prefill engine hands the request on: not its last engine
        sends.append((req.reply_to, Routed(request_id=req.request_id, engine=engine)))
    return sends
