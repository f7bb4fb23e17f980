"""GET /openapi.json: the gateway's HTTP API as OpenAPI 3.1.

The request bodies are generated from the Structs that validate them (bodies.py), so the
document states exactly the ranges the gateway enforces; tests fuzz the running stack against
it (schemathesis). The responses are still written here by hand: responses.py builds them as
plain dicts on the hot path, not as Structs. The served model's name, the context length,
--max-logprobs and --ignore-unknown-fields are filled in per gateway.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rill.services.gateway import bodies
from rill.services.gateway.bodies import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    TokenizeBody,
)
from rill.services.gateway.requests import not_yet_fields
from rill.services.gateway.responses_api import ResponsesRequest

if TYPE_CHECKING:
    from rill.services.gateway.gateway import Gateway

JSON = "application/json"
SSE = "text/event-stream"
BODIES = (ChatCompletionRequest, CompletionRequest, TokenizeBody, DetokenizeBody, ResponsesRequest)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _error_responses(*statuses: int) -> dict[str, Any]:
    text = {400: "Invalid request: a parameter out of range, an unknown or not yet supported parameter, malformed "
                 "JSON, a wrong Content-Type, or a prompt that does not fit the context window (the message names "
                 "the parameter).",
            401: "Missing or wrong API key (only when the server runs with --api-key).",
            404: "Unknown model.",
            413: "Request body larger than --max-request-body-bytes.",
            503: "No engine or tokenizer is available, or the message broker is unreachable; retry later."}
    return {str(s): {"description": text[s], "content": {JSON: {"schema": _ref("ErrorResponse")}}}
            for s in statuses}


# ---------------------------------------------------------------------------------------------
# Request bodies, generated


def _value_schema(prop: dict[str, Any]) -> dict[str, Any]:
    """The non-null branch of an optional field's schema."""
    return next(s for s in prop.get("anyOf", [prop]) if s.get("type") != "null")


def _mark_not_yet(name: str, schema: dict[str, Any]) -> None:
    """Fields and content parts Rill refuses: the values it accepts, and why the others fail."""
    cls = getattr(bodies, name, None)
    if cls is None:  # a Struct bodies.py does not import (chat_tools.py, ...): no NotYet marks
        return
    if getattr(cls, "why", None):
        schema["description"] = f"Not supported yet ({cls.why}): refused with 400."
    for field, mark in not_yet_fields(cls):
        schema["properties"][field] = {"enum": [None, *mark.no_ops], "default": None,
                                       "description": mark.describe()}


def request_schemas(max_model_len: int, max_logprobs: int, ignore_unknown_fields: bool) -> dict[str, Any]:
    _, components = msgspec.json.schema_components(BODIES, ref_template="#/components/schemas/{name}")
    for name, schema in components.items():
        _mark_not_yet(name, schema)
    chat, completion = components["ChatCompletionRequest"], components["CompletionRequest"]
    _value_schema(completion["properties"]["logprobs"])["maximum"] = max_logprobs
    _value_schema(chat["properties"]["top_logprobs"])["maximum"] = max_logprobs
    for body, field in ((chat, "max_tokens"), (chat, "max_completion_tokens"), (completion, "max_tokens")):
        _value_schema(body["properties"][field])["description"] += f" The context here is {max_model_len} tokens."
    if ignore_unknown_fields:  # the gateway drops unknown top-level fields instead of refusing them
        for cls in BODIES:
            components[cls.__name__].pop("additionalProperties", None)
    return components


# ---------------------------------------------------------------------------------------------
# Response objects


def _response_schemas() -> dict[str, Any]:
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {**{k: {"type": "integer", "minimum": 0}
                               for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
                            "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {
                                "type": "integer", "minimum": 0,
                                "description": "Prompt tokens whose KV the prefix cache held."}}},
                            "completion_tokens_details": {"type": "object", "properties": {"reasoning_tokens": {
                                "type": "integer", "minimum": 0,
                                "description": "With --reasoning-parser: output tokens through the end of the "
                                               "reasoning."}}}}}
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
        "Response": {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
                     "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                                    "created_at": {"type": "integer"}, "model": {"type": "string"},
                                    "status": {"enum": ["completed", "incomplete"]},
                                    "output": {"type": "array", "items": {"type": "object", "required": ["type"]}}}},
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
    }


def _endpoint_schemas() -> dict[str, Any]:
    """The answers of the endpoints beside generation."""
    return {
        "Model": {"type": "object", "required": ["id", "object"], "properties": {
            "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
            "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}}},
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}},
        "TokenizeResponse": {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
            "count": {"type": "integer", "minimum": 0}, "max_model_len": {"type": "integer"},
            "tokens": {"type": "array", "items": {"type": "integer"}}}},
        "DetokenizeResponse": {"type": "object", "required": ["prompt"],
                               "properties": {"prompt": {"type": "string"}}},
        "TokenizerInfo": {
            "type": "object", "required": ["eos_token_ids", "model_max_length", "chat_template"], "properties": {
                "tokenizer_class": _nullable({"type": "string"}), "bos_token": {"type": "string"},
                "eos_token": {"type": "string"}, "pad_token": {"type": "string"},
                "eos_token_ids": {"type": "array", "items": {"type": "integer"}},
                "model_max_length": {"type": "integer"}, "chat_template": _nullable({"type": "string"})}},
        "Health": {"type": "object", "required": ["status"], "properties": {
            "status": {"enum": ["ok", "unavailable"]}, "reason": {"type": "string"}}},
        "Stats": {"type": "object", "required": ["engines"], "properties": {
            "engines": {"type": "array", "items": {"type": "object", "required": ["engine_id"],
                                                   "properties": {"engine_id": {"type": "integer"}}}}}},
    }


# ---------------------------------------------------------------------------------------------
# Paths


def _post(summary: str, request: str, ok: dict[str, Any], *, streams: bool, guarded: bool = True,
          events: str = "`data: <chunk JSON>` events, then `data: [DONE]`") -> dict[str, Any]:
    content = {JSON: {"schema": ok}}
    if streams:
        content[SSE] = {"schema": {"type": "string"}, "description": f"With stream: true, {events}."}
    statuses = (400, 401, 404, 413, 503) if guarded else (400, 413, 503)
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {JSON: {"schema": _ref(request)}}},
        "responses": {"200": {"description": "OK", "content": content}, **_error_responses(*statuses)},
        **({"security": [{"bearer": []}]} if guarded else {}),
    }}


_RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}


def _responses_paths() -> dict[str, Any]:
    """/v1/responses and the stored responses' routes."""
    return {
        "/v1/responses": _post("A response (OpenAI's Responses API), stored unless store is false", "ResponsesRequest",
                               _ref("Response"), streams=True,
                               events="`event: <type>` / `data: <event JSON>` pairs, response.created first and "
                                      "response.completed, response.incomplete or response.failed last"),
        "/v1/responses/{response_id}": {
            "get": {"summary": "A stored response", "security": [{"bearer": []}], "parameters": [_RESPONSE_ID],
                    "responses": {"200": {"description": "OK", "content": {JSON: {"schema": _ref("Response")}}},
                                  **_error_responses(400, 401, 404)}},
            "delete": {"summary": "Delete a stored response", "security": [{"bearer": []}], "parameters": [_RESPONSE_ID],
                       "responses": {"200": {"description": "Deleted", "content": {JSON: {"schema": {"type": "object"}}}},
                                     **_error_responses(401, 404)}}},
        "/v1/responses/{response_id}/input_items": {"get": {
            "summary": "The input items a stored response answered, a page at a time", "security": [{"bearer": []}],
            "parameters": [_RESPONSE_ID, *({"name": n, "in": "query", "required": False, "schema": s} for n, s in (
                ("order", {"enum": ["asc", "desc"]}), ("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
                ("after", {"type": "string"})))],
            "responses": {"200": {"description": "OK", "content": {JSON: {"schema": {"type": "object"}}}},
                          **_error_responses(400, 401, 404)}}},
    }


def build_spec(model_name: str, max_model_len: int, max_logprobs: int,
               ignore_unknown_fields: bool = False) -> dict[str, Any]:
    unavailable = _error_responses(503)
    paths: dict[str, Any] = {
        "/v1/completions": _post("Text completion", "CompletionRequest", _ref("Completion"), streams=True),
        "/v1/chat/completions": _post("Chat completion", "ChatCompletionRequest", _ref("ChatCompletion"),
                                      streams=True),
        **_responses_paths(),
        **{f"{prefix}/tokenize": _post("Token ids of a prompt or of templated chat messages", "TokenizeBody",
                                       _ref("TokenizeResponse"), streams=False) for prefix in ("", "/v1")},
        **{f"{prefix}/detokenize": _post("Text of token ids", "DetokenizeBody", _ref("DetokenizeResponse"),
                                         streams=False) for prefix in ("", "/v1")},
        "/v1/models": {"get": {"summary": "The served model", "security": [{"bearer": []}], "responses": {
            "200": {"description": "OK", "content": {JSON: {"schema": _ref("ModelList")}}},
            **_error_responses(401)}}},
        "/v1/models/{model}": {"get": {
            "summary": "One model's card", "security": [{"bearer": []}],
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "OK", "content": {JSON: {"schema": _ref("Model")}}},
                          **_error_responses(401, 404)}}},
        "/health": {"get": {"summary": "200 while the broker answers and an engine is live", "security": [],
                            "responses": {
                                "200": {"description": "OK", "content": {JSON: {"schema": _ref("Health")}}},
                                "503": {"description": "Unavailable",
                                        "content": {JSON: {"schema": _ref("Health")}}}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics (rill:*)", "security": [], "responses": {
            "200": {"description": "Prometheus text exposition format",
                    "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/tokenizer_info": {"get": {
            "summary": "The tokenizer's special tokens, context length and chat template (as vLLM's)",
            "security": [{"bearer": []}],
            "responses": {"200": {"description": "OK", "content": {JSON: {"schema": _ref("TokenizerInfo")}}},
                          **_error_responses(401, 503)}}},
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
        "components": {"schemas": {**_response_schemas(), **_endpoint_schemas(),
                                   **request_schemas(max_model_len, max_logprobs, ignore_unknown_fields)},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "Only with --api-key / RILL_API_KEY."}}},
    }


@cache
def _cached_spec(model_name: str, max_model_len: int, max_logprobs: int, ignore_unknown_fields: bool) -> bytes:
    return msgspec.json.encode(build_spec(model_name, max_model_len, max_logprobs, ignore_unknown_fields))


async def openapi(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    return Response(_cached_spec(gw.model_name, gw.max_model_len, gw.max_logprobs, gw.ignore_unknown_fields),
                    media_type=JSON)


def routes() -> list[Route]:
    return [Route("/openapi.json", openapi, methods=["GET"])]
