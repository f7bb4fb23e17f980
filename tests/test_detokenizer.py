"""Detokenizer: stateless incremental decoding and stop strings (SmolLM2's real tokenizer), and
the service loop against a real Redis."""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from collections.abc import Iterator, Sequence

import msgspec
import pytest
import redis

from rill.services.detokenizer import service
from rill.services.detokenizer.incremental import Detokenizer, RowOutput, byte_level_alphabet
from rill.shared.bus import FIELD, Bus
from rill.shared.config import detok_context_len
from rill.shared.lifecycle import StopFlag
from rill.shared.model_files import resolve_model
from rill.shared.schema import DetokBatch, TextDelta, encode, engine_input_decoder, gateway_input_decoder
from rill.shared.streams import DETOKENIZER_GROUP

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
EOS = 2

TEXTS = [
    "你好，世界！今天天气很好。",
    "Emoji: 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 done",
    "Mixed: café naïve — Ελληνικά, 日本語テキスト, 한국어, עברית 😀 and ASCII.",
    "def f(x):\n    return x ** 2  # 平方\n\n\tindent",
]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(resolve_model())


@pytest.fixture(scope="module")
def tok(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def detok(tok) -> Detokenizer:
    d = Detokenizer(tok)
    assert d.byte_level
    return d


# ---------------------------------------------------------------------------------------------
# Helpers: the scheduler's side (windows) and a whole-text reference


def stream(detok: Detokenizer, ids: Sequence[int], steps: Sequence[int], stop: Sequence[str] = (),
           include: bool = False, skip: bool = True, finish: str | None = "length",
           ctx_len: int | None = None) -> list[RowOutput]:
    """Feed `ids` as the scheduler would, `steps[i]` tokens per step, each row with its window of
    context; stop after a stop-string hit (the engine is aborted) or at the last token."""
    window = detok_context_len(list(stop)) if ctx_len is None else ctx_len
    outs: list[RowOutput] = []
    off = 0
    for k in steps:
        new = list(ids[off:off + k])
        last = off + k >= len(ids)
        out = detok.detokenize_row(list(ids[max(0, off - window):off]), new, off, stop, skip, include,
                                   finish_reason=finish if last else None)
        outs.append(out)
        off += k
        if out.stopped or last:
            break
    return outs


def expected(full: str, stop: Sequence[str], include: bool) -> tuple[str, bool]:
    """The whole output cut at the stop string that ends first (then the longest one)."""
    best = None
    for s in stop:
        i = full.find(s) if s else -1
        if i >= 0 and (best is None or (i + len(s), i) < (best[1], best[0])):
            best = (i, i + len(s))
    if best is None:
        return full, False
    return full[:best[1] if include else best[0]], True


def check(detok: Detokenizer, tok, ids: Sequence[int], steps: Sequence[int], stop: Sequence[str] = (),
          include: bool = False, skip: bool = True, ctx_len: int | None = None) -> list[RowOutput]:
    outs = stream(detok, ids, steps, stop, include, skip, ctx_len=ctx_len)
    want, stopped = expected(tok.decode(list(ids), skip_special_tokens=skip), stop, include)
    got = "".join(o.text for o in outs)
    emitted = ""
    for o in outs:  # nothing is ever emitted that is later taken back (no partial stop string leaks)
        emitted += o.text
        assert want.startswith(emitted), (emitted, want)
    assert got == want, (ids, steps, stop, got, want)
    assert outs[-1].stopped == stopped
    assert outs[-1].finish_reason == ("stop" if stopped else "length")
    assert all(o.finish_reason is None and not o.stopped for o in outs[:-1])
    return outs


def random_steps(rng: random.Random, n: int, most: int = 4) -> list[int]:
    steps = []
    while sum(steps) < n:
        steps.append(rng.randint(1, most))
    return steps


# ---------------------------------------------------------------------------------------------
# Pure logic


def test_byte_table_matches_tokenizer(detok: Detokenizer, tok) -> None:
    from tokenizers import pre_tokenizers

    assert set(byte_level_alphabet()) == set(pre_tokenizers.ByteLevel.alphabet())
    n = tok.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    singles = tok.backend_tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    keep = detok._tables[0]
    assert [keep[i].decode("utf-8", "replace") for i in range(n)] == singles


@pytest.mark.parametrize("text", TEXTS)
def test_split_at_every_point(detok: Detokenizer, tok, text: str) -> None:
    ids = tok.encode(text)
    assert len(ids) > 8
    check(detok, tok, ids, [1] * len(ids))  # one token per step
    for cut in range(1, len(ids)):  # two steps, cut anywhere (mid-character included)
        check(detok, tok, ids, [cut, len(ids) - cut])
    for cut in range(0, len(ids), 3):  # three steps
        check(detok, tok, ids, [cut, 2, len(ids)] if cut else [2, len(ids)])


def test_single_tokens_are_never_half_characters(detok: Detokenizer, tok) -> None:
    ids = tok.encode("世界😀")
    assert all(tok.decode([i]) == "\ufffd" for i in ids)  # every token alone is a fragment
    outs = stream(detok, ids, [1] * len(ids))
    assert all("\ufffd" not in o.text for o in outs)
    assert [o.text for o in outs if o.text] == ["世", "界", "😀"]


def test_random_token_sequences(detok: Detokenizer, tok) -> None:
    """Random ids make invalid UTF-8 (stray continuation bytes, cut sequences): the deltas must
    still join to exactly what decoding the whole output gives."""
    rng = random.Random(1234)
    n = tok.backend_tokenizer.get_vocab_size()
    # Tokens that are one non-ASCII byte: the worst case for windows cut mid-character.
    byte_tokens = [i for i, b in enumerate(detok._tables[0]) if b is not None and len(b) == 1 and b[0] >= 0x80]
    assert len(byte_tokens) > 100  # (bytes that never occur in UTF-8 may be missing)
    for trial in range(600):
        pool = byte_tokens if trial % 2 else range(n)
        ids = [rng.choice(pool) if rng.random() < 0.8 else rng.randrange(n) for _ in range(rng.randint(1, 40))]
        check(detok, tok, ids, random_steps(rng, len(ids)))


def test_random_windows_cut_anywhere(detok: Detokenizer, tok) -> None:
    """The context window may start anywhere (inside a character too); 3 tokens of ≥1 byte
    each are enough to place the previous row's end without stop strings."""
    rng = random.Random(99)
    texts = [tok.encode(t) for t in TEXTS]
    for _ in range(400):
        ids = rng.choice(texts)
        check(detok, tok, ids, random_steps(rng, len(ids), 6), ctx_len=rng.randint(3, 12))


def test_real_utf8_replacement_char_is_text(detok: Detokenizer, tok) -> None:
    ids = tok.encode("a\ufffdb\ufffd")  # a literal U+FFFD is a complete character, not a fragment
    check(detok, tok, ids, [1] * len(ids))


def test_stop_string_across_tokens_and_steps(detok: Detokenizer, tok) -> None:
    ids = tok.encode("Hello world, and more text")
    outs = check(detok, tok, ids, [1] * len(ids), stop=["world"])
    assert "".join(o.text for o in outs) == "Hello "
    # Chinese stop string, every token a byte fragment, split everywhere.
    ids = tok.encode("你好世界再见")
    for cut in range(1, len(ids)):
        outs = check(detok, tok, ids, [cut, len(ids) - cut], stop=["世界"])
        assert "".join(o.text for o in outs) == "你好"


def test_partial_stop_is_held_back_then_released(detok: Detokenizer, tok) -> None:
    ids = tok.encode("Say wor then more")
    k = len(tok.encode("Say wor"))
    outs = stream(detok, ids, [k, len(ids) - k], stop=["world"])
    assert outs[0].text == "Say "  # " wor" could begin "world": wait
    assert outs[1].text == "wor then more"  # it did not: released with what follows
    # The request ends while a possible stop prefix is held: the flush releases it.
    ids = tok.encode("Say wor")
    outs = stream(detok, ids, [1] * len(ids), stop=["world"], finish="length")
    assert "".join(o.text for o in outs) == "Say wor"
    assert outs[-1].finish_reason == "length" and not outs[-1].stopped


def test_stop_string_at_the_very_start(detok: Detokenizer, tok) -> None:
    ids = tok.encode("STOP and the rest")
    for steps in ([1] * len(ids), [len(ids)], [2, len(ids)]):
        outs = check(detok, tok, ids, steps, stop=["STOP"])
        assert "".join(o.text for o in outs) == ""
        outs = check(detok, tok, ids, steps, stop=["STOP"], include=True)
        assert "".join(o.text for o in outs) == "STOP"


def test_overlapping_stop_strings(detok: Detokenizer, tok) -> None:
    ids = tok.encode("xx abcdef yy")
    for steps in ([1] * len(ids), [len(ids)]):
        # "bcd" ends before "abcdef": it wins whatever the step split.
        assert "".join(o.text for o in check(detok, tok, ids, steps, stop=["abcdef", "bcd"])) == "xx a"
        got = check(detok, tok, ids, steps, stop=["abcdef", "bcd"], include=True)
        assert "".join(o.text for o in got) == "xx abcd"
        assert got[-1].stop_str == "bcd"
        # Same end: the longer one.
        got = check(detok, tok, ids, steps, stop=["cd", "abcd"], include=True)
        assert "".join(o.text for o in got) == "xx abcd" and got[-1].stop_str == "abcd"
    ids = tok.encode("aaaab tail")  # a stop string overlapping its own prefix
    for steps in ([1] * len(ids), [2, 1, len(ids)]):
        assert "".join(o.text for o in check(detok, tok, ids, steps, stop=["aab"])) == "aa"


def test_rows_after_a_stop_emit_nothing(detok: Detokenizer, tok) -> None:
    """The engine keeps running until it sees the abort: its later rows must add no text."""
    ids = tok.encode("one two STOP three four five six")
    window = detok_context_len(["STOP"])
    outs = [detok.detokenize_row(ids[max(0, off - window):off], [ids[off]], off, ["STOP"])
            for off in range(len(ids))]
    hit = next(i for i, o in enumerate(outs) if o.stopped)
    assert "".join(o.text for o in outs[:hit + 1]) == "one two "
    assert outs[hit].finish_reason == "stop" and outs[hit].stop_str == "STOP"
    assert all(o == RowOutput("", "stop", False, None) for o in outs[hit + 1:])


def test_long_stop_string_window(detok: Detokenizer, tok) -> None:
    """A long stop string that is almost matched and then is not: everything is released."""
    stop = "The quick brown fox jumps over the lazy dog 一二三四五六七八九十"
    ids = tok.encode("Intro. " + stop[:-1] + " and then it goes on")
    rng = random.Random(3)
    for _ in range(50):
        outs = check(detok, tok, ids, random_steps(rng, len(ids), 3), stop=[stop, "x" * 30])
        assert not outs[-1].stopped


def test_include_stop_str(detok: Detokenizer, tok) -> None:
    ids = tok.encode("The answer is 42.\n\nUser: next")
    for steps in ([1] * len(ids), [3] * len(ids)):
        outs = check(detok, tok, ids, steps, stop=["\n\nUser:"], include=True)
        assert "".join(o.text for o in outs) == "The answer is 42.\n\nUser:"
        assert outs[-1].stop_str == "\n\nUser:"


def test_random_stop_strings(detok: Detokenizer, tok) -> None:
    """Stop strings cut from the text itself (Chinese, emoji, mixed), any split of tokens."""
    rng = random.Random(7)
    texts = [tok.encode(t) for t in TEXTS]
    for _ in range(400):
        ids = rng.choice(texts)
        full = tok.decode(ids)
        stops = []
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(full))
            stops.append(full[i:i + rng.randint(1, 6)])
        if rng.random() < 0.3:
            stops.append("never appears ☃")
        check(detok, tok, ids, random_steps(rng, len(ids), 5), stop=stops, include=rng.random() < 0.5)


def test_random_ids_with_stop_strings(detok: Detokenizer, tok) -> None:
    rng = random.Random(11)
    n = tok.backend_tokenizer.get_vocab_size()
    for _ in range(300):
        ids = [rng.randrange(n) for _ in range(rng.randint(1, 30))]
        full = tok.decode(ids, skip_special_tokens=True)
        stops = ["zz"]
        if full:
            i = rng.randrange(len(full))
            stops.append(full[i:i + rng.randint(1, 5)])
        check(detok, tok, ids, random_steps(rng, len(ids)), stop=stops, include=rng.random() < 0.5)


def test_special_tokens(detok: Detokenizer, tok) -> None:
    ids = tok.encode("Hi 你好") + [EOS]
    for steps in ([1] * len(ids), [len(ids)]):
        outs = check(detok, tok, ids, steps, skip=True)
        assert "<|im_end|>" not in "".join(o.text for o in outs)
        outs = check(detok, tok, ids, steps, skip=False)
        assert "".join(o.text for o in outs).endswith("<|im_end|>")
    # Special tokens in the middle, between the bytes of one character.
    zh = tok.encode("界")
    ids = [*zh[:1], 1, *zh[1:], 0, 3]
    for skip in (True, False):
        check(detok, tok, ids, [1] * len(ids), skip=skip)
        check(detok, tok, ids, [1] * len(ids), skip=skip, stop=["<|im_start|>"])


def test_a_stop_token_ends_the_text_unseen(detok: Detokenizer, tok) -> None:
    """A row the engine ended on a stop token (finish "stop": EOS or a stop_token_ids id) leaves
    that token's text out, special or not, unless include_stop_str_in_output (as vLLM)."""
    body = tok.encode("Hi 你好")
    for stop_id in (EOS, tok.encode(" there")[0]):
        ids = [*body, stop_id]
        for steps in ([1] * len(ids), [len(ids)], [len(ids) - 1, 1]):
            for include in (False, True):
                outs = stream(detok, ids, steps, include=include, skip=False, finish="stop")
                want = tok.decode(ids if include else body, skip_special_tokens=False)
                assert "".join(o.text for o in outs) == want and outs[-1].finish_reason == "stop", (stop_id, steps)


def test_empty_rows(detok: Detokenizer, tok) -> None:
    ids = tok.encode("ab 世")
    # A finishing row with no new tokens (e.g. an abort) flushes what was held back.
    held = detok.detokenize_row(ids[:-1], [ids[-1]], len(ids) - 1, stop=["世界"])
    assert held.text == "" and held.finish_reason is None
    flushed = detok.detokenize_row(ids, [], len(ids), stop=["世界"], finish_reason="abort")
    assert flushed.text == "世" and flushed.finish_reason == "abort"


def test_batch_bad_row_fails_alone(detok: Detokenizer, tok) -> None:
    ids = tok.encode("good 世界")
    n = 3
    batch = DetokBatch(
        engine_id=0, step_id=5, request_ids=["ok", "bad", "neg"], reply_to=["g1", "g1", "g2"],
        offsets=[0, 4, 1], new_token_ids=[ids, [10**9], [-1]], context_ids=[[], ids[:4], ids[:1]],
        finish_reasons=[None] * n, prompt_tokens=[7] * n, stop=[[]] * n, skip_special_tokens=[True] * n,
        include_stop_str=[False] * n)
    out = detok.detokenize_batch(batch)
    ok, bad = out.replies["g1"]
    (neg,) = out.replies["g2"]
    assert ok == TextDelta("ok", 0, len(ids), "good 世界", None, 7, len(ids))
    assert bad == TextDelta("bad", 4, 1, "", "error", 7, 5)
    assert neg.finish_reason == "error"
    assert out.failed == ["bad", "neg"] and out.stopped == [] and len(out.errors) == 2


def test_batch_stop_reports_abort(detok: Detokenizer, tok) -> None:
    ids = tok.encode("one two STOP three")
    n = 2
    batch = DetokBatch(
        engine_id=3, step_id=1, request_ids=["run", "done"], reply_to=["g", "g"], offsets=[0, 0],
        new_token_ids=[ids, ids], context_ids=[[], []], finish_reasons=[None, "length"],
        prompt_tokens=[4, 4], stop=[["STOP"], ["STOP"]], skip_special_tokens=[True] * n,
        include_stop_str=[False] * n)
    out = detok.detokenize_batch(batch)
    assert [(d.text, d.finish_reason, d.completion_tokens) for d in out.replies["g"]] == [
        ("one two ", "stop", len(ids))] * 2
    assert out.stopped == ["run"]  # the engine already finished "done": no abort needed


def test_text_fallback_for_other_decoders(tok) -> None:
    """A decoder that is not plain ByteLevel is decoded as text windows through the tokenizer."""
    from tokenizers import Tokenizer, decoders

    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    backend.decoder = decoders.Sequence([decoders.ByteLevel()])
    slow = Detokenizer(backend)
    assert not slow.byte_level
    rng = random.Random(5)
    for text in TEXTS:
        ids = tok.encode(text)
        check(slow, tok, ids, [1] * len(ids))
        for _ in range(20):
            check(slow, tok, ids, random_steps(rng, len(ids)), stop=[text[-3:-1], "never"], include=True)


# ---------------------------------------------------------------------------------------------
# Service against real Redis


@pytest.fixture
def bus() -> Iterator[Bus]:
    b = Bus(REDIS_URL, f"test-detok-{uuid.uuid4().hex[:12]}")
    try:
        b.r.ping()
    except redis.ConnectionError:
        pytest.skip(f"no Redis at {REDIS_URL}")
    b.r.sadd(b.streams.engines_key(), "0")  # listed: the replicas read engine 0's detok stream
    yield b
    keys = list(b.r.scan_iter(match=f"{b.streams.prefix}:*"))
    if keys:
        b.r.delete(*keys)
    b.close()


class Replica:
    """One service instance in a thread, stopped cleanly."""

    def __init__(self, bus: Bus, model_dir: str, consumer: str) -> None:
        self.stop = StopFlag(install=False)
        self.thread = threading.Thread(target=service.run, daemon=True,
                                       args=(REDIS_URL, bus.streams.prefix, model_dir, consumer, self.stop))
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


class Request:
    """A request's output as the scheduler would cut it into DetokBatch rows."""

    def __init__(self, rid: str, reply_to: str, ids: list[int], steps: list[int], stop: list[str] = (),
                 include: bool = False, finish: str = "length") -> None:
        self.rid, self.reply_to, self.ids, self.stop, self.include = rid, reply_to, ids, list(stop), include
        self.rows: list[tuple[int, int, str | None]] = []  # (offset, count, finish)
        off = 0
        for k in steps:
            k = min(k, len(ids) - off)
            self.rows.append((off, k, finish if off + k == len(ids) else None))
            off += k
            if off == len(ids):
                break


def make_batch(step_id: int, rows: list[tuple[Request, int]]) -> DetokBatch:
    cols: dict[str, list] = {k: [] for k in ("ids", "reply", "off", "new", "ctx", "fin", "pt", "stop", "skip", "inc")}
    for req, i in rows:
        off, k, fin = req.rows[i]
        window = detok_context_len(req.stop)
        for key, value in (("ids", req.rid), ("reply", req.reply_to), ("off", off), ("new", req.ids[off:off + k]),
                           ("ctx", req.ids[max(0, off - window):off]), ("fin", fin), ("pt", 11),
                           ("stop", req.stop), ("skip", True), ("inc", req.include)):
            cols[key].append(value)
    return DetokBatch(engine_id=0, step_id=step_id, request_ids=cols["ids"], reply_to=cols["reply"],
                      offsets=cols["off"], new_token_ids=cols["new"], context_ids=cols["ctx"],
                      finish_reasons=cols["fin"], prompt_tokens=cols["pt"], stop=cols["stop"],
                      skip_special_tokens=cols["skip"], include_stop_str=cols["inc"])


def send_steps(bus: Bus, reqs: list[Request], first_step: int = 0) -> int:
    """One DetokBatch per step holding a row of every request still producing; returns #steps."""
    steps = max(len(r.rows) for r in reqs)
    for s in range(steps):
        rows = [(r, s) for r in reqs if s < len(r.rows)]
        bus.r.xadd(bus.streams.detok(0), {FIELD: encode(make_batch(first_step + s, rows))})
    return steps


def collect(bus: Bus, stream: str, want: dict[str, int], timeout: float = 30.0) -> tuple[dict[str, list[TextDelta]], int]:
    """Read ReplyBatches until every request in `want` has that many deltas; (deltas, #batches)."""
    got: dict[str, list[TextDelta]] = {}
    last, batches = b"0-0", 0
    deadline = time.monotonic() + timeout
    while any(len(got.get(r, [])) < n for r, n in want.items()):
        assert time.monotonic() < deadline, f"timed out: {[(r, len(got.get(r, []))) for r in want]}"
        for entry_id, payload in bus.read(stream, last, block_ms=200):
            last = entry_id
            batches += 1
            for d in gateway_input_decoder.decode(payload).deltas:
                got.setdefault(d.request_id, []).append(d)
    return got, batches


def assemble(deltas: list[TextDelta]) -> tuple[str, TextDelta]:
    """What the gateway does: apply deltas in offset order, once each; stop at the finish."""
    text, pos = "", 0
    for d in sorted(deltas, key=lambda d: d.offset):
        assert d.offset == pos, "a gap or a repeat in offsets"
        text += d.text
        pos += d.num_tokens
        if d.finish_reason:
            return text, d
    raise AssertionError("no finishing delta")


def aborts(bus: Bus) -> list[tuple[list[str], str]]:
    out = []
    for _id, payload in bus.read(bus.streams.engine_in(0), b"0-0", block_ms=None, count=1000):
        msg = engine_input_decoder.decode(payload)
        out.append((msg.request_ids, msg.reason))
    return out


def pending(bus: Bus) -> int:
    return bus.r.xpending(bus.streams.detok(0), DETOKENIZER_GROUP)["pending"]


def test_service_end_to_end(bus: Bus, model_dir: str, tok) -> None:
    g1, g2 = bus.streams.reply("gw1"), bus.streams.reply("gw2")
    plain = Request("plain", g1, tok.encode(TEXTS[1]), [1, 2, 3] * 20)
    stopped = Request("stopped", g1, tok.encode("alpha beta 世界 STOP gamma delta"), [2] * 20, stop=["STOP"])
    other = Request("other", g2, tok.encode(TEXTS[0]) + [EOS], [3] * 20, finish="stop")
    bad = Request("bad", g2, [5000, 10**9, 6000], [1, 1, 1])
    replica = Replica(bus, model_dir, "c1")
    try:
        bus.r.xadd(bus.streams.detok(0), {FIELD: b"not msgpack at all"})  # logged and acked, loop lives on
        bus.r.xadd(bus.streams.detok(0), {FIELD: msgspec.msgpack.encode({"x": 1})})
        steps = send_steps(bus, [plain, stopped, other, bad])
        got1, batches1 = collect(bus, g1, {"plain": len(plain.rows), "stopped": len(stopped.rows)})
        got2, batches2 = collect(bus, g2, {"other": len(other.rows), "bad": len(bad.rows)})
        assert batches1 <= steps and batches2 <= steps  # one ReplyBatch per gateway per read, not per row

        text, last = assemble(got1["plain"])
        assert text == tok.decode(plain.ids, skip_special_tokens=True)
        assert (last.finish_reason, last.completion_tokens, last.prompt_tokens) == ("length", len(plain.ids), 11)

        text, last = assemble(got1["stopped"])
        assert text == "alpha beta 世界 " and last.finish_reason == "stop"
        # Rows after the hit (the engine had not seen the abort yet) still get their delta.
        assert sorted(d.offset for d in got1["stopped"]) == [off for off, _k, _f in stopped.rows]
        after = [d for d in got1["stopped"] if d.offset > last.offset]
        assert after and all((d.text, d.finish_reason) == ("", "stop") for d in after)

        text, last = assemble(got2["other"])
        assert text == TEXTS[0] and last.finish_reason == "stop"

        # The bad id fails its row (and later rows, whose context holds it); the gateway ends there.
        text, last = assemble(got2["bad"])
        assert (text, last.offset, last.finish_reason) == (tok.decode([5000]), 1, "error")
        deadline = time.monotonic() + 5
        while pending(bus) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pending(bus) == 0
        sent = aborts(bus)
        assert (["stopped"], "stop") in sent and (["bad"], "error") in sent
    finally:
        replica.close()


def test_two_replicas_share_steps(bus: Bus, model_dir: str, tok) -> None:
    """Consecutive steps decoded by different replicas, replies out of order, still exact text.
    Entries are first handed alternately to consumers a and b as if they had crashed mid-work,
    so each replica must also finish its own pending entries on start."""
    g = bus.streams.reply("gw")
    bus.ensure_group(bus.streams.detok(0), DETOKENIZER_GROUP)
    first = Request("first", g, tok.encode(TEXTS[2]), [1, 2] * 40, stop=["never"])
    n = send_steps(bus, [first])
    for s in range(n):  # deliver step s to consumer a or b, unacked
        got = bus.r.xreadgroup(DETOKENIZER_GROUP, "ab"[s % 2], {bus.streams.detok(0): ">"}, count=1)
        assert len(got[0][1]) == 1
    replicas = [Replica(bus, model_dir, "b"), Replica(bus, model_dir, "a")]
    try:
        got, _ = collect(bus, g, {"first": n})
        text, last = assemble(got["first"])
        assert text == tok.decode(first.ids) and last.finish_reason == "length"
        # Live traffic while both run: whichever replica takes a step, the text is exact.
        live = Request("live", g, tok.encode(TEXTS[1] + " 世界 STOP after"), [1, 3, 2] * 30, stop=["STOP"])
        send_steps(bus, [live], first_step=n)
        got, _ = collect(bus, g, {"live": len(live.rows)})
        text, last = assemble(got["live"])
        assert text == TEXTS[1] + " 世界 " and last.finish_reason == "stop"
        consumers = {c["name"].decode(): c for c in bus.r.xinfo_consumers(bus.streams.detok(0), DETOKENIZER_GROUP)}
        assert set(consumers) == {"a", "b"}
        deadline = time.monotonic() + 5
        while pending(bus) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pending(bus) == 0
        assert any(ids == ["live"] and why == "stop" for ids, why in aborts(bus))
    finally:
        for r in replicas:
            r.close()


def test_abandoned_entries_are_claimed(bus: Bus, model_dir: str, tok) -> None:
    """A replica that read entries and died: a live replica takes them over once idle."""
    g = bus.streams.reply("gw")
    bus.ensure_group(bus.streams.detok(0), DETOKENIZER_GROUP)
    req = Request("orphan", g, tok.encode(TEXTS[3]), [4] * 20)
    n = send_steps(bus, [req])
    assert len(bus.r.xreadgroup(DETOKENIZER_GROUP, "dead", {bus.streams.detok(0): ">"})[0][1]) == n
    time.sleep(0.2)
    stop = StopFlag(install=False)
    thread = threading.Thread(target=service.run, daemon=True,
                              args=(REDIS_URL, bus.streams.prefix, model_dir, "alive", stop),
                              kwargs={"claim_idle_ms": 100})
    thread.start()
    try:
        got, _ = collect(bus, g, {"orphan": n})
        assert assemble(got["orphan"])[0] == TEXTS[3]
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive() and pending(bus) == 0
