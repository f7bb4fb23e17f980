"""--reasoning-parser: a thinking model's `<think>…</think>` as reasoning_content, whole and streamed
(services/gateway/reasoning.py, chat_output.py). The end-to-end tests force the tags with a
regex through SmolLM2 on a second gateway of the shared stack and compare against the plain
gateway's text of the same greedy request."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import httpx
import msgspec
import openai
import pytest
import websockets.sync.client
from llguidance import LLMatcher
from service_stack import ServiceStack, extra_gateway

from rill.services.gateway import requests
from rill.services.gateway.bodies import ChatCompletionRequest
from rill.services.gateway.chat_output import ChatOutput, ChatStream
from rill.services.gateway.reasoning import END, Reasoning, ReasoningStream, parser_hint
from rill.services.gateway.requests import Admission
from rill.services.gateway.response_events import ResponseShape
from rill.services.gateway.responses import Output
from rill.services.gateway.responses_api import ResponsesRequest, chat_request
from rill.services.gateway.structured import _byte_tokenizer, grammar_of
from rill.services.gateway.tool_calls import ToolMode
from rill.services.gateway.tool_formats import Hermes
from rill.services.tokenizer.chat_template import template_messages
from rill.shared.schema import TextDelta

QWEN3, R1 = Reasoning(opened=False), Reasoning(opened=True)

SPLITS = [
    (QWEN3, "<think>Plan it.</think>\n\nThe answer.", ("Plan it.", "The answer.")),
    (QWEN3, "\n<think>\nx</think>y", ("\nx", "y")),
    (QWEN3, "No tags here.", (None, "No tags here.")),
    (QWEN3, "Text <think>late</think> tags", (None, "Text <think>late</think> tags")),
    (QWEN3, "<think>cut short", ("cut short", None)),
    (QWEN3, "<thi", (None, "<thi")),
    (QWEN3, "<think>a</think>", ("a", None)),
    (QWEN3, "", (None, "")),
    (R1, "Plan it.</think>Answer", ("Plan it.", "Answer")),
    (R1, "<think>Plan</think> Answer", ("Plan", "Answer")),
    (R1, "all reasoning, cut", ("all reasoning, cut", None)),
    (R1, "a </thin", ("a </thin", None)),
    (Reasoning(opened=False, include=False), "<think>p</think>A", (None, "A")),
]


@pytest.mark.parametrize(("mode", "text", "want"), SPLITS)
def test_split(mode: Reasoning, text: str, want: tuple[str | None, str | None]) -> None:
    assert mode.split(text) == want


@pytest.mark.parametrize(("mode", "text", "want"), SPLITS)
def test_streamed_pieces_add_up_to_the_split(mode: Reasoning, text: str, want: tuple[str | None, str | None]) -> None:
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream = ReasoningStream(mode)
        got = [stream.feed(p) for p in pieces] + [stream.finish()]
        reasoning, content = "".join(r for r, _ in got), "".join(c for _, c in got)
        assert (reasoning or None, content or None) == (want[0] or None, want[1] or None), pieces


@pytest.mark.parametrize(("mode", "text", "want"), SPLITS)
def test_the_reasoning_length_is_the_splits(mode: Reasoning, text: str, want: tuple[str | None, str | None]) -> None:
    """`length` (what usage counts as reasoning tokens) ends where the split's reasoning does."""
    n = mode.length(text)
    thought, _ = Reasoning(mode.opened).split(text)
    if thought is None:
        assert n == 0
    else:
        assert text[:n].endswith(END) or n == len(text)
        assert text[:n].removesuffix(END).endswith(thought)


def test_reasoning_tokens_are_those_of_the_deltas_through_the_end_tag() -> None:
    pieces = ["<think>", "Plan", " it.</th", "ink>\n\n", "Answer", "."]
    out = Output()
    out.reasoning = QWEN3
    for i, p in enumerate(pieces):
        out.add(TextDelta("r", i, 1, p, "stop" if i == len(pieces) - 1 else None, completion_tokens=i + 1))
    assert out.usage()["completion_tokens_details"] == {"reasoning_tokens": 4}
    out.reasoning = None
    assert "completion_tokens_details" not in out.usage()


def test_a_parser_the_template_disagrees_with_is_named_at_start() -> None:
    qwen3_like = "{{ '<|im_start|>assistant\\n' }}{% if not enable_thinking %}<think>\n\n</think>{% endif %}"
    assert "--reasoning-parser qwen3" in (parser_hint("none", ["{{ messages }}", qwen3_like]) or "")
    assert parser_hint("qwen3", [qwen3_like]) is None and parser_hint("none", ["{{ messages }}"]) is None
    assert "never opens <think>" in (parser_hint("deepseek_r1", ["{{ messages }}"]) or "")
    assert "never writes <think>" in (parser_hint("qwen3", ["{{ messages }}"]) or "")
    assert parser_hint("deepseek_r1", ["{{ '<|Assistant|><think>\\n' }}"]) is None


def test_a_tag_split_across_pieces_is_held_not_streamed() -> None:
    stream = ReasoningStream(QWEN3)
    assert stream.feed("<th") == ("", "")
    assert stream.feed("ink>Let me ") == ("Let me ", "")
    assert stream.feed("see</th") == ("see", "")  # "</th" may be the end tag
    assert stream.feed("ink>\n\n") == ("", "")
    assert stream.feed("Four.") == ("", "Four.")


def test_responses_stream_opens_a_reasoning_item_first() -> None:
    text = "<think>Look it up.</think>\n\nParis."
    shape = ResponseShape(msgspec.json.decode(b'{"input": "Capital of France?"}', type=ResponsesRequest), "m")
    fmt = shape.formatter(ChatOutput(reasoning=QWEN3))
    events = [TextDelta("r", i, 1, text[i * 4:i * 4 + 4], "stop" if i * 4 + 4 >= len(text) else None,
                        prompt_tokens=5, completion_tokens=i + 1) for i in range((len(text) + 3) // 4)]
    sse = (fmt.head(events[:1]) + fmt.render(events[1:])).decode()
    got = [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: ")]
    kinds = [e["type"] for e in got]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    added = [e["item"]["type"] for e in got if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    assert "".join(e["delta"] for e in got if e["type"] == "response.reasoning_text.delta") == "Look it up."
    assert "".join(e["delta"] for e in got if e["type"] == "response.output_text.delta") == "Paris."
    final = got[-1]["response"]["output"]
    assert [(o["type"], o["status"]) for o in final] == [("reasoning", "completed"), ("message", "completed")]
    # Through the delta that completed "</think>" (its 26th character, in the 7th 4-character delta).
    assert got[-1]["response"]["usage"]["output_tokens_details"] == {"reasoning_tokens": 7}
    assert shape.full(_output(text), ChatOutput(reasoning=QWEN3))["output"][0]["content"] == \
        [{"type": "reasoning_text", "text": "Look it up."}]


def _output(text: str) -> Output:
    out = Output()
    out.add(TextDelta("r", 0, 1, text, "stop", prompt_tokens=5, completion_tokens=1))
    return out


def test_reasoning_before_a_tool_call() -> None:
    text = '<think>Use the tool.</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    mode = ChatOutput(ToolMode("auto", Hermes()), QWEN3)
    message, finish = mode.message(text, "stop")
    assert message["reasoning_content"] == "Use the tool." and message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"] and finish == "tool_calls"
    stream = ChatStream(mode)
    deltas = [stream.feed(text[i:i + 5]) for i in range(0, len(text), 5)] + [stream.feed("", final=True)]
    assert "".join(d.reasoning for d in deltas) == "Use the tool."
    assert "".join(d.content for d in deltas) == ""  # the call's text is held, then parsed
    assert [c["function"]["arguments"] for d in deltas for c in d.calls] == ['{"city": "Paris"}']


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _grammar(parser: str, **constraint: object) -> str:
    body = {"messages": [{"role": "user", "content": "x"}], "structured_outputs": constraint}
    grammar = grammar_of(msgspec.convert(body, ChatCompletionRequest), parser)
    assert grammar is not None and not LLMatcher.validate_grammar(grammar)
    return grammar


def _accepts(grammar: str, text: str, done: bool = True) -> bool:
    """Whether the grammar takes `text` byte by byte (and, `done`, may end after it)."""
    m = LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    return m.consume_tokens(list(text.encode())) and (m.is_accepting() or not done)


def test_a_grammar_shapes_the_answer_after_the_reasoning() -> None:
    """As vLLM applies a grammar once reasoning ends: the reasoning the parser reads is free text
    up to the first end tag, then the constraint holds."""
    qwen3, r1 = _grammar("qwen3", json=SCHEMA), _grammar("deepseek_r1", json=SCHEMA)
    for text in ('{"a":1}', '<think>Plan {"a": 2} it.</think>\n\n{"a":1}', '<think>\nx</think>{"a":1}'):
        assert _accepts(qwen3, text), text
    for text in ('Plan it.</think>\n{"a":1}', '<think>x</think>{"a":1}'):
        assert _accepts(r1, text), text
    assert _accepts(r1, "No end tag yet", done=False) and not _accepts(r1, '{"a":1}')  # R1 reasons first
    for text in ('<think>x</think>prose', 'prose<think>x</think>{"a":1}', '<think>x</think>{"a":1}</think>'):
        assert not _accepts(qwen3, text), text
    assert _accepts(_grammar("qwen3", regex="[0-9]+"), "<think>count</think> 42")
    assert _accepts(_grammar("qwen3", choice=["yes", "no"]), "<think>hm</think>no")
    assert _accepts(_grammar("qwen3", grammar='root ::= "yes" | "no"'), "<think>hm</think>yes")
    told_not_to = msgspec.convert({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"},
                                   "chat_template_kwargs": {"enable_thinking": False}}, ChatCompletionRequest)
    assert not _accepts(requests.sampling_params(told_not_to, "qwen3").grammar or "", '<think>x</think>{"a":1}')
    told_not_to.chat_template_kwargs = {}
    assert _accepts(requests.sampling_params(told_not_to, "qwen3").grammar or "", '<think>x</think>{"a":1}')
    plain = _grammar("none", json=SCHEMA)  # no parser: no reasoning admitted
    assert _accepts(plain, '{"a":1}') and not _accepts(plain, '<think>x</think>{"a":1}')


def test_a_grammar_that_writes_the_tags_holds_from_the_first_token() -> None:
    grammar = _grammar("qwen3", regex=THOUGHT)
    assert _accepts(grammar, "<think>one two three.</think>\n\nRivers run far.")
    assert not _accepts(grammar, "<think>Anything at all</think>\n\nRivers run far.")


def test_the_reasoning_grammar_runs_on_the_models_tokens(smollm2_dir: str) -> None:
    """The worker's matcher, on SmolLM2's tokenizer, takes a thinking model's output token by
    token (tags spelled over several tokens, the answer's first token after them)."""
    from rill.services.worker.structured import GrammarError, Grammars
    from rill.shared.tokenizer_files import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    grammars = Grammars(smollm2_dir, tok.tokenizer.get_vocab_size())
    grammar = _grammar("qwen3", json=SCHEMA)
    for text in ('<think>\nThe user wants {"a": 1}.\n</think>\n\n{"a":7}', '{"a":7}'):
        m = grammars.matcher(grammar, tok.encode(text, add_special_tokens=False))
        assert m.is_accepting(), text
    with pytest.raises(GrammarError):
        grammars.matcher(grammar, tok.encode("<think>x</think>\n\nprose", add_special_tokens=False))


# ---------------------------------------------------------------------------------------------
# Through the pipeline

THOUGHT = r"<think>[a-z]{1,8}( [a-z]{1,8}){2,5}\.</think>\n\n[A-Z][a-z]{1,8}( [a-z]{1,8}){1,4}\."


def _body(**extra: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "Think first, then tell me a fact about rivers."}],
            "temperature": 0, "max_tokens": 80, "structured_outputs": {"regex": THOUGHT}, **extra}


@pytest.fixture(scope="module")
def reasoning_url(stack: ServiceStack, smollm2_dir: str) -> Iterator[str]:
    """A second gateway on the shared stack, started with --reasoning-parser qwen3."""
    with extra_gateway(smollm2_dir, stack.redis_url, stack.prefix, "gateway-think", "--max-model-len", "2048",
                       "--reasoning-parser", "qwen3") as (_, url):
        yield url


@pytest.fixture(scope="module")
def raw(stack: ServiceStack) -> str:
    """The plain gateway's text of the forced output: the tags left in the content."""
    resp = httpx.post(f"{stack.base_url}/v1/chat/completions", json=_body(), timeout=120)
    assert resp.status_code == 200, resp.text
    text = resp.json()["choices"][0]["message"]["content"]
    assert text.startswith("<think>") and "</think>\n\n" in text, text
    return text


@pytest.fixture(scope="module")
def thought_tokens(stack: ServiceStack) -> int:
    """The forced output's tokens through the one that completes "</think>" (the plain gateway's logprobs)."""
    resp = httpx.post(f"{stack.base_url}/v1/chat/completions", json=_body(logprobs=True), timeout=120)
    text = ""
    for k, entry in enumerate(resp.json()["choices"][0]["logprobs"]["content"]):
        text += entry["token"]
        if "</think>" in text:
            return k + 1
    raise AssertionError(text)


def _parts(raw: str) -> tuple[str, str]:
    thought, answer = raw.removeprefix("<think>").split("</think>", 1)
    return thought, answer.lstrip()


def test_whole_and_streamed_chat(reasoning_url: str, raw: str, thought_tokens: int) -> None:
    thought, answer = _parts(raw)
    resp = httpx.post(f"{reasoning_url}/v1/chat/completions", json=_body(), timeout=120)
    message = resp.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (thought, answer)
    assert resp.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": thought_tokens}
    client = openai.OpenAI(base_url=f"{reasoning_url}/v1", api_key="unused", max_retries=0, timeout=120)
    body = {k: v for k, v in _body().items() if k not in ("messages", "temperature", "max_tokens")}
    chunks = list(client.chat.completions.create(model=client.models.list().data[0].id, messages=_body()["messages"], temperature=0,
                                                 max_tokens=80, stream=True, extra_body=body,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thought_tokens
    streamed_thought = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                               for c in chunks if c.choices)
    streamed_answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (streamed_thought, streamed_answer) == (thought, answer)
    hidden = httpx.post(f"{reasoning_url}/v1/chat/completions", json=_body(include_reasoning=False), timeout=120)
    message = hidden.json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"] == answer


def test_websocket(reasoning_url: str, raw: str) -> None:
    thought, answer = _parts(raw)
    frames = []
    with websockets.sync.client.connect(reasoning_url.replace("http", "ws") + "/v1/ws") as ws:
        ws.send(json.dumps({"type": "chat", "id": 1, **_body()}))
        while not frames or frames[-1]["type"] == "delta":
            frames.append(json.loads(ws.recv(timeout=120)))
    assert frames[-1]["type"] == "done", frames[-1]
    assert "".join(f.get("reasoning", "") for f in frames[:-1]) == thought
    assert "".join(f["text"] for f in frames[:-1]) == answer


def test_structured_output_under_a_reasoning_parser(reasoning_url: str) -> None:
    """The grammar after the reasoning runs in the worker; SmolLM2 does not think, so its
    answer is the JSON from the first token."""
    body = {"messages": [{"role": "user", "content": "Give me a as a number."}], "temperature": 0, "max_tokens": 30,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}
    resp = httpx.post(f"{reasoning_url}/v1/chat/completions", json=body, timeout=120)
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop", resp.text
    assert isinstance(json.loads(choice["message"]["content"])["a"], int) and "reasoning_content" not in choice["message"]


def test_include_reasoning_false_without_a_parser_is_refused(stack: ServiceStack) -> None:
    resp = httpx.post(f"{stack.base_url}/v1/chat/completions", json=_body(include_reasoning=False), timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "include_reasoning", resp.text


def test_a_reasoning_turn_sent_back_reaches_the_template(reasoning_url: str) -> None:
    """A client that appends the reply's message as it came (reasoning_content included) gets a
    200, and the field reaches the chat template; a Responses reasoning item does the same."""
    turn = {"role": "assistant", "content": "Rivers flow.", "reasoning_content": "Say something short."}
    body = {"messages": [{"role": "user", "content": "A fact?"}, turn, {"role": "user", "content": "Another?"}],
            "max_tokens": 4, "temperature": 0}
    resp = httpx.post(f"{reasoning_url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    chat, _ = chat_request(msgspec.json.decode(json.dumps({"input": [
        {"type": "message", "role": "user", "content": "A fact?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Short."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rivers flow."}]},
        {"type": "message", "role": "user", "content": "Another?"}]}), type=ResponsesRequest), Admission("m"))
    messages = template_messages(requests.chat_messages(chat.messages))
    assert [m.get("reasoning_content") for m in messages] == [None, "Short.", None]
    assert template_messages(requests.chat_messages(msgspec.convert(body, ChatCompletionRequest).messages))[1][
        "reasoning_content"] == "Say something short."
