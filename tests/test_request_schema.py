"""The request schema (services/gateway/bodies.py, requests.py) through a real gateway: every field Rill does
not honour yet is refused by name, unknown fields are refused as OpenAI refuses them unless
--ignore-unknown-fields, hostile bodies are a 400 (an error frame on the WebSocket, whose other
requests carry on), and /openapi.json is generated from the same Structs.

The harness is test_gateway's: a live gateway on real Redis, the test playing the downstream services.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from test_gateway import (
    CHAT_OK,
    MODEL,
    Downstream,
    LiveServer,
    make_deltas,
    serving,
    ws_collect,
    ws_recv,
    ws_url,
)
from websockets.asyncio.client import connect

from rill.services.gateway.bodies import (
    DEFAULT_MAX_LOGPROBS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP,
    MAX_TOOLS,
    ChatCompletionRequest,
    CompletionRequest,
)
from rill.services.gateway.errors import APIError
from rill.services.gateway.openapi_spec import build_spec
from rill.services.gateway.requests import Admission, generate_requests, not_yet_fields, parse
from rill.shared.bus import FIELD
from rill.shared.request_params import ChatMessage
from rill.shared.schema import TokenizeReply, encode, tokenizer_input_decoder

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT_OK = {"prompt": "hi"}
REFUSED = {"a": 1}  # no field takes an object with key "a" as a no-op
GATEWAY = Path(__file__).resolve().parents[1] / "services" / "gateway"


@pytest.fixture
def gw() -> Iterator[LiveServer]:
    with serving() as srv:
        yield srv


@pytest.fixture
async def downstream(gw: LiveServer) -> AsyncIterator[Downstream]:
    d = Downstream(gw.prefix)
    yield d
    await d.close()


# ---------------------------------------------------------------------------------------------
# Refused fields


def _with_message(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi", **fields}]}


def refused_cases() -> list[tuple[str, dict[str, Any], str]]:
    """(path, body, param): every NotYet field of both bodies set to a value it refuses, nested
    ones, and the values the issue names."""
    cases = [(path, {**base, name: REFUSED}, name)
             for path, cls, base in ((CHAT, ChatCompletionRequest, CHAT_OK), (COMPLETIONS, CompletionRequest, PROMPT_OK))
             for name, _ in not_yet_fields(cls)]
    return cases + [
        (CHAT, {**CHAT_OK, "store": True}, "store"),
        (CHAT, {**CHAT_OK, "store": 0}, "store"),  # not false: JSON kinds, not Python equality
        (CHAT, {**CHAT_OK, "service_tier": "flex"}, "service_tier"),
        (COMPLETIONS, {**PROMPT_OK, "best_of": 2}, "best_of"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "input_audio", "input_audio": {}}]}]},
         "messages[0].content[1]"),
    ]


async def test_refused_fields_are_named_over_http_and_websocket(gw: LiveServer, downstream: Downstream) -> None:
    cases = refused_cases()
    assert len({param for _, _, param in cases}) > 15  # the enumeration finds them (fewer as more are honoured)
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        for path, body, param in cases:
            r = await c.post(path, json=body)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param, (body, err)
            assert "not supported yet" in err["message"] and err["type"] == "invalid_request_error", err
    async with connect(ws_url(gw)) as ws:
        await ws.send(json.dumps({"type": "chat", "id": "ok", **CHAT_OK}))
        req = await downstream.next_request()
        for i, (path, body, param) in enumerate(cases):
            await ws.send(json.dumps({"type": "chat" if path == CHAT else "completion", "id": i, **body}))
            f = await ws_recv(ws)
            assert (f["id"], f["type"], f["error"]["param"]) == (i, "error", param), (body, f)
            assert "not supported yet" in f["error"]["message"]
        await downstream.reply(req.reply_to, make_deltas(req.request_id, ["fine"]))
        assert (await ws_collect(ws, {"ok"}))["ok"][-1]["type"] == "done"
    assert await downstream.num_requests() == 1


async def test_no_op_values_and_metadata_are_accepted(gw: LiveServer, downstream: Downstream) -> None:
    """Values that ask for what Rill does anyway, and pure metadata, reach the tokenizer."""
    bodies = [
        (CHAT, {**CHAT_OK, "tool_choice": "none", "response_format": {"type": "text"}, "store": False,
                "service_tier": "auto", "user": "u", "metadata": {"k": "v"}, "safety_identifier": "s",
                "prompt_cache_key": "p", "tools": None, "functions": None, "modalities": ["text"],
                "add_generation_prompt": True, "echo": False}),
        (CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": [], "name": None},
                             {"role": "user", "content": "x"}]}),
        (COMPLETIONS, {**PROMPT_OK, "best_of": 1, "suffix": "", "length_penalty": 1, "use_beam_search": False,
                       "add_special_tokens": True, "echo": False}),
    ]
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        for path, body in bodies:
            post = asyncio.create_task(c.post(path, json=body))
            req = await downstream.next_request()
            await downstream.reply(req.reply_to, make_deltas(req.request_id, ["ok"]))
            assert (await post).status_code == 200, body


# ---------------------------------------------------------------------------------------------
# Unknown fields


async def test_unknown_fields_are_refused_as_openai_refuses_them(gw: LiveServer, downstream: Downstream) -> None:
    cases = [(CHAT, {**CHAT_OK, "frobnicate": 1}, "frobnicate"),
             (COMPLETIONS, {**PROMPT_OK, "frobnicate": None}, "frobnicate"),
             ("/v1/tokenize", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
             ("/detokenize", {"tokens": [1], "frobnicate": 1}, "frobnicate"),
             (CHAT, _with_message(frobnicate=1), "messages[0].frobnicate"),
             (CHAT, {**CHAT_OK, "stream": True, "stream_options": {"frobnicate": 1}}, "stream_options.frobnicate")]
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        for path, body, param in cases:
            r = await c.post(path, json=body)
            assert r.status_code == 400, body
            assert r.json()["error"] == {"message": f"Unrecognized request argument supplied: {param}",
                                         "type": "invalid_request_error", "param": param, "code": None}
    async with connect(ws_url(gw)) as ws:
        await ws.send(json.dumps({"type": "completion", "id": "u", **PROMPT_OK, "frobnicate": 1}))
        f = await ws_recv(ws)
        assert (f["id"], f["type"], f["error"]["param"]) == ("u", "error", "frobnicate")
    assert await downstream.num_requests() == 0


async def test_ignore_unknown_fields_accepts_and_logs_each_name_once(caplog: pytest.LogCaptureFixture) -> None:
    name = f"unknown_{uuid.uuid4().hex[:8]}"  # the log-once set lives as long as the process
    caplog.set_level(logging.WARNING, logger="rill.gateway.requests")
    with serving(ignore_unknown_fields=True) as srv:
        down = Downstream(srv.prefix)
        try:
            async with httpx.AsyncClient(base_url=srv.url, timeout=10) as c:
                for path, body in ((CHAT, CHAT_OK), (COMPLETIONS, PROMPT_OK), (CHAT, CHAT_OK)):
                    post = asyncio.create_task(c.post(path, json={**body, name: {"any": ["thing"]}}))
                    req = await down.next_request()
                    await down.reply(req.reply_to, make_deltas(req.request_id, ["ok"]))
                    assert (await post).status_code == 200
                # Known fields keep their rules; refused ones and nested unknown keys stay refused.
                for body, param in (({**CHAT_OK, name: 1, "temperature": 3}, "temperature"),
                                    ({**CHAT_OK, name: 1, "tools": [{}]}, "tools[0].function"),
                                    (_with_message(**{name: 1}), f"messages[0].{name}")):
                    r = await c.post(CHAT, json=body)
                    assert r.status_code == 400 and r.json()["error"]["param"] == param
                spec = (await c.get("/openapi.json")).json()["components"]["schemas"]
                assert "additionalProperties" not in spec["ChatCompletionRequest"]
            async with connect(ws_url(srv)) as ws:
                await ws.send(json.dumps({"type": "chat", "id": 1, **CHAT_OK, name: 2}))
                req = await down.next_request()
                await down.reply(req.reply_to, make_deltas(req.request_id, ["ok"]))
                assert (await ws_collect(ws, {1}))[1][-1]["type"] == "done"
        finally:
            await down.close()
    logged = [r for r in caplog.records if name in r.getMessage()]
    assert len(logged) == 1 and "ignoring unknown request field" in logged[0].getMessage()


# ---------------------------------------------------------------------------------------------
# Hostile bodies

DEEP = b"[" * 5000 + b"]" * 5000
BIG = b"9" * 400
CHAT_HEAD = b'{"messages": [{"role": "user", "content": "hi"}]'
# (body, param or None): each must be a clean 400; over the WebSocket an error frame.
HOSTILE: list[tuple[bytes, str | None]] = [
    (CHAT_HEAD + b', "temperature": ' + BIG + b"}", "temperature"),
    (CHAT_HEAD + b', "temperature": ' + BIG + b".5e99999}", "temperature"),
    (CHAT_HEAD + b', "seed": ' + BIG + b"}", "seed"),
    (CHAT_HEAD + b', "logit_bias": {"' + BIG + b'": 1}}', "logit_bias"),
    (CHAT_HEAD + b', "tools": ' + DEEP + b"}", None),
    (CHAT_HEAD + b', "response_format": {"a": ' + DEEP + b"}}", None),
    (CHAT_HEAD + b', "unknown": ' + DEEP + b"}", "unknown"),
    (b'{"messages": ' + DEEP + b"}", "messages[0]"),
    (DEEP, None),
    (CHAT_HEAD + b', "temperature": NaN}', None),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
    (b"\xef\xbb\xbf{}", None),
    (b'{"messages": [{"role": "user", "content": "hi"}], ', None),
    (b"[1]", None), (b'"text"', None), (b"3", None), (b"null", None),
]


def as_frame(body: bytes, cid: str) -> bytes:
    """The body as a chat frame with this id (bodies that are not an object stay as they are)."""
    if not body.startswith(b"{"):
        return body
    return b'{"type": "chat", "id": "' + cid.encode() + b'", ' + body[1:]


async def test_hostile_bodies_are_client_errors(gw: LiveServer, downstream: Downstream) -> None:
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        for body, param in HOSTILE:
            r = await c.post(CHAT, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (body[:60], r.text[:200])
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"], err
            assert param is None or err["param"] == param, (body[:60], err)
        assert (await c.get("/health")).status_code == 200


async def test_hostile_frames_leave_the_socket_serving(gw: LiveServer, downstream: Downstream) -> None:
    async with connect(ws_url(gw), max_size=None) as ws:
        await ws.send(json.dumps({"type": "chat", "id": "before", **CHAT_OK}))
        before = await downstream.next_request()
        for i, (body, param) in enumerate(HOSTILE):
            cid = f"h{i}"
            await ws.send(as_frame(body, cid))  # binary: a text frame could not carry invalid UTF-8
            f = await ws_recv(ws)
            assert f["type"] == "error" and f["id"] in (cid, None) and f["error"]["message"], (body[:60], f)
            assert param is None or f["id"] is None or f["error"]["param"] == param, (body[:60], f)
        await ws.send(json.dumps({"type": "completion", "id": "after", **PROMPT_OK}))
        after = await downstream.next_request()
        for req in (before, after):
            await downstream.reply(req.reply_to, make_deltas(req.request_id, ["still", " here"]))
        frames = await ws_collect(ws, {"before", "after"})
    for cid in ("before", "after"):
        assert "".join(f["text"] for f in frames[cid] if f["type"] == "delta") == "still here"
    assert await downstream.num_requests() == 2


# ---------------------------------------------------------------------------------------------
# Translation, tokenize paths


def test_bodies_translate_to_the_same_sampling_params() -> None:
    gate = Admission(MODEL)
    chat = parse(json.dumps({
        "model": MODEL, "messages": [{"role": "developer", "content": "d"},
                                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}]}],
        "temperature": 1, "top_p": 0.9, "top_k": -1, "min_p": 0.1, "presence_penalty": -2, "frequency_penalty": 2,
        "repetition_penalty": 1.5, "logit_bias": {"7": -100, "8": 5.5}, "seed": -(2**63), "stop": ["", "x"],
        "stop_token_ids": [0, 2**31 - 1], "ignore_eos": True, "skip_special_tokens": False,
        "include_stop_str_in_output": True, "n": MAX_N, "max_tokens": 3, "min_tokens": 3, "logprobs": True,
        "top_logprobs": DEFAULT_MAX_LOGPROBS, "priority": -5}), ChatCompletionRequest, gate)
    (req,) = generate_requests(chat, "r", "reply")
    assert req.messages == [ChatMessage("developer", "d"), ChatMessage("user", "a\nb")] and req.priority == -5
    p = req.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty) == (
        1.0, 0.9, 0, 0.1, -2.0, 2.0)
    assert (p.repetition_penalty, p.logit_bias, p.seed, p.stop, p.stop_token_ids) == (
        1.5, {7: -100.0, 8: 5.5}, -(2**63), ["x"], [0, 2**31 - 1])
    assert (p.ignore_eos, p.skip_special_tokens, p.include_stop_str_in_output, p.n) == (True, False, True, MAX_N)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (3, 3, DEFAULT_MAX_LOGPROBS, None)
    assert isinstance(p.temperature, float) and isinstance(p.presence_penalty, float)

    comp = parse(b'{"prompt": ["text"], "echo": true, "logprobs": 0, "stop": "s"}', CompletionRequest, gate)
    (req,) = generate_requests(comp, "r", "reply")
    assert (req.prompt, req.messages, req.params.stop, req.params.logprobs, req.params.prompt_logprobs) == (
        "text", None, ["s"], 0, 0)  # echo with logprobs scores the prompt too
    (plain,) = generate_requests(parse(b'{"prompt": [5, 6]}', CompletionRequest, gate), "r", "reply")
    assert plain.prompt == [5, 6] and plain.params == type(plain.params)()  # nothing set: every default
    batch = generate_requests(parse(b'{"prompt": ["a", [5, 6], "b"], "n": 2}', CompletionRequest, gate), "r", "x")
    assert [(b.request_id, b.prompt, b.params.n) for b in batch] == [("r-0", "a", 2), ("r-1", [5, 6], 2),
                                                                     ("r-2", "b", 2)]


def test_chat_template_settings_reach_the_tokenizer() -> None:
    """documents and reasoning_effort ride in the template's variables (chat_template_kwargs win, as in vLLM); the
    turn's ending is stated for the tokenizer, whose defaults are a plain new turn."""
    gate, docs = Admission(MODEL), [{"title": "Rivers", "text": "The Rhine is long."}]
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]

    def chat(**body: Any) -> Any:
        (req,) = generate_requests(parse(json.dumps({"messages": msgs, **body}), ChatCompletionRequest, gate), "r", "x")
        return req

    assert chat(documents=docs).chat_template_kwargs == {"documents": docs}
    assert chat(documents=docs, chat_template_kwargs={"documents": [], "k": 1}).chat_template_kwargs == {
        "documents": [], "k": 1}
    assert chat(reasoning_effort="low", documents=docs).chat_template_kwargs == {"reasoning_effort": "low",
                                                                                "documents": docs}
    assert (chat().add_generation_prompt, chat().continue_final_message, chat().chat_template_kwargs) == (True, False, {})
    assert (chat().add_special_tokens, chat(add_special_tokens=True).add_special_tokens) == (None, True)
    (text,) = generate_requests(parse(b'{"prompt": "p", "add_special_tokens": false}', CompletionRequest, gate), "r", "x")
    assert text.add_special_tokens is False
    cont = chat(continue_final_message=True)
    assert (cont.add_generation_prompt, cont.continue_final_message) == (False, True)
    for bad, param in (({"documents": [{"title": 1}]}, "documents"), ({"reasoning_effort": "lots"}, "reasoning_effort"),
                       ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message")):
        with pytest.raises(APIError) as err:
            chat(**bad)
        assert err.value.param is not None and err.value.param.startswith(param), err.value


async def _answer_tokenizer(down: Downstream, reply: TokenizeReply) -> str:
    """Answer the next tokenizer call; returns what kind of call it was."""
    msg = tokenizer_input_decoder.decode(await down.sent.next())
    await down.r.xadd(msg.reply_to, {FIELD: encode(msgspec.structs.replace(reply, request_id=msg.request_id))})
    return type(msg).__name__


async def test_v1_tokenize_and_detokenize_answer_beside_the_old_paths(gw: LiveServer, downstream: Downstream) -> None:
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        for prefix in ("", "/v1"):
            post = asyncio.create_task(c.post(f"{prefix}/tokenize", json={"prompt": "hi", "model": MODEL}))
            assert await _answer_tokenizer(downstream, TokenizeReply("", token_ids=[1, 2])) == "TokenizeRequest"
            # The context is the gateway's (the model's) while no engine has published the one it serves.
            assert (await post).json() == {"count": 2, "max_model_len": gw.gateway.max_model_len, "tokens": [1, 2]}
            post = asyncio.create_task(c.post(f"{prefix}/detokenize", json={"tokens": [1, 2]}))
            assert await _answer_tokenizer(downstream, TokenizeReply("", text="hi")) == "DetokenizeRequest"
            assert (await post).json() == {"prompt": "hi"}
        for body, param in (({"prompt": "x", "messages": CHAT_OK["messages"]}, "prompt"), ({}, "prompt"),
                            ({"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
                            ({"prompt": "x", "tools": []}, "tools"), ({"prompt": "x", "model": "no"}, "model")):
            r = await c.post("/v1/tokenize", json=body)
            assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (body, r.text)
        r = await c.post("/v1/detokenize", json={"tokens": [-1]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[0]"
        r = await c.post("/v1/tokenize", content=b"x", headers={"content-type": "text/plain"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "Content-Type"


# ---------------------------------------------------------------------------------------------
# The generated document, and one home per rule


async def test_openapi_is_generated_from_the_structs(gw: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        spec = (await c.get("/openapi.json")).json()
    assert {"/v1/tokenize", "/v1/detokenize", "/tokenize", "/detokenize"} <= spec["paths"].keys()
    schemas = spec["components"]["schemas"]
    chat, comp = schemas["ChatCompletionRequest"], schemas["CompletionRequest"]

    def value(body: dict[str, Any], name: str) -> dict[str, Any]:
        prop = body["properties"][name]
        return next(s for s in prop.get("anyOf", [prop]) if s.get("type") != "null")

    assert (value(chat, "temperature")["minimum"], value(chat, "temperature")["maximum"]) == (0, 2)
    assert value(chat, "top_p")["exclusiveMinimum"] == 0 and value(comp, "n")["maximum"] == MAX_N
    assert value(chat, "logit_bias")["maxProperties"] == MAX_LOGIT_BIAS
    assert next(s for s in chat["properties"]["stop"]["anyOf"] if s.get("type") == "array")["maxItems"] == MAX_STOP
    assert value(chat, "top_logprobs")["maximum"] == value(comp, "logprobs")["maximum"] == DEFAULT_MAX_LOGPROBS
    assert str(gw.gateway.max_model_len) in value(comp, "max_tokens")["description"]
    assert chat["required"] == ["messages"] and comp["required"] == ["prompt"]
    assert chat["additionalProperties"] is False
    assert value(chat, "tools")["maxItems"] == MAX_TOOLS and comp["properties"]["best_of"]["enum"] == [None, 1]
    assert {"TextFormat", "JsonObjectFormat", "JsonSchemaResponseFormat"} <= schemas.keys()
    assert schemas["StructuredOutputs"]["properties"]["structural_tag"]["enum"] == [None]  # NotYet, marked
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["items"]["discriminator"]["propertyName"] == \
        "role"
    other = build_spec(MODEL, 64, 5)["components"]["schemas"]  # filled in per gateway
    assert value(other["CompletionRequest"], "logprobs")["maximum"] == 5


def test_each_limit_has_one_home() -> None:
    """Request limits are declared once, in bodies.py: no second definition in the gateway and
    no hand-written request schema or field check beside it."""
    sources = {p.name: p.read_text() for p in GATEWAY.glob("*.py")}
    for const in ("MAX_STOP", "MAX_N", "MAX_LOGIT_BIAS", "MAX_TOKEN_ID", "MAX_REPETITION_PENALTY",
                  "DEFAULT_MAX_LOGPROBS", "INT64_MAX", "MAX_WS_ID_LEN", "MAX_TOOLS"):
        homes = [name for name, text in sources.items() if re.search(rf"^{const}\s*[:=]", text, re.M)]
        assert homes == ["bodies.py"], (const, homes)
    for name, text in sources.items():
        if name != "bodies.py":
            assert not re.search(r"2\s*\*\*\s*(31|63)|2147483647|\b128\b", text), name
    spec = sources["openapi_spec.py"]
    assert not re.search(r'"(temperature|top_p|top_k|logit_bias|stop|messages|seed|n)":\s*[{_]', spec)  # by hand
    for name in ("openai_api.py", "websocket.py"):
        assert not re.search(r"def (parse|_opt|_check)_?\w*", sources[name]), name


def test_ignore_unknown_fields_flag_reaches_the_gateway_only() -> None:
    from rill.services.cli import build_parser
    from rill.services.launcher import _child_argv

    for argv, on in ((["serve"], False), (["serve", "--ignore-unknown-fields"], True)):
        ns = build_parser().parse_args(argv)
        assert ns.ignore_unknown_fields is on
        assert ("--ignore-unknown-fields" in _child_argv(ns, "gateway", "/m", "g")) is on
        assert "--ignore-unknown-fields" not in _child_argv(ns, "worker", "/m", "w")
    one = build_parser().parse_args(["service", "gateway", "--ignore-unknown-fields"])
    assert one.ignore_unknown_fields
    for argv, on in ((["serve"], False), (["serve", "--trust-request-chat-template"], True)):
        ns = build_parser().parse_args(argv)
        assert ("--trust-request-chat-template" in _child_argv(ns, "tokenizer", "/m", "t")) is on
        assert "--trust-request-chat-template" not in _child_argv(ns, "gateway", "/m", "g")
