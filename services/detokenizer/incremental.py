"""Stateless incremental detokenization and stop-string handling (pure logic, no I/O).

Each DetokBatch row carries the output tokens just before its new ones, so a row is decoded
from its own window alone. Two rules make consecutive rows agree without shared state:

* The text a window has "settled" ends at a fixed point of the output byte stream: the end,
  minus a trailing incomplete UTF-8 sequence. That point depends only on the last 3 bytes, so
  the next row, whose context ends where this row's tokens end, finds the same point.
* With stop strings, the emitted point is the settled end minus the longest suffix that is a
  proper prefix of a stop string. That suffix is shorter than the longest stop string, and
  `detok_context_len` gives the next row enough context to recompute it: its delta then starts
  exactly where the previous row stopped emitting.

Byte-level BPE tokenizers (SmolLM2, GPT-2, Llama 3…) decode by concatenating token bytes and
then replacing invalid UTF-8 per maximal subpart, which Python's `errors="replace"` does too,
so for them we decode in Python from a per-token bytes table: exact and cheaper than calling
the Rust decoder per row. Other tokenizers fall back to decoding text windows through the
tokenizer (trailing U+FFFD = incomplete character), which is exact only as far as their
decoder is prefix-stable.

Known limit of a bounded window: if the context holds fewer than 3 bytes of text (e.g. it is
all special tokens that are skipped) or fewer than max(len(stop)) - 1 characters, a character
or held-back stop prefix that started before the window cannot be recovered. The scheduler's
`detok_context_len` (4 tokens per stop character + 8) rules this out for ordinary text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from rill.shared.kinds import FinishReason
from rill.shared.schema import DetokBatch, TextDelta, TextLogprob, TokenLogprobs, TopLogprob

_FFFD = "\ufffd"


class RowOutput(NamedTuple):
    text: str  # the delta to append to what the client has
    finish_reason: FinishReason | None  # "stop" on a stop-string hit, else the scheduler's reason
    stopped: bool  # a stop string matched in this row: the engine must drop the request
    # (a row after the one that matched gets text "" and finish_reason "stop", stopped False)
    stop_str: str | None = None  # the stop string that matched


class BatchOutput(NamedTuple):
    replies: dict[str, list[TextDelta]]  # reply stream -> deltas, in row order
    stopped: list[str]  # request ids ended by a stop string while the engine still runs them
    failed: list[str]  # request ids whose row could not be decoded (engine still runs them)
    errors: list[str]  # one line per failed row, for the log


# ---------------------------------------------------------------------------------------------
# Byte-level tables


def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE char -> byte map: printable Latin-1 bytes stand for themselves, the
    other 68 bytes are shifted to U+0100 upwards in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = 0
    kept = set(printable)
    for b in range(256):
        if b not in kept:
            table[chr(0x100 + shifted)] = b
            shifted += 1
    return table


def _token_bytes(token: str, alphabet: dict[str, int]) -> bytes:
    # Same rule as the ByteLevel decoder: a token with any char outside the alphabet
    # (an added token such as "<|im_end|>" may have one) is taken as its UTF-8 text.
    try:
        return bytes(alphabet[c] for c in token)
    except KeyError:
        return token.encode()


def _backend(tokenizer: Any) -> Any:
    """The Rust `tokenizers.Tokenizer` behind a transformers fast tokenizer, or None."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    return backend if hasattr(backend, "get_added_tokens_decoder") else None


def _is_byte_level(backend: Any) -> bool:
    from tokenizers import decoders

    return isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)


# ---------------------------------------------------------------------------------------------
# UTF-8 helpers


def _stable_end(buf: bytes, end: int, lo: int) -> int:
    """End of the settled bytes of buf[lo:end]: `end`, or the start of a trailing sequence that
    is a proper prefix of a valid UTF-8 character (more bytes could complete it)."""
    j = end - 1
    floor = max(lo, end - 3)
    while j >= floor and 0x80 <= buf[j] < 0xC0:  # continuation bytes
        j -= 1
    if j < floor:  # no lead byte in the last 3: a complete 4-byte char, or stray bytes
        return end
    lead = buf[j]
    if 0xC2 <= lead <= 0xDF:
        need = 2
    elif 0xE0 <= lead <= 0xEF:
        need = 3
    elif 0xF0 <= lead <= 0xF4:
        need = 4
    else:  # ASCII or a byte that never starts a character
        return end
    have = end - j
    if have >= need:
        return end
    if have >= 2:  # the second byte has a narrower range after some leads
        lo2, hi2 = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}.get(
            lead, (0x80, 0xBF))
        if not lo2 <= buf[j + 1] <= hi2:
            return end  # already invalid: it decodes to U+FFFD whatever follows
    return j


def _first_boundary(buf: bytes) -> int:
    """Index of the first byte that starts a character (never a continuation byte): decoding
    from there agrees with decoding the whole output, since UTF-8 resynchronises on it."""
    for i, b in enumerate(buf):
        if not 0x80 <= b < 0xC0:
            return i
    return len(buf)


def _decode(buf: bytes) -> str:
    return buf.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# Stop strings


def _holdback(text: str, lo: int, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text[lo:] that is a proper prefix of some stop string."""
    room = len(text) - lo
    if room <= 0:
        return 0
    last = text[-1]
    best = 0
    for s in stops:
        k = min(len(s) - 1, room)
        while k > best:
            k = s.rfind(last, 0, k) + 1  # only prefixes ending with the text's last char can match
            if k > best and text.endswith(s[:k]):
                best = k
                break
            k -= 1
    return best


def _first_match(text: str, start: int, stops: Sequence[str]) -> tuple[int, int, str] | None:
    """The match in text[start:] that ends first (then the longest): what a token-by-token
    check would see first, so the result does not depend on how tokens were split into steps."""
    best: tuple[int, int, str] | None = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or (i + len(s), i) < (best[1], best[0])):
            best = (i, i + len(s), s)
    return best


def apply_stops(window: str, prev_len: int, stops: Sequence[str], include_stop_str: bool,
                final: bool) -> tuple[str, bool, str | None]:
    """Delta of a row given the window text, of which window[:prev_len] is what the context
    alone settles. Returns (text, stopped, matched stop string); stopped with no string: an
    earlier row already hit one (the engine ran on until it saw the abort), so emit nothing."""
    prev = window[:prev_len]
    if any(s in prev for s in stops):  # any whole stop string in the output ended it there
        return "", True, None
    emitted = prev_len - _holdback(prev, 0, stops)  # where the previous row stopped emitting
    hit = _first_match(window, emitted, stops)
    if hit is not None:
        start, end, s = hit
        return window[emitted:end if include_stop_str else start], True, s
    if final:
        return window[emitted:], False, None
    keep = len(window) - _holdback(window, emitted, stops)
    return window[emitted:max(keep, emitted)], False, None


# ---------------------------------------------------------------------------------------------
# The detokenizer


class Detokenizer:
    """Decodes DetokBatch rows for one tokenizer. Holds only read-only tables built once (and a
    cache of single-token texts for logprobs)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = _backend(tokenizer)
        self._tables: tuple[list[bytes | None], list[bytes | None]] | None = None
        if backend is not None and _is_byte_level(backend):
            self._tables = self._build_tables(backend)
        self._decode_many = self._make_text_decoder(tokenizer, backend)
        self._pieces: dict[int, str] = {}  # token id -> its text alone (logprobs)

    @property
    def byte_level(self) -> bool:
        return self._tables is not None

    @staticmethod
    def _build_tables(backend: Any) -> tuple[list[bytes | None], list[bytes | None]]:
        """id -> bytes, with special tokens kept and with them skipped (as b"")."""
        alphabet = byte_level_alphabet()
        vocab = backend.get_vocab(with_added_tokens=True)
        keep: list[bytes | None] = [None] * (max(vocab.values(), default=-1) + 1)
        for token, i in vocab.items():
            keep[i] = _token_bytes(token, alphabet)
        skip = list(keep)
        for i, added in backend.get_added_tokens_decoder().items():
            if added.special and i < len(skip):
                skip[i] = b""
        return keep, skip

    @staticmethod
    def _make_text_decoder(tokenizer: Any, backend: Any) -> Callable[[list[list[int]], bool], list[str]]:
        if backend is not None:
            return lambda seqs, skip: backend.decode_batch(seqs, skip_special_tokens=skip)
        return lambda seqs, skip: [tokenizer.decode(s, skip_special_tokens=skip) for s in seqs]

    def _bytes(self, ids: Sequence[int], skip_special_tokens: bool) -> bytes:
        assert self._tables is not None
        table = self._tables[1 if skip_special_tokens else 0]
        if ids and (min(ids) < 0 or max(ids) >= len(table)):
            raise ValueError(f"token id out of range [0, {len(table)})")
        return b"".join(table[i] for i in ids)  # type: ignore[misc]  # None (a gap) raises TypeError

    def detokenize_row(self, context_ids: Sequence[int], new_ids: Sequence[int], offset: int,
                       stop: Sequence[str] = (), skip_special_tokens: bool = True,
                       include_stop_str: bool = False, final: bool = False,
                       finish_reason: FinishReason | None = None) -> RowOutput:
        """Text of `new_ids`, whose first token is output token `offset`, given the output tokens
        just before it (`context_ids`). `final`: the request ends here, flush held-back text."""
        stops = [s for s in stop if s]
        final = final or finish_reason is not None
        if finish_reason == "stop" and not include_stop_str:
            # The engine stopped on this row's last token (EOS or a stop_token_ids id; stop
            # strings are found here): as vLLM, its text is not output, special or not.
            new_ids = new_ids[:-1]
        at_start = len(context_ids) >= offset  # the context reaches back to the first output token
        if self._tables is not None:
            window, prev_len = self._window_bytes(context_ids, new_ids, at_start, skip_special_tokens,
                                                  final, bool(stops))
        else:
            window, prev_len = self._window_text(context_ids, new_ids, skip_special_tokens, final)
        if not stops:
            return RowOutput(window[prev_len:], finish_reason, False)
        text, stopped, stop_str = apply_stops(window, prev_len, stops, include_stop_str, final)
        return RowOutput(text, "stop" if stopped else finish_reason, stop_str is not None, stop_str)

    def _window_bytes(self, context_ids: Sequence[int], new_ids: Sequence[int], at_start: bool,
                      skip: bool, final: bool, need_context_text: bool) -> tuple[str, int]:
        ctx = self._bytes(context_ids, skip)
        buf = ctx + self._bytes(new_ids, skip)
        prev_end = _stable_end(buf, len(ctx), 0)
        cur_end = len(buf) if final else max(_stable_end(buf, len(buf), prev_end), prev_end)
        new_text = _decode(buf[prev_end:cur_end])
        if not need_context_text:
            return new_text, 0
        # The window's text starts at its first character boundary: a character begun before the
        # window has at most 3 continuation bytes here, so any later byte is one too.
        sync = 0 if at_start else min(_first_boundary(buf), 3, prev_end)
        prev_text = _decode(buf[sync:prev_end])  # prev_end is a character boundary: concat is exact
        return prev_text + new_text, len(prev_text)

    def _window_text(self, context_ids: Sequence[int], new_ids: Sequence[int], skip: bool,
                     final: bool) -> tuple[str, int]:
        prev, full = self._decode_many([list(context_ids), [*context_ids, *new_ids]], skip)
        prev = prev.rstrip(_FFFD)
        if not final:
            full = full.rstrip(_FFFD)
        # Assumes decode(context) is a prefix of decode(context + new), as for common decoders.
        return full, min(len(prev), len(full))

    def token_str(self, token_id: int) -> str:
        """A token decoded on its own, as logprobs show it (a partial UTF-8 byte shows as U+FFFD)."""
        s = self._pieces.get(token_id)
        if s is None:
            s = self._decode_many([[token_id]], False)[0]
            if len(self._pieces) < 1 << 20:
                self._pieces[token_id] = s
        return s

    def text_logprob(self, lp: TokenLogprobs) -> TextLogprob:
        """The sampled token (index 0) with its logprob and the top alternatives, as text."""
        ids, vals = lp.token_ids, lp.logprobs
        if not vals:  # a prompt's first token: nothing scored it
            return TextLogprob(self.token_str(ids[0]), None, ids[0], [])
        top = [TopLogprob(self.token_str(t), v, t) for t, v in zip(ids[1:], vals[1:], strict=True)]
        return TextLogprob(self.token_str(ids[0]), vals[0], ids[0], top, lp.rank)

    def detokenize_batch(self, batch: DetokBatch) -> BatchOutput:
        """One TextDelta for every row (the gateway waits for every offset), grouped by reply
        stream. A row that fails gets finish_reason "error"; the others are unaffected."""
        replies: dict[str, list[TextDelta]] = {}
        stopped: list[str] = []
        failed: list[str] = []
        errors: list[str] = []
        for i, request_id in enumerate(batch.request_ids):
            try:
                reply_to = batch.reply_to[i]
            except IndexError:
                errors.append(f"request_id={request_id} has no reply stream")
                continue
            try:
                offset = batch.offsets[i]
                new = batch.new_token_ids[i]
                reason = batch.finish_reasons[i]
                out = self.detokenize_row(batch.context_ids[i], new, offset, batch.stop[i],
                                          batch.skip_special_tokens[i], batch.include_stop_str[i],
                                          finish_reason=reason)
                lps = batch.logprobs[i] if batch.logprobs else []
                prompt_lps = batch.prompt_logprobs[i] if batch.prompt_logprobs else []
                prompt_ids = _get(batch.prompt_ids, i)  # None: no token ids asked
                delta = TextDelta(request_id=request_id, offset=offset, num_tokens=len(new), text=out.text,
                                  finish_reason=out.finish_reason, prompt_tokens=batch.prompt_tokens[i],
                                  completion_tokens=offset + len(new),
                                  logprobs=[self.text_logprob(lp) for lp in lps],
                                  prompt_logprobs=[self.text_logprob(lp) for lp in prompt_lps],
                                  cached_tokens=_get(batch.cached_tokens, i, 0),
                                  token_ids=[] if prompt_ids is None else list(new), prompt_token_ids=prompt_ids or [],
                                  prediction_tokens=_get(batch.prediction_tokens, i) or [])
                if out.stopped and reason is None:
                    stopped.append(request_id)
            except Exception as exc:  # bad ids or columns: fail this request only
                delta = _error_delta(batch, i, request_id)
                if _get(batch.finish_reasons, i) is None:
                    failed.append(request_id)
                errors.append(f"request_id={request_id} error={exc!r}")
            replies.setdefault(reply_to, []).append(delta)
        return BatchOutput(replies, stopped, failed, errors)


def _get(column: Sequence[Any], i: int, default: Any = None) -> Any:
    return column[i] if i < len(column) else default


def _error_delta(batch: DetokBatch, i: int, request_id: str) -> TextDelta:
    offset = _get(batch.offsets, i, 0)
    new = _get(batch.new_token_ids, i, [])
    num = len(new) if isinstance(new, list) else 0
    return TextDelta(request_id=request_id, offset=offset, num_tokens=num, text="", finish_reason="error",
                     prompt_tokens=_get(batch.prompt_tokens, i, 0), completion_tokens=offset + num)
