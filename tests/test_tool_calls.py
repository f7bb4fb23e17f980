"""Tool calls out of model text: the hermes and llama3_json parsers, the forced-call schemas and
the streaming hold-back, without a model (the end-to-end runs are in test_structured_outputs.py)."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest

from rill.services.gateway.bodies import ChatCompletionRequest
from rill.services.gateway.chat_tools import FunctionTool
from rill.services.gateway.tool_calls import ToolMode, ToolStream, calls_finish, forced_schema, tool_mode
from rill.services.gateway.tool_formats import GraniteJson, Hermes, Llama3Json, Mistral, Phi4Mini, pick_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = msgspec.convert([WEATHER, TIME], list[FunctionTool])


def args(call: dict) -> dict:
    return json.loads(call["function"]["arguments"])


def auto(parser) -> ToolMode:
    return ToolMode("auto", parser)


def test_hermes_parses_calls_and_keeps_leading_content() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = auto(Hermes()).message(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert args(calls[0]) == {"city": "Oslo"} and calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize("text", ["no call here", "<tool_call>{not json}</tool_call>",
                                  '<tool_call>{"arguments": {}}</tool_call>'])
def test_hermes_leaves_what_does_not_parse_as_content(text: str) -> None:
    assert auto(Hermes()).message(text) == (text, [])


def test_llama3_json_parses_semicolon_separated_calls() -> None:
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}'
    content, calls = auto(Llama3Json()).message(text)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert args(calls[0]) == {"city": "Rome"}
    assert auto(Llama3Json()).message("The weather is fine.") == ("The weather is fine.", [])


def test_parser_follows_the_chat_template() -> None:
    assert pick_parser("auto", ["{% if tools %}<tool_call>{% endif %}"]).name == "hermes"
    assert pick_parser("auto", ["<|start_header_id|>ipython<|end_header_id|>"]).name == "llama3_json"
    assert pick_parser("auto", []).name == "hermes"
    assert pick_parser("llama3_json", ["<tool_call>"]).name == "llama3_json"


def test_granite_calls_follow_their_marker_as_a_json_array() -> None:
    text = ('Checking.<|tool_call|>[{"arguments": {"city": "Oslo"}, "name": "get_weather"}, '
            '{"name": "get_time", "arguments": {}}]')
    content, calls = auto(GraniteJson()).message(text)
    assert content == "Checking." and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert args(calls[0]) == {"city": "Oslo"}
    for bad in ("No call here.", "<|tool_call|>[{\"name\": ", "<|tool_call|>[]", "<|tool_call|>[{\"arguments\": {}}]"):
        assert auto(GraniteJson()).message(bad) == (bad, [])
    assert pick_parser("auto", ["{%- if message.tool_calls %}<|tool_call|>{{ message.tool_calls | tojson }}"]).name \
        == "granite"
    s = ToolStream(ToolMode("auto", GraniteJson()))
    assert s.feed("Checking.<|tool") == ("Checking.", [])  # the marker may be starting: held
    content, deltas = s.feed('_call|>[{"name": "get_time", "arguments": {}}]')
    assert content == "" and [d["function"]["name"] for d in deltas] == ["get_time"]
    tail, more, calls = s.finish()
    assert tail == "" and more == [] and calls[0]["id"] == deltas[0]["id"]


def test_phi4_mini_calls_with_or_without_brackets_and_end_tag() -> None:
    """Phi-4-mini writes `<|tool_call|>[...]<|/tool_call|>`, at times without the brackets or the
    end tag; each form is the same calls, streamed as written."""
    want = [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    items = '{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}'
    for text in (f"<|tool_call|>[{items}]<|/tool_call|>", f"<|tool_call|>{items}<|/tool_call|>",
                 f"<|tool_call|>[{items}]", f"Let me see.<|tool_call|>{items}"):
        mode = ToolMode("auto", Phi4Mini())
        content, calls = mode.message(text)
        assert [(c["function"]["name"], args(c)) for c in calls] == want, text
        assert content == ("Let me see." if text.startswith("Let") else None)
        _, deltas, streamed_calls = streamed(mode, text)
        assert_deltas_add_up(deltas, streamed_calls)
    assert pick_parser("phi4_mini", []).name == "phi4_mini"


def test_mistral_calls_in_either_of_its_formats() -> None:
    """[TOOL_CALLS] then a JSON array (ids after the arguments, as Mistral writes them in its
    history), or name[ARGS]{...} per call (tokenizer v11 on); both streamed as written."""
    want = [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    for text in ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "a1b2c3d4e"}, '
                 '{"name": "get_time", "arguments": {}, "id": "f5g6h7i8j"}]',
                 '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", '
                 '"arguments": {}}]',
                 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}'):
        mode = ToolMode("auto", Mistral())
        content, calls = mode.message(text)
        assert [(c["function"]["name"], args(c)) for c in calls] == want, text
        assert content == ("Sure." if text.startswith("Sure") else None)
        _, deltas, streamed_calls = streamed(mode, text, step=2)
        assert_deltas_add_up(deltas, streamed_calls)
        assert len(deltas) > 4
    assert pick_parser("auto", ['{{- "[TOOL_CALLS] [" }}']).name == "mistral"


def test_qwen3_coder_xml_calls_take_their_schemas_types() -> None:
    """Qwen3-Coder's XML calls: each parameter typed by the function's schema (a string stays
    text even when it reads as a number), one streaming once written, the object closed at
    </function>; a call cut short is not valid JSON, so its finish stays its own."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"},
                                               "days": {"type": "integer"}, "metric": {"type": "boolean"},
                                               "hours": {"type": "array"}, "note": {"type": ["string", "null"]}}}
    tool = {"type": "function", "function": {"name": "forecast", "parameters": schema}}
    req = msgspec.convert({"messages": [{"role": "user", "content": "hi"}], "tools": [tool, TIME]},
                          ChatCompletionRequest)
    mode = tool_mode(req, "qwen3_coder")
    text = ("Checking.\n<tool_call>\n<function=forecast>\n<parameter=city>\nSan\nJose\n</parameter>\n"
            "<parameter=zip>\n95112\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\n"
            "true\n</parameter>\n<parameter=hours>\n[6, 12]\n</parameter>\n<parameter=note>\n42\n</parameter>\n"
            "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
    content, calls = mode.message(text)
    assert content == "Checking." and [c["function"]["name"] for c in calls] == ["forecast", "get_time"]
    assert args(calls[0]) == {"city": "San\nJose", "zip": "95112", "days": 3, "metric": True, "hours": [6, 12],
                              "note": "42"} and args(calls[1]) == {}
    assert calls_finish("stop", calls) == "tool_calls"
    _, deltas, streamed_calls = streamed(mode, text, step=4)
    assert_deltas_add_up(deltas, streamed_calls)
    assert len([d for d in deltas if d["index"] == 0]) >= 7  # the name, then a piece per parameter and the end
    cut = mode.message(text[:text.index("<parameter=days>")])[1]
    assert cut[0]["function"]["arguments"] == '{"city": "San\\nJose", "zip": "95112"'
    assert calls_finish("length", cut) == "length" and calls_finish("stop", cut) == "stop"
    assert pick_parser("auto", ["<tool_call>\n<function={{ name }}>\n<parameter={{ key }}>"]).name == "qwen3_coder"


def test_a_request_with_tools_keeps_special_tokens() -> None:
    """A call's marker is a special token in some vocabularies (Granite's, Phi-4-mini's): with
    tools ("auto") the output keeps special tokens unless the request says otherwise."""
    from rill.services.gateway.requests import sampling_params

    def params(**kw: object):
        return sampling_params(msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **kw},
                                               ChatCompletionRequest))

    assert params(tools=[WEATHER]).skip_special_tokens is False
    assert params(tools=[WEATHER], skip_special_tokens=True).skip_special_tokens is True
    assert params().skip_special_tokens is True
    assert params(tools=[WEATHER], tool_choice="none").skip_special_tokens is True


def test_forced_schemas_accept_exactly_the_offered_calls() -> None:
    required = forced_schema(TOOLS, "required", parallel=True)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}},
                         {"name": "get_time", "parameters": {}}], required)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    one = forced_schema(TOOLS, "required", parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, one)
    assert forced_schema(TOOLS, "get_weather", True) == WEATHER["function"]["parameters"]
    assert forced_schema(TOOLS, "auto", True) is None


def test_stream_holds_back_a_possible_call_and_releases_plain_text() -> None:
    s = ToolStream(ToolMode("auto", Hermes()))
    assert s.feed("Sure, ") == ("Sure, ", [])
    assert s.feed("<tool") == ("", [])  # may be a marker starting
    assert s.feed("_call>") == ("", [])
    content, deltas = s.feed('{"name": "get_time", "arguments": {}}</tool_call>')
    assert content == "" and deltas == [{"index": 0, "id": deltas[0]["id"], "type": "function",
                                         "function": {"name": "get_time", "arguments": "{}"}}]
    tail, more, calls = s.finish()
    assert tail == "" and more == [] and calls == [{"id": deltas[0]["id"], "type": "function",
                                                    "function": {"name": "get_time", "arguments": "{}"}}]
    plain = ToolStream(ToolMode("auto", Hermes()))
    assert plain.feed("a <tool") == ("a ", [])
    assert plain.feed("box> is fine") == ("<toolbox> is fine", [])
    assert plain.finish() == ("", [], [])


def test_forced_calls_stream_their_arguments_as_generated() -> None:
    """Piece by piece, as OpenAI streams them: a call's id and name once its name is whole, then
    its arguments; the deltas add up to the calls of the finished text, with the same ids."""
    whole = '[{"name":"get_weather","parameters":{"city":"Oslo","unit":"c"}},{"name":"get_time","parameters":{}}]'
    for mode, text in ((ToolMode("required", Hermes()), whole),
                       (ToolMode("get_weather", Hermes()), '{"city":"Oslo","unit":"c"}')):
        s = ToolStream(mode)
        deltas = []
        for i in range(0, len(text), 3):
            content, got = s.feed(text[i:i + 3])
            assert content == ""
            deltas += got
        tail, more, calls = s.finish()
        deltas += more
        assert tail == "" and calls == [{**c, "id": calls[k]["id"]} for k, c in enumerate(mode.message(text)[1])]
        assert len(deltas) > 2 * len(calls)  # arguments arrived in pieces
        for k, call in enumerate(calls):
            mine = [d for d in deltas if d["index"] == k]
            assert mine[0]["id"] == call["id"] and mine[0]["function"]["name"] == call["function"]["name"]
            assert all("id" not in d for d in mine[1:])
            assert "".join(d["function"]["arguments"] for d in mine) == call["function"]["arguments"]
            json.loads(call["function"]["arguments"])


def streamed(mode: ToolMode, text: str, step: int = 3) -> tuple[str, list[dict], list[dict]]:
    """`text` fed `step` characters at a time: (content streamed, every tool-call delta, the calls)."""
    s = ToolStream(mode)
    content, deltas = "", []
    for i in range(0, len(text), step):
        piece, got = s.feed(text[i:i + step])
        content += piece
        deltas += got
    tail, more, calls = s.finish()
    return content + tail, deltas + more, calls


def assert_deltas_add_up(deltas: list[dict], calls: list[dict]) -> None:
    for k, call in enumerate(calls):
        mine = [d for d in deltas if d["index"] == k]
        assert mine[0]["id"] == call["id"] and mine[0]["function"]["name"] == call["function"]["name"]
        assert all("id" not in d for d in mine[1:])
        assert "".join(d["function"]["arguments"] for d in mine) == call["function"]["arguments"]


@pytest.mark.parametrize("parser, text", [
    (Hermes(), 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
               '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
    (Llama3Json(), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}; '
                   '{"name": "get_time", "parameters": {}}'),
    (GraniteJson(), 'Checking.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}, '
                    '{"arguments": {}, "name": "get_time"}]'),
])
def test_calls_in_the_models_own_format_stream_as_written(parser, text: str) -> None:
    """Each call's id and name as soon as its name is written, then its arguments piece by piece
    (one written arguments-first goes out whole once it is); the content before the calls
    streams, and all of it adds up to the finished text's message."""
    mode = ToolMode("auto", parser)
    content, deltas, calls = streamed(mode, text)
    want_content, want = mode.message(text)
    assert content.strip() == (want_content or "") and [c["function"] for c in calls] == [c["function"] for c in want]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert args(calls[0]) == {"city": "Oslo", "unit": "c"} and args(calls[1]) == {}
    assert len([d for d in deltas if d["index"] == 0]) > 5  # the arguments arrived in pieces
    assert_deltas_add_up(deltas, calls)
    assert calls_finish("stop", calls) == "tool_calls"
    one = ToolMode("auto", parser, parallel=False)
    assert [c["function"]["name"] for c in streamed(one, text)[2]] == ["get_weather"]


def test_a_call_cut_short_keeps_what_was_written() -> None:
    """max_tokens inside a hermes call's arguments: the call with its arguments so far, as
    streamed, and the finish stays "length"; a name not yet whole is no call."""
    text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Os'
    content, deltas, calls = streamed(ToolMode("auto", Hermes()), text)
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert calls[0]["function"]["arguments"] == '{"city": "Os'
    assert_deltas_add_up(deltas, calls)
    assert calls_finish("length", calls) == "length" and calls_finish("stop", calls) == "stop"
    text = 'Sure.<tool_call>{"name": "get_wea'
    assert streamed(ToolMode("auto", Hermes()), text) == (text, [], [])


def test_hermes_arguments_may_hold_the_end_tag_or_be_a_string() -> None:
    code = {"code": "print('</tool_call>')"}
    text = f'<tool_call>{{"name": "run", "arguments": {json.dumps(code)}}}</tool_call>'
    content, deltas, calls = streamed(ToolMode("auto", Hermes()), text, step=2)
    assert content == "" and args(calls[0]) == code
    assert_deltas_add_up(deltas, calls)
    text = '<tool_call>{"name": "run", "arguments": "{\\"x\\": 1}"}</tool_call>'
    content, deltas, calls = streamed(ToolMode("auto", Hermes()), text)
    assert args(calls[0]) == {"x": 1}
    assert_deltas_add_up(deltas, calls)


def test_output_json_cannot_read_is_text_not_an_error() -> None:
    """Arguments nested deeper than the JSON decoder goes, and a name with an escape JSON does not
    know: the call is cut short or no call, as streamed, never an exception."""
    deep = '<tool_call>{"name": "a", "arguments": {"x": ' + "[" * 5000 + "]" * 5000 + "}}</tool_call>"
    content, deltas, calls = streamed(ToolMode("auto", Hermes()), deep, step=500)
    assert [c["function"]["name"] for c in calls] == ["a"] and calls_finish("stop", calls) == "stop"
    assert_deltas_add_up(deltas, calls)
    bad = '<tool_call>{"name": "a\\q", "arguments": {}}</tool_call>'
    assert streamed(ToolMode("auto", Hermes()), bad) == (bad, [], [])
    assert streamed(ToolMode("required", Hermes()), '[{"name": "a", "parameters": ' + "[" * 5000)[2][0]["function"][
        "name"] == "a"


def test_forced_modes_turn_json_into_calls() -> None:
    content, calls = ToolMode("required", Hermes()).message('[{"name": "get_weather", "parameters": {"city": "X"}}]')
    assert content is None and calls[0]["function"]["name"] == "get_weather" and args(calls[0]) == {"city": "X"}
    content, calls = ToolMode("get_weather", Hermes()).message('{"city": "Y"}')
    assert calls[0]["function"]["name"] == "get_weather" and args(calls[0]) == {"city": "Y"}
    assert ToolMode("auto", Hermes(), parallel=False).message(
        "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\"}</tool_call>"
    )[1][0]["function"]["name"] == "a"


def test_forced_calls_cut_short_keep_what_was_generated() -> None:
    """max_tokens in the middle of a forced call: the calls so far, the last one's arguments as
    generated, never the grammar's array as content; the finish stays "length"."""
    required = ToolMode("required", Hermes())
    whole = '{"name":"get_weather","parameters":{"city":"Oslo"}}'
    for text, names, last_args in (
        ("[" + whole + ',{"name":"get_time","parameters":{"ci', ["get_weather", "get_time"], '{"ci'),
        ('[{"name":"get_weather","parameters":', ["get_weather"], ""),
        ('[{"name":"get_wea', [], None),
        ("[" + whole, ["get_weather"], '{"city":"Oslo"}'),
    ):
        content, calls = required.message(text)
        assert content is None and [c["function"]["name"] for c in calls] == names, text
        if calls:
            got = calls[-1]["function"]["arguments"]
            assert got == last_args or json.loads(got) == json.loads(last_args)
        stream = ToolStream(required)
        assert stream.feed(text)[0] == ""
        tail, _, streamed = stream.finish()
        assert tail == "" and [c["function"]["name"] for c in streamed] == names
    cut_named = ToolMode("get_weather", Hermes()).message('{"city": "Os')[1]
    assert calls_finish("length", cut_named) == "length"
    assert calls_finish("stop", cut_named) == "stop"  # a stop string inside the arguments
    assert calls_finish("stop", required.message("[" + whole + "]")[1]) == "tool_calls"


def test_tool_choice_rules() -> None:
    from rill.services.gateway.errors import APIError
    from rill.services.gateway.requests import Admission, parse

    def body(**kw: object) -> bytes:
        return json.dumps({"messages": [{"role": "user", "content": "hi"}], **kw}).encode()

    gate = Admission("m")
    parse(body(tools=[WEATHER], tool_choice="required"), ChatCompletionRequest, gate)
    parse(body(tool_choice="none"), ChatCompletionRequest, gate)
    for kw, param in ((dict(tool_choice="required"), "tool_choice"), (dict(tool_choice="auto"), "tool_choice"),
                      (dict(parallel_tool_calls=False), "parallel_tool_calls"),
                      (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
                       "tool_choice"),
                      (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
                       "tool_choice")):
        with pytest.raises(APIError) as err:
            parse(body(**kw), ChatCompletionRequest, gate)
        assert err.value.param == param, err.value
