"""The endpoints that answer from the broker and the replicas rather than generate: models,
tokenize and detokenize, tokenizer_info, health and stats (vLLM's paths)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rill.services.gateway import requests
from rill.services.gateway.bodies import DetokenizeBody, TokenizeBody
from rill.services.gateway.engine_stats import read_engine_stats
from rill.services.gateway.errors import APIError, json_response

if TYPE_CHECKING:
    from rill.services.gateway.gateway import Gateway


async def tokenize(request: Request) -> Response:
    """vLLM's /tokenize: the ids a prompt (or chat messages, templated) turns into."""
    gw = request.app.state.gateway
    body = requests.parse(await request.body(), TokenizeBody, gw.admission)
    reply = await gw.call(requests.tokenize_request(body, gw.reply_stream))
    return json_response({"count": len(reply.token_ids), "max_model_len": await served_max_model_len(gw),
                          "tokens": reply.token_ids})


async def detokenize(request: Request) -> Response:
    """vLLM's /detokenize: token ids back to text."""
    gw = request.app.state.gateway
    body = requests.parse(await request.body(), DetokenizeBody, gw.admission)
    reply = await gw.detokenize(body.tokens)
    return json_response({"prompt": reply.text})


async def served_max_model_len(gw: Gateway) -> int:
    """The context served: the least any engine serves (one whose KV cache holds less than the
    model's context serves less), the model's while none has said."""
    served: list[int] = []
    with contextlib.suppress(Exception):  # the broker unreachable: the answer still comes
        served = [st.max_model_len for st in await read_engine_stats(gw.bus) if st.max_model_len > 0]
    return min(served or [gw.max_model_len])


async def _model_card(gw: Gateway) -> dict[str, Any]:
    return {"id": gw.model_name, "object": "model", "created": gw.created, "owned_by": "rill",
            "root": gw.model_name, "parent": None, "max_model_len": await served_max_model_len(gw)}


async def models(request: Request) -> Response:
    return json_response({"object": "list", "data": [await _model_card(request.app.state.gateway)]})


async def model(request: Request) -> Response:
    """One model's card (the openai client's models.retrieve); a name may hold slashes."""
    gw = request.app.state.gateway
    requests.check_model(request.path_params["model"], gw.model_name)
    return json_response(await _model_card(gw))


async def tokenizer_info(request: Request) -> Response:
    """vLLM's GET /tokenizer_info."""
    return Response(await tokenizer_info_json(request.app.state.gateway), media_type="application/json")


async def tokenizer_info_json(gw: Gateway) -> bytes:
    """The tokenizer's facts (eos_token_ids, chat_template, ...), as live replicas' heartbeats keep them."""
    bus = gw.bus
    assert bus is not None
    try:
        info = await bus.r.get(bus.streams.tokenizer_info_key())
    except Exception as exc:
        raise APIError("Redis is unavailable.", 503) from exc
    if info is None:
        raise APIError("No tokenizer replica is live.", 503, type="server_error")
    return info


async def health(request: Request) -> Response:
    """200 while the broker answers and (for a deployed gateway) an engine and at least one tokenizer
    and one detokenizer replica heartbeat; else 503 with the reason."""
    gw = request.app.state.gateway
    try:
        assert gw.bus is not None
        await asyncio.wait_for(gw.bus.r.ping(), 2.0)
    except Exception:
        return json_response({"status": "unavailable", "reason": "the message broker is unreachable"}, 503)
    if gw.watch_engine and not gw.engine_live:
        return json_response({"status": "unavailable", "reason": "no engine is live (no scheduler and worker "
                                                                 "heartbeat)"}, 503)
    missing = gw.missing_roles
    if missing:
        return json_response({"status": "unavailable",
                              "reason": f"no live {' or '.join(missing)} replica (requests wait until one starts)"},
                             503)
    return json_response({"status": "ok"})


async def stats(request: Request) -> Response:
    """Every engine's latest EngineStats, as written by its scheduler after each step."""
    try:
        engines = await read_engine_stats(request.app.state.gateway.bus)
    except Exception as exc:
        raise APIError("Redis is unavailable.", 503) from exc
    return json_response({"engines": [msgspec.to_builtins(st) for st in engines]})


def routes() -> list[Route]:
    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/tokenize", tokenize, methods=["POST"]),
        Route("/v1/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
    ]
