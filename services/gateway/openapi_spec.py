"""GET /openapi.json: a hand-written OpenAPI 3.1 description of the gateway's HTTP API.

Written by hand rather than derived from the handlers (which validate JSON themselves), so it
states the accepted ranges exactly as the validation enforces them; tests fuzz the running stack
against it (schemathesis), so a drift between the two shows up as a failure. The served model's
name, the context length and --max-logprobs are filled in per gateway.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rill.services.gateway.errors import json_response

if TYPE_CHECKING:
    from rill.services.gateway.app import Gateway

JSON = "application/json"
SSE = "text/event-stream"
MAX_STOP = 16
MAX_N = 128
INT64 = {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}
TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _number(lo: float | None = None, hi: float | None = None, exclusive_lo: bool = False, **extra: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "number", **extra}
    if lo is not None:
        s["exclusiveMinimum" if exclusive_lo else "minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return s


def _error_responses(*statuses: int) -> dict[str, Any]:
    text = {400: "Invalid request: a parameter out of range, malformed JSON, a wrong Content-Type, or a "
                 "prompt that does not fit the context window (the message names the parameter).",
            401: "Missing or wrong API key (only when the server runs with --api-key).",
            404: "Unknown model.",
            413: "Request body larger than --max-request-body-bytes.",
            503: "No engine or tokenizer is available, or the message broker is unreachable; retry later."}
    return {str(s): {"description": text[s], "content": {JSON: {"schema": _ref("ErrorResponse")}}}
            for s in statuses}


# ---------------------------------------------------------------------------------------------
# Request bodies


def _sampling_properties(max_model_len: int) -> dict[str, Any]:
    """Sampling fields shared by completions and chat (vLLM's extensions included)."""
    return {
        "model": {"type": "string", "description": "The served model's id (GET /v1/models); optional."},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": 2**63 - 1,
                       "description": f"Most tokens to generate; prompt + max_tokens must fit {max_model_len}."},
        "temperature": _number(0, 2, description="0 is greedy."),
        "top_p": _number(0, 1, exclusive_lo=True),
        "top_k": {"type": "integer", "minimum": -1, "maximum": 2**63 - 1,
                  "description": "-1 or 0 disables top-k."},
        "min_p": _number(0, 1),
        "presence_penalty": _number(-2, 2),
        "frequency_penalty": _number(-2, 2),
        "repetition_penalty": _number(0, 100, exclusive_lo=True, description="1 is off."),
        "logit_bias": {"type": "object", "maxProperties": 1024,
                       "propertyNames": {"pattern": "^[0-9]{1,10}$"},
                       "additionalProperties": _number(-100, 100),
                       "description": "Token id (as a string) to a bias added to its logit."},
        "seed": INT64,
        "stop": {"anyOf": [{"type": "string"},
                           {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP},
                           {"type": "null"}]},
        "stop_token_ids": {"type": "array", "items": TOKEN_ID},
        "ignore_eos": {"type": "boolean"},
        "min_tokens": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1,
                       "description": "At most max_tokens."},
        "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}},
                           "description": "Only with stream: true."},
        "include_stop_str_in_output": {"type": "boolean"},
        "skip_special_tokens": {"type": "boolean"},
        "priority": {**INT64, "description": "Lower runs first under --scheduling-policy priority."},
    }


def _completion_request(max_model_len: int, max_logprobs: int) -> dict[str, Any]:
    token_ids = {"type": "array", "items": TOKEN_ID, "minItems": 1}
    text = {"type": "string", "minLength": 1}
    return {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "prompt": {"anyOf": [text, token_ids,
                                 {"type": "array", "items": text, "minItems": 1},
                                 {"type": "array", "items": token_ids, "minItems": 1}],
                       "description": "Text, token ids, or a list of one of those."},
            **_sampling_properties(max_model_len),
            "logprobs": {"type": "integer", "minimum": 0, "maximum": max_logprobs,
                         "description": "Top logprobs per output token (the sampled token's always)."},
            "echo": {"type": "boolean", "description": "Prepend the prompt to the text."},
        },
    }


def _chat_request(max_model_len: int, max_logprobs: int) -> dict[str, Any]:
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"],
               "properties": {"role": {"enum": ["system", "user", "assistant", "developer", "tool"]},
                              "content": {"anyOf": [{"type": "string"},
                                                    {"type": "array", "items": text_part}]},
                              "name": {"type": "string"}}}
    return {
        "type": "object",
        "required": ["messages"],
        "properties": {
            "messages": {"type": "array", "items": message, "minItems": 1},
            **_sampling_properties(max_model_len),
            "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 2**63 - 1,
                                      "description": "Wins over max_tokens."},
            "logprobs": {"type": "boolean"},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": max_logprobs,
                             "description": "Needs logprobs: true."},
        },
    }


# ---------------------------------------------------------------------------------------------
# Response objects


def _schemas(max_model_len: int, max_logprobs: int) -> dict[str, Any]:
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {k: {"type": "integer", "minimum": 0}
                            for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    finish = _nullable({"type": "string", "enum": ["stop", "length", "abort", "error"]})
    top = {"type": "object", "required": ["token", "logprob"],
           "properties": {"token": {"type": "string"}, "logprob": {"type": "number"},
                          "bytes": _nullable({"type": "array", "items": {"type": "integer"}})}}
    chat_logprobs = _nullable({"type": "object", "required": ["content"], "properties": {"content": {
        "type": "array", "items": {**top, "properties": {**top["properties"],
                                                         "top_logprobs": {"type": "array", "items": top}}}}}})
    completion_logprobs = _nullable({"type": "object", "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": _nullable({"type": "number"})},
        "top_logprobs": {"type": "array", "items": _nullable({"type": "object",
                                                             "additionalProperties": {"type": "number"}})},
        "text_offset": {"type": "array", "items": {"type": "integer"}}}})
    common = {"id": {"type": "string"}, "created": {"type": "integer"}, "model": {"type": "string"}}
    return {
        "ErrorResponse": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": _nullable({"type": "string"}),
                           "code": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}}}}},
        "Usage": usage,
        "CompletionRequest": _completion_request(max_model_len, max_logprobs),
        "ChatCompletionRequest": _chat_request(max_model_len, max_logprobs),
        "Completion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                       "properties": {**common, "object": {"const": "text_completion"},
                                      "choices": {"type": "array", "items": {
                                          "type": "object", "required": ["index", "text", "finish_reason"],
                                          "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                                                         "logprobs": completion_logprobs,
                                                         "finish_reason": finish}}},
                                      "usage": _ref("Usage")}},
        "ChatCompletion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                           "properties": {**common, "object": {"const": "chat.completion"},
                                          "choices": {"type": "array", "items": {
                                              "type": "object", "required": ["index", "message", "finish_reason"],
                                              "properties": {
                                                  "index": {"type": "integer"},
                                                  "message": {"type": "object", "required": ["role", "content"],
                                                              "properties": {"role": {"const": "assistant"},
                                                                             "content": {"type": "string"}}},
                                                  "logprobs": chat_logprobs, "finish_reason": finish}}},
                                          "usage": _ref("Usage")}},
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": {"type": "object", "required": ["id", "object"], "properties": {
                "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}}}}}},
        "TokenizeRequest": {"anyOf": [
            {"type": "object", "required": ["prompt"], "properties": {
                "model": {"type": "string"}, "prompt": {"type": "string"},
                "add_special_tokens": {"type": "boolean"}}},
            {"type": "object", "required": ["messages"], "properties": {
                "model": {"type": "string"},
                "messages": _chat_request(max_model_len, max_logprobs)["properties"]["messages"],
                "add_generation_prompt": {"type": "boolean"}, "add_special_tokens": {"type": "boolean"}}}]},
        "TokenizeResponse": {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
            "count": {"type": "integer", "minimum": 0}, "max_model_len": {"type": "integer"},
            "tokens": {"type": "array", "items": {"type": "integer"}}}},
        "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {
            "model": {"type": "string"}, "tokens": {"type": "array", "items": TOKEN_ID}}},
        "DetokenizeResponse": {"type": "object", "required": ["prompt"],
                               "properties": {"prompt": {"type": "string"}}},
        "Health": {"type": "object", "required": ["status"], "properties": {
            "status": {"enum": ["ok", "unavailable"]}, "reason": {"type": "string"}}},
        "Stats": {"type": "object", "required": ["engines"], "properties": {
            "engines": {"type": "array", "items": {"type": "object", "required": ["engine_id"],
                                                   "properties": {"engine_id": {"type": "integer"}}}}}},
    }


# ---------------------------------------------------------------------------------------------
# Paths


def _post(summary: str, request: str, ok: dict[str, Any], *, streams: bool, guarded: bool = True) -> dict[str, Any]:
    content = {JSON: {"schema": ok}}
    if streams:
        content[SSE] = {"schema": {"type": "string"},
                        "description": "With stream: true, `data: <chunk JSON>` events, then `data: [DONE]`."}
    statuses = (400, 401, 404, 413, 503) if guarded else (400, 413, 503)
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {JSON: {"schema": _ref(request)}}},
        "responses": {"200": {"description": "OK", "content": content}, **_error_responses(*statuses)},
        **({"security": [{"bearer": []}]} if guarded else {}),
    }}


def build_spec(model_name: str, max_model_len: int, max_logprobs: int) -> dict[str, Any]:
    unavailable = _error_responses(503)
    paths: dict[str, Any] = {
        "/v1/completions": _post("Text completion", "CompletionRequest", _ref("Completion"), streams=True),
        "/v1/chat/completions": _post("Chat completion", "ChatCompletionRequest", _ref("ChatCompletion"),
                                      streams=True),
        "/tokenize": _post("Token ids of a prompt or of templated chat messages", "TokenizeRequest",
                           _ref("TokenizeResponse"), streams=False),
        "/detokenize": _post("Text of token ids", "DetokenizeRequest", _ref("DetokenizeResponse"), streams=False),
        "/v1/models": {"get": {"summary": "The served model", "security": [{"bearer": []}], "responses": {
            "200": {"description": "OK", "content": {JSON: {"schema": _ref("ModelList")}}},
            **_error_responses(401)}}},
        "/health": {"get": {"summary": "200 while the broker answers and an engine is live", "security": [],
                            "responses": {
                                "200": {"description": "OK", "content": {JSON: {"schema": _ref("Health")}}},
                                "503": {"description": "Unavailable",
                                        "content": {JSON: {"schema": _ref("Health")}}}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics (rill:*)", "security": [], "responses": {
            "200": {"description": "Prometheus text exposition format",
                    "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/stats": {"get": {"summary": "Every engine's latest scheduler statistics", "security": [], "responses": {
            "200": {"description": "OK", "content": {JSON: {"schema": _ref("Stats")}}}, **unavailable}}},
        "/openapi.json": {"get": {"summary": "This document", "security": [], "responses": {
            "200": {"description": "OpenAPI 3.1", "content": {JSON: {"schema": {"type": "object"}}}}}}},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "Rill", "version": "0.1.0",
                 "description": f"OpenAI-compatible API serving `{model_name}` (context {max_model_len} tokens)."},
        "paths": paths,
        "components": {"schemas": _schemas(max_model_len, max_logprobs),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "Only with --api-key / RILL_API_KEY."}}},
    }


@cache
def _cached_spec(model_name: str, max_model_len: int, max_logprobs: int) -> dict[str, Any]:
    return build_spec(model_name, max_model_len, max_logprobs)


async def openapi(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    return json_response(_cached_spec(gw.model_name, gw.max_model_len, gw.max_logprobs))


def routes() -> list[Route]:
    return [Route("/openapi.json", openapi, methods=["GET"])]
