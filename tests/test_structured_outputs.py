"""Structured outputs end to end: response_format, structured_outputs and guided_* through the
official openai client, streaming and the WebSocket against the real stack (SmolLM2), every
output checked with jsonschema / the regex / the choices; and the worker's matcher state across
resume and per-request failure, driven by hand-built plans."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pydantic
import pytest
import torch
import websockets
from service_stack import ServiceStack

from rill.kernels import cpu_native
from rill.services.gateway.structured import _byte_tokenizer, _from_json, closed
from rill.services.worker.model_runner import ModelRunner
from rill.services.worker.structured import apply_bitmask
from rill.shared.request_params import SamplingParams
from rill.shared.schema import NewRequestData, StepPlan

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["items", "total", "shipping"],
         "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                  "items": {"type": "object", "required": ["sku", "qty"],
                                            "additionalProperties": False,
                                            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
                        "total": {"type": "number", "minimum": 0, "maximum": 1000},
                        "shipping": {"type": "object", "required": ["city", "express"],
                                     "additionalProperties": False,
                                     "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "express": {"type": "boolean"}}}}}
FLAGS = {"type": "object", "additionalProperties": False, "required": ["tags", "score"],
         "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
                        "score": {"type": "number", "minimum": -1, "maximum": 1},
                        "note": {"type": ["string", "null"], "maxLength": 16}}}
SCHEMAS = {"person": PERSON, "order": ORDER, "flags": FLAGS}
ASK = {"person": "Describe a user of a web shop as JSON.", "order": "Write an example order as JSON.",
       "flags": "Give tags and a score as JSON."}


def json_schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def test_fifty_json_schema_requests_validate(stack: ServiceStack, mid: str) -> None:
    """Greedy and temperature-1 rows under three schemas and unconstrained rows, all in flight
    together (so batches mix constrained and free rows): every constrained output validates."""
    jobs = [(name, 0.0 if i % 2 else 1.0) for i, name in enumerate(list(SCHEMAS) * 17)][:50]

    async def run() -> tuple[list[tuple[str, str, str]], list[str]]:
        ac = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=600)
        try:
            async def one(name: str, temp: float) -> tuple[str, str, str]:
                r = await ac.chat.completions.create(
                    model=mid, messages=[{"role": "user", "content": ASK[name]}], temperature=temp, max_tokens=300,
                    response_format=json_schema_format(name), seed=len(name))
                return name, r.choices[0].message.content or "", r.choices[0].finish_reason

            async def free() -> str:
                r = await ac.chat.completions.create(model=mid, messages=[{"role": "user", "content": "Say hi."}],
                                                     temperature=0, max_tokens=20)
                return r.choices[0].message.content or ""

            free_jobs = [free() for _ in range(4)]
            got = await asyncio.gather(*(one(n, t) for n, t in jobs), *free_jobs)
            return got[:len(jobs)], got[len(jobs):]
        finally:
            await ac.close()

    constrained, free = asyncio.run(run())
    for name, text, finish in constrained:
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert all(free) and not any(_is_json(t) for t in free)  # the free rows stayed free


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    species: str = pydantic.Field(max_length=20)
    legs: int = pydantic.Field(ge=0, le=8)


def test_openai_parse_with_pydantic_model(client: openai.OpenAI, mid: str) -> None:
    r = client.chat.completions.parse(model=mid, messages=[{"role": "user", "content": "Describe a pet."}],
                                      response_format=Pet, temperature=0, max_tokens=200)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.name and 0 <= pet.legs <= 8


def test_json_object_regex_choice_and_grammar(client: openai.OpenAI, mid: str) -> None:
    ask = "Reply with a JSON object with the name and age of a cat."
    r = client.chat.completions.create(model=mid, messages=[{"role": "user", "content": ask}],
                                       response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    regex = r"[0-9]{3}-[A-Z]{2}(-[a-z]{1,6})?"
    for temp in (0.0, 1.0):
        c = client.completions.create(model=mid, prompt="A product code:", max_tokens=30, temperature=temp, seed=5,
                                      extra_body={"structured_outputs": {"regex": regex}})
        assert re.fullmatch(regex, c.choices[0].text) and c.choices[0].finish_reason == "stop"
    choices = ["Paris", "London", "Rome", "Madrid (Spain)", *(f"city-{i}" for i in range(3000))]
    r = client.chat.completions.create(model=mid, messages=[{"role": "user", "content": "Capital of Italy?"}],
                                       temperature=1.0, max_tokens=20, n=3, seed=1,
                                       extra_body={"guided_choice": choices})
    assert len(r.choices) == 3 and all(c.message.content in choices for c in r.choices)
    gbnf = 'root ::= "yes" | "no" | "maybe " [0-9]'
    c = client.completions.create(model=mid, prompt="Will it rain?", max_tokens=10, temperature=1.0, seed=2,
                                  extra_body={"structured_outputs": {"grammar": gbnf}})
    assert re.fullmatch(r"yes|no|maybe [0-9]", c.choices[0].text)


def test_streaming_and_n3_validate(client: openai.OpenAI, mid: str) -> None:
    stream = client.chat.completions.create(model=mid, messages=[{"role": "user", "content": ASK["order"]}],
                                            response_format=json_schema_format("order"), temperature=1.0, seed=9,
                                            max_tokens=300, n=3, stream=True)
    texts = ["", "", ""]
    finishes: dict[int, str] = {}
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert finishes == {0: "stop", 1: "stop", 2: "stop"}
    for t in texts:
        jsonschema.validate(json.loads(t), ORDER)


def test_websocket_frames_validate(stack: ServiceStack) -> None:
    async def run() -> dict[str, list[dict]]:
        async with websockets.connect(stack.ws_url) as ws:
            await ws.send(json.dumps({"type": "chat", "id": "j", "temperature": 1.0, "seed": 4, "max_tokens": 300,
                                      "messages": [{"role": "user", "content": ASK["person"]}],
                                      "response_format": json_schema_format("person")}))
            await ws.send(json.dumps({"type": "completion", "id": "bad", "prompt": "x",
                                      "structured_outputs": {"regex": "[a-"}}))
            await ws.send(json.dumps({"type": "completion", "id": "c", "prompt": "Pick one:", "max_tokens": 10,
                                      "structured_outputs": {"choice": ["alpha", "beta"]}}))
            frames: dict[str, list[dict]] = {"j": [], "bad": [], "c": []}
            while not all(f and f[-1]["type"] in ("done", "error") for f in frames.values()):
                msg = json.loads(await asyncio.wait_for(ws.recv(), 300))
                frames[msg["id"]].append(msg)
            return frames

    frames = asyncio.run(run())
    assert frames["bad"][-1]["type"] == "error"
    assert frames["bad"][-1]["error"]["param"] == "structured_outputs.regex"
    text = "".join(f["text"] for f in frames["j"] if f["type"] == "delta")
    assert frames["j"][-1]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    assert "".join(f["text"] for f in frames["c"] if f["type"] == "delta") in ("alpha", "beta")


def _accepts(grammar: str, text: str) -> bool:
    from llguidance import LLMatcher

    data = list(text.encode())
    return LLMatcher(_byte_tokenizer(), grammar, log_level=0).validate_tokens(data) == len(data)


def test_objects_that_list_their_properties_get_no_others() -> None:
    """As xgrammar's strict mode generates (vLLM's default): JSON Schema lets any object carry
    undeclared keys, and a small model fills them until max_tokens."""
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    schema = {"type": "object", "properties": {"at": point, "tags": {"type": "array", "items": {"$ref": "#/$defs/t"}},
                                               "alt": {"anyOf": [point, {"type": "null"}]}},
              "$defs": {"t": {"type": "object", "properties": {"k": {"type": "string"}}}}}
    out = closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["at"]["additionalProperties"] is False
    assert out["$defs"]["t"]["additionalProperties"] is False
    assert out["properties"]["alt"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema and "additionalProperties" not in point  # not changed in place
    grammar = _from_json(schema, "schema")
    assert _accepts(grammar, '{"at":{"x":1},"tags":[{"k":"a"}]}')
    for extra in ('{"at":{"x":1},"y":2}', '{"at":{"x":1,"y":2}}', '{"tags":[{"k":"a","v":1}]}'):
        assert not _accepts(grammar, extra), extra
    # Left as written: what the schema says of other keys, a required key it does not list, and
    # objects composed with allOf (closing each part would forbid the other parts' keys).
    for kept in ({"properties": {"a": {}}, "additionalProperties": True},
                 {"properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
                 {"properties": {"a": {}}, "required": ["a", "b"]},
                 {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}):
        assert closed(kept) == kept
    assert _accepts(_from_json({"properties": {"a": {}}, "additionalProperties": True}, "s"), '{"a":1,"b":2}')


def test_a_forced_call_gets_only_the_arguments_its_function_declares(client: openai.OpenAI, mid: str) -> None:
    # As LangChain writes a function's schema: no additionalProperties, an optional argument.
    params = {"type": "object", "required": ["city"],
              "properties": {"city": {"type": "string"}, "unit": {"type": "string", "default": "celsius"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city.",
                                               "parameters": params}}]
    r = client.chat.completions.create(model=mid, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       temperature=0, max_tokens=60)
    assert r.choices[0].finish_reason == "tool_calls", r
    args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
    assert "city" in args and set(args) <= {"city", "unit"}, args


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    # Valid grammars that no output matches: the model could only end at once, "finished".
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "[^\\x00-\\x{10FFFF}]"}}, "structured_outputs.regex"),
])
def test_bad_constraints_are_400_naming_the_field(client: openai.OpenAI, mid: str, body: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=mid, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       extra_body=body)
    assert err.value.body["param"] == param, err.value.body  # type: ignore[index]


# --------------------------------------------------------------------------- worker, by hand


BLOCK = 16


@pytest.fixture(scope="module")
def runner(smollm2_dir: str) -> ModelRunner:
    return ModelRunner(smollm2_dir, dtype="float32", device="cpu", num_blocks=64, block_size=BLOCK)


def _decode(runner: ModelRunner, rid: str, prompt: list[int], params: SamplingParams, steps: int,
            outputs: list[int] | None = None, blocks: range = range(0, 16)) -> tuple[list[int], dict[str, str]]:
    """Run `rid` (resuming after `outputs`) for up to `steps` sampled tokens; (tokens, errors)."""
    outputs = list(outputs or [])
    tokens = prompt + outputs
    new = NewRequestData(request_id=rid, token_ids=tokens, params=params, block_ids=list(blocks),
                         num_output_tokens=len(outputs))
    plan = StepPlan(step_id=0, new_requests=[new], cached_request_ids=[], cached_new_block_ids=[],
                    scheduled_request_ids=[rid], num_scheduled_tokens=[len(tokens)])
    got: list[int] = []
    for step in range(steps):
        res = runner.execute(plan)
        assert res.error is None
        if res.errors:
            runner.execute(StepPlan(step_id=-2, new_requests=[], cached_request_ids=[], cached_new_block_ids=[],
                                    scheduled_request_ids=[], num_scheduled_tokens=[], finished_request_ids=[rid]))
            return got, res.errors
        got += res.token_ids
        if res.token_ids[-1] in runner.cfg.eos_token_ids:
            break
        plan = StepPlan(step_id=step + 1, new_requests=[], cached_request_ids=[], cached_new_block_ids=[],
                        scheduled_request_ids=[rid], num_scheduled_tokens=[1])
    runner.execute(StepPlan(step_id=-2, new_requests=[], cached_request_ids=[], cached_new_block_ids=[],
                            scheduled_request_ids=[], num_scheduled_tokens=[], finished_request_ids=[rid]))
    return got, {}


def test_resumed_request_replays_its_grammar(runner: ModelRunner, smollm2_dir: str) -> None:
    """Preemption and hand-off re-send a request with its outputs: the worker's fresh matcher
    replays them, and the continuation equals the uninterrupted run (greedy) and validates."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = tok("Here is a user record in JSON:")["input_ids"]
    params = SamplingParams(temperature=0.0, grammar=_from_json(PERSON, "x"), max_tokens=100)
    whole, errors = _decode(runner, "a", prompt, params, 100)
    assert not errors and whole[-1] in runner.cfg.eos_token_ids
    cut = len(whole) // 2
    rest, errors = _decode(runner, "b", prompt, params, 100, outputs=whole[:cut], blocks=range(16, 32))
    assert not errors and whole[:cut] + rest == whole
    jsonschema.validate(json.loads(tok.decode(whole, skip_special_tokens=True)), PERSON)


def test_broken_grammar_fails_only_its_request(runner: ModelRunner) -> None:
    """A grammar the worker cannot run, or outputs that do not match it, fail that request alone
    with a message (StepResult.errors), not the step."""
    bad = SamplingParams(temperature=0.0, grammar="start: undefined_rule")
    _, errors = _decode(runner, "bad", [1, 2, 3], bad, 3)
    assert "structured output" in errors["bad"]
    regex = SamplingParams(temperature=0.0, grammar=__import__("llguidance").LLMatcher.grammar_from_regex("[0-9]+"))
    _, errors = _decode(runner, "mismatch", [1, 2, 3], regex, 3, outputs=[runner.cfg.eos_token_ids[0], 5])
    assert "does not match" in errors["mismatch"]
    good, errors = _decode(runner, "ok", [1, 2, 3], SamplingParams(temperature=0.0), 3)
    assert not errors and len(good) == 3


@pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler for the native kernels")
def test_native_bitmask_equals_the_torch_path() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32: the tail word is partial
    logits = torch.randn(6, vocab, generator=gen)
    words = (vocab + 31) // 32
    mask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    mask[0, :5] = 0
    mask[1, :] = -1
    rows = [4, 0, 2]
    native = logits.clone()
    apply_bitmask(native, rows, mask)
    generic = logits.double()  # not what the native kernel takes: the torch path
    apply_bitmask(generic, rows, mask)
    bits = torch.tensor([[(int(mask[i, t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for i in range(3)]).bool()
    expect = logits.clone()
    for i, r in enumerate(rows):
        expect[r][~bits[i]] = float("-inf")
    assert torch.equal(native, expect) and torch.equal(generic.float(), expect)


# --------------------------------------------------------------------------- tool calls, forced

WEATHER_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                  "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                           "parameters": {"type": "object", "additionalProperties": False,
                                                          "required": ["city"],
                                                          "properties": {"city": {"type": "string", "maxLength": 20}}}}}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(call: object, name: str | None = None) -> None:
    fn = call.function  # type: ignore[attr-defined]
    assert call.type == "function" and call.id.startswith("call_")  # type: ignore[attr-defined]
    tool = next(t for t in TOOLS if t["function"]["name"] == fn.name)
    assert name is None or fn.name == name
    jsonschema.validate(json.loads(fn.arguments), tool["function"]["parameters"])


def test_forced_tool_calls_round_trip(client: openai.OpenAI, mid: str) -> None:
    """tool_choice required and named give calls whose arguments validate; the call and a tool
    result go back in the history and the model answers in text."""
    for choice, temp in (("required", 0.0), ("required", 1.0),
                         ({"type": "function", "function": {"name": "get_weather"}}, 1.0)):
        r = client.chat.completions.create(model=mid, messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice,
                                           temperature=temp, seed=7, max_tokens=120)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls, r
        for call in msg.tool_calls:
            _check_call(call, None if choice == "required" else "get_weather")
    history = [*ASK_WEATHER, msg.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"temperature": 18, "sky": "clear"}'}]
    final = client.chat.completions.create(model=mid, messages=history, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=40)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    # With tool_choice auto special tokens are kept (a call's marker may be one), but the EOS that
    # ends a text answer is not text.
    plain = client.chat.completions.create(model=mid, messages=[{"role": "user", "content": "What is 2+2? Be brief."}],
                                           tools=TOOLS, temperature=0, max_tokens=40)
    assert plain.choices[0].finish_reason == "stop" and not plain.choices[0].message.tool_calls, plain
    assert plain.choices[0].message.content and "<|im_end|>" not in plain.choices[0].message.content, plain


# As pydantic writes a function whose argument is a model: "$defs" and references into its root.
ADDRESS_TOOL = {"type": "function", "function": {"name": "ship", "parameters": {
    "type": "object", "required": ["to"], "properties": {"to": {"$ref": "#/$defs/Address"}},
    "$defs": {"Address": {"type": "object", "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 20}}}}}}}


def test_required_calls_keep_each_functions_references() -> None:
    """Under "required" each function's schema sits inside the array's: its "#/$defs/..." and
    "#" pointers must still reach its own definitions, even where two functions use one name."""
    from types import SimpleNamespace as NS

    from rill.services.gateway.tool_calls import forced_schema

    f = {"type": "object", "required": ["p"], "properties": {"p": {"$ref": "#/$defs/P"}},
         "$defs": {"P": {"type": "object", "required": ["x"], "properties": {"x": {"type": "integer"}}}}}
    g = {"type": "object", "required": ["p"], "properties": {"p": {"$ref": "#/$defs/P"},
                                                             "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
         "$defs": {"P": {"type": "string"}}}
    tools = [NS(function=NS(name="f", parameters=f)), NS(function=NS(name="g", parameters=g))]
    grammar = _from_json(forced_schema(tools, "required", True), "tool_choice")
    assert _accepts(grammar, '[{"name":"f","parameters":{"p":{"x":1}}},{"name":"g","parameters":{"p":"a",'
                             '"next":{"p":"b","next":null}}}]')
    assert not _accepts(grammar, '[{"name":"g","parameters":{"p":{"x":1}}}]')
    assert f["properties"]["p"] == {"$ref": "#/$defs/P"}  # the request's own schema is left alone


def test_required_call_of_a_function_with_definitions(client: openai.OpenAI, mid: str) -> None:
    r = client.chat.completions.create(model=mid, messages=[{"role": "user", "content": "Ship it to Paris."}],
                                       tools=[ADDRESS_TOOL], tool_choice="required", parallel_tool_calls=False,
                                       temperature=0, max_tokens=60)
    assert r.choices[0].finish_reason == "tool_calls", r
    call = r.choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), ADDRESS_TOOL["function"]["parameters"])


def test_forced_tool_calls_stream_as_deltas(client: openai.OpenAI, mid: str) -> None:
    stream = client.chat.completions.create(model=mid, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, temperature=1.0, seed=3, max_tokens=120,
                                            stream=True)
    calls: dict[int, dict[str, str]] = {}
    finish, pieces = None, 0
    for chunk in stream:
        for ch in chunk.choices:
            assert not ch.delta.content  # a forced call streams no text
            for d in ch.delta.tool_calls or []:
                pieces += 1
                c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                c["id"] += d.id or ""
                c["name"] += (d.function.name or "") if d.function else ""
                c["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1  # parallel_tool_calls false: one call
    assert pieces > 2  # the arguments streamed as they were generated
    call = calls[0]
    tool = next(t for t in TOOLS if t["function"]["name"] == call["name"])
    jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])
    history = [*ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees, clear"}]
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=mid, messages=history, tools=TOOLS, temperature=0, max_tokens=30, stream=True) if c.choices)
    assert text


def test_calls_in_the_models_own_format_stream_as_written(client: openai.OpenAI, mid: str) -> None:
    """tool_choice "auto": the model's hermes call (held to one by a regex, as this small model
    writes none of its own) streams as the forced ones do, its id and name first and then its
    arguments in pieces, after the text before it; all of it equals the unstreamed answer."""
    rx = r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,12}", "unit": "celsius"\}\}'
    kw = dict(model=mid, messages=ASK_WEATHER, tools=TOOLS, temperature=0, max_tokens=80,
              extra_body={"structured_outputs": {"regex": rx + r"\n</tool_call>"}})
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content == "Checking."
    [want] = whole.choices[0].message.tool_calls
    content, deltas, finish = "", [], None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            deltas += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert content.strip() == "Checking." and finish == "tool_calls"
    assert deltas[0].id and deltas[0].function.name == "get_weather" and all(d.id is None for d in deltas[1:])
    assert len(deltas) > 3 and {d.index for d in deltas} == {0}  # the arguments came in pieces
    assert "".join(d.function.arguments or "" for d in deltas) == want.function.arguments
    jsonschema.validate(json.loads(want.function.arguments), TOOLS[0]["function"]["parameters"])


def test_forced_tool_calls_cut_short_say_length(client: openai.OpenAI, stack: ServiceStack, mid: str) -> None:
    """max_tokens inside a forced call: finish_reason "length" (not "tool_calls", so that no
    client runs a tool on unfinished arguments), the call so far, no grammar text as content."""
    offered = {t["function"]["name"] for t in TOOLS}
    r = client.chat.completions.create(model=mid, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=12)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and msg.content is None, r
    assert msg.tool_calls and {c.function.name for c in msg.tool_calls} <= offered, r
    chunks = list(client.chat.completions.create(model=mid, messages=ASK_WEATHER, tools=TOOLS,
                                                 tool_choice="required", temperature=0, max_tokens=12, stream=True))
    assert not any(ch.delta.content for c in chunks for ch in c.choices)
    streamed: dict[int, str] = {}
    for d in (d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or []):
        streamed[d.index] = streamed.get(d.index, "") + (d.function.arguments or "")
    assert streamed[0] == msg.tool_calls[0].function.arguments
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["length"]

    async def ws_done() -> dict:
        async with websockets.connect(stack.ws_url) as ws:
            await ws.send(json.dumps({"type": "chat", "id": 1, "messages": ASK_WEATHER, "tools": TOOLS,
                                      "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                                      "max_tokens": 3, "temperature": 0}))
            while (frame := json.loads(await asyncio.wait_for(ws.recv(), 120)))["type"] not in ("done", "error"):
                assert frame["type"] != "delta" or not frame.get("text")
            return frame

    done = asyncio.run(ws_done())
    assert done["finish_reason"] == "length" and done["tool_calls"][0]["function"]["name"] == "get_time", done


def test_websocket_tool_call_in_done_frame(stack: ServiceStack) -> None:
    async def run() -> list[dict]:
        async with websockets.connect(stack.ws_url) as ws:
            await ws.send(json.dumps({"type": "chat", "id": 1, "messages": ASK_WEATHER, "tools": TOOLS,
                                      "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                                      "max_tokens": 60, "temperature": 0}))
            frames = []
            while not frames or frames[-1]["type"] not in ("done", "error"):
                frames.append(json.loads(await asyncio.wait_for(ws.recv(), 120)))
            return frames

    frames = asyncio.run(run())
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "tool_calls", done
    assert not "".join(f.get("text", "") for f in frames if f["type"] == "delta")
    (call,) = done["tool_calls"]
    assert call["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TOOLS[1]["function"]["parameters"])
    # The call streamed in delta frames as SSE chunks carry it: id and name, then argument pieces.
    deltas = [d for f in frames if f["type"] == "delta" for d in f.get("tool_calls", [])]
    assert deltas[0]["id"] == call["id"] and deltas[0]["function"]["name"] == "get_time" and len(deltas) > 2
    assert "".join(d["function"]["arguments"] for d in deltas) == call["function"]["arguments"]
