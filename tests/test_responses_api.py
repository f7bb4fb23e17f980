"""POST /v1/responses through the official openai client against the real stack (SmolLM2): the
same greedy text, usage and tool calls as /v1/chat/completions for the same conversation, the
typed stream events in order, structured output, and a 400 naming each field Rill refuses."""

from __future__ import annotations

import json
import uuid

import httpx
import jsonschema
import openai
import pydantic
import pytest
from service_stack import ServiceStack

WEATHER_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city"],
                  "properties": {"city": {"type": "string", "maxLength": 20}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER_PARAMS, "strict": True}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]


def test_text_and_usage_equal_chat(client: openai.OpenAI, mid: str) -> None:
    for max_tokens in (8, 200):
        r = client.responses.create(model=mid, instructions="Be brief.", input="Name three colours.",
                                    max_output_tokens=max_tokens, temperature=0)
        c = client.chat.completions.create(model=mid, max_tokens=max_tokens, temperature=0, messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}])
        assert r.output_text == c.choices[0].message.content and r.output_text
        assert r.status == ("incomplete" if c.choices[0].finish_reason == "length" else "completed")
        assert (r.incomplete_details is not None) == (r.status == "incomplete")
        assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
        assert r.id.startswith("resp_") and r.output[0].type == "message" and r.output[0].role == "assistant"


def test_cached_prompt_tokens_are_reported(client: openai.OpenAI, mid: str) -> None:
    """usage's cached tokens: none for a new prompt, its shared full blocks when it comes again,
    the same count through /v1/responses."""
    system = f"Session {uuid.uuid4().hex}. Answer in one word."
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Rivers " * 60}]
    first, again = (client.chat.completions.create(model=mid, messages=msgs, max_tokens=2, temperature=0)
                    for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens - 16 <= cached < first.usage.prompt_tokens, again.usage
    r = client.responses.create(model=mid, instructions=system, input="Rivers " * 60, max_output_tokens=2,
                                temperature=0)
    assert r.usage.input_tokens_details.cached_tokens == cached


def test_stream_events_in_order(client: openai.OpenAI, mid: str) -> None:
    events = list(client.responses.create(model=mid, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Say hello."}]}], max_output_tokens=24, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == events[-2].item.content[0].text
    whole = client.responses.create(model=mid, input="Say hello.", max_output_tokens=24, temperature=0)
    assert whole.output_text == text and final.usage.output_tokens == whole.usage.output_tokens


def test_tool_round_trip_equals_chat(client: openai.OpenAI, mid: str) -> None:
    """A forced call as a function_call item (streamed too), sent back with its output: the next
    answer is the one chat gives for the same history."""
    r = client.responses.create(model=mid, input="What is the weather in Paris?", tools=TOOLS,
                                tool_choice="required", parallel_tool_calls=False, temperature=0,
                                max_output_tokens=60)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed" and all(c.name == "get_weather" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER_PARAMS)
    events = list(client.responses.create(model=mid, input="What is the weather in Paris?", tools=TOOLS,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          temperature=0, max_output_tokens=60, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments)["city"]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == done[0].arguments  # streamed as generated
    assert events[-1].response.output[-1].arguments == done[0].arguments

    call = calls[0]
    items = [{"role": "user", "content": "What is the weather in Paris?"}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, clear"}]
    answer = client.responses.create(model=mid, input=items, tools=TOOLS, temperature=0, max_output_tokens=30)
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees, clear"}]
    chat = client.chat.completions.create(model=mid, messages=history, tools=CHAT_TOOLS, temperature=0, max_tokens=30)
    assert answer.output_text == (chat.choices[0].message.content or "")
    assert answer.usage.input_tokens == chat.usage.prompt_tokens


def test_structured_output(client: openai.OpenAI, mid: str) -> None:
    class City(pydantic.BaseModel):
        city: str
        country: str

    parsed = client.responses.parse(model=mid, input="Where is the Eiffel tower?", text_format=City,
                                    max_output_tokens=80, temperature=0).output_parsed
    assert isinstance(parsed, City)
    r = client.responses.create(model=mid, input="Give a JSON object.", text={"format": {"type": "json_object"}},
                                max_output_tokens=60, temperature=0)
    assert r.status == "incomplete" or isinstance(json.loads(r.output_text), dict)


@pytest.mark.parametrize(("body", "param"), [
    ({"store": "yes"}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"previous_response_id": "resp_" + "0" * 32}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"reasoning": {"effort": "low"}}, "reasoning.effort"),  # SmolLM2's template never reads it
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"type": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": "x " * 9000}, "input"),
    ({"instructions": "x " * 9000}, "input"),  # the prompt as a whole is too long
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "frob"}}}}, "text.format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"seed": 1}, "seed"),
])
def test_refusals_name_the_field(stack: ServiceStack, mid: str, body: dict, param: str) -> None:
    r = httpx.post(f"{stack.base_url}/v1/responses", json={"model": mid, "input": "Hi", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(param), err
    assert param.split("[")[0].split(".")[0] in err["message"] or "context length" in err["message"], err


def test_stored_responses_continue_and_read_back(client: openai.OpenAI, stack: ServiceStack, mid: str) -> None:
    """A response is stored (OpenAI's default) with a TTL; previous_response_id continues its
    conversation as the chat request with the whole conversation would; GET reads it back and
    DELETE removes it; a streamed one can be continued the moment its last event arrives."""
    first = client.responses.create(model=mid, input="My name is Ada. Say hi.", max_output_tokens=8, temperature=0)
    assert first.store and client.responses.retrieve(first.id).model_dump() == first.model_dump()
    assert 0 < stack.redis.ttl(f"{stack.prefix}:response:{first.id}") <= 3600
    second = client.responses.create(model=mid, previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model=mid, max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "My name is Ada. Say hi."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.output_text == chat.choices[0].message.content and second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    events = list(client.responses.create(model=mid, input="Count to three.", max_output_tokens=6, stream=True))
    streamed = events[-1].response  # response.completed, or .incomplete at max_output_tokens
    third = client.responses.create(model=mid, previous_response_id=streamed.id, input="Again.", max_output_tokens=2)
    assert third.usage.input_tokens > streamed.usage.input_tokens + streamed.usage.output_tokens
    unstored = client.responses.create(model=mid, input="Hi", store=False, max_output_tokens=2)
    assert not unstored.store
    client.responses.delete(first.id)
    for gone in (first.id, unstored.id, "resp_1"):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)


def test_input_items_list_the_conversation_a_response_answered(client: openai.OpenAI, stack: ServiceStack,
                                                               mid: str) -> None:
    """GET /v1/responses/{id}/input_items: the items before the response's output (a continued
    response's earlier turns included), each with an id, newest first unless order=asc, in pages
    of `limit` that `after` walks; bad parameters are 400s naming them."""
    first = client.responses.create(model=mid, input="My name is Ada.", max_output_tokens=4, temperature=0)
    [item] = client.responses.input_items.list(first.id).data
    assert item.type == "message" and item.role == "user" and item.id.startswith("msg_")
    second = client.responses.create(model=mid, previous_response_id=first.id, max_output_tokens=2, input=[
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": "What is my name?"}])
    asc = client.responses.input_items.list(second.id, order="asc")
    assert [i.role for i in asc.data] == ["user", "assistant", "developer", "user"] and not asc.has_more
    assert asc.data[0].id == item.id and asc.data[1].id == first.output[0].id  # the same items, the same ids
    assert [i.id for i in client.responses.input_items.list(second.id).data] == [i.id for i in asc.data][::-1]
    ids, after = [], None
    while True:  # pages of one, as the client walks them
        page = client.responses.input_items.list(second.id, order="asc", limit=1, **({"after": after} if after else {}))
        ids += [i.id for i in page.data]
        after = page.last_id
        if not page.has_more:
            break
    assert ids == [i.id for i in asc.data]
    rest = client.responses.input_items.list(second.id, order="asc", after=ids[1], limit=5)
    assert [i.id for i in rest.data] == ids[2:] and not rest.has_more and rest.data[-1].id == rest.last_id
    base = f"{stack.base_url}/v1/responses/{second.id}/input_items"
    for query, param in (("limit=0", "limit"), ("limit=x", "limit"), ("order=up", "order"),
                         ("after=msg_nope", "after"), ("include=x", "include")):
        r = httpx.get(f"{base}?{query}", timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (query, r.text)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_" + "0" * 32)


def test_chat_errors_name_the_responses_field() -> None:
    """An error of the chat request behind a response names the field the client sent: a message
    by the input item (or the instructions) it came from, max_tokens as max_output_tokens."""
    from rill.services.gateway.errors import APIError
    from rill.services.gateway.responses_api import _responses_error

    origins = ["instructions", "input[0]", "input[3]"]  # items 1 and 2 became message 1's tool calls
    err = _responses_error(APIError("Invalid value for messages[2].content: too long.", param="messages[2].content"),
                           origins)
    assert (err.param, err.message) == ("input[3].content", "Invalid value for input[3].content: too long.")
    assert _responses_error(APIError("bad", param="messages[0]"), origins).param == "instructions"
    err = _responses_error(APIError("max_tokens is too large.", param="max_tokens"), origins)
    assert (err.param, err.message) == ("max_output_tokens", "max_output_tokens is too large.")
    assert _responses_error(APIError("x", param="tools[1].function.parameters"), origins).param == "tools[1].parameters"


def test_a_fault_shaping_a_stream_ends_it_with_an_error_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected exception while one request's chunks are built (a bug, not the client's
    doing) ends that stream with OpenAI's error event and [DONE], not a cut connection."""
    from rill.services.gateway import responses
    from rill.shared.schema import TextDelta

    fmt = responses.ChunkFormatter("chat", "chatcmpl-1", "m", include_usage=True)
    assert b"hi" in fmt.render([TextDelta("chatcmpl-1", 0, 1, "hi", None, 3, 1)]) and not fmt.failed

    def broken(self, batch):
        raise RecursionError("deep")

    monkeypatch.setattr(responses.ChunkFormatter, "_render", broken)
    out = fmt.render([TextDelta("chatcmpl-1", 1, 1, "!", None, 3, 2)])
    assert json.loads(out.decode().removeprefix("data: "))["error"]["type"] == "server_error" and fmt.failed
    assert responses.stream_end([fmt]) == responses.DONE  # no usage chunk after a failure
