"""Stored responses of /v1/responses: `store`, `previous_response_id`, GET and DELETE by id,
and the input items each one answered (GET .../input_items).

A stored response lives in the broker under its own key for RILL_RESPONSES_TTL_S, beside the
conversation that led to it (its input items, previous responses' included), so any gateway
replica continues it: the next request names it as previous_response_id and sends only its new
items. The key is written before the response's last bytes go out (ResponseShape.settle), so a
client that continues at once finds it. One key per response: one slot on a Redis Cluster.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

import msgspec
from redis.exceptions import RedisError

from rill.services.gateway.errors import APIError
from rill.shared import envs
from rill.shared.bus import AsyncBus

RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")  # what ResponseShape hands out
BROKER_DOWN = "The message broker did not answer; the stored response could not be read. Try again."
T = TypeVar("T")


class StoredResponse(msgspec.Struct):
    response: dict[str, Any]  # the Response object as it was returned
    input: list[dict[str, Any]]  # the conversation's items before the response's output

    def conversation(self) -> list[dict[str, Any]]:
        """The items a follow-up continues from: the input, then what the response answered."""
        return [*self.input, *self.response["output"]]


class ResponseStore:
    """The stored responses, in the broker of `bus`."""

    def __init__(self, bus: AsyncBus) -> None:
        self.bus = bus
        self.ttl_s = envs.RILL_RESPONSES_TTL_S

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    async def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        """Keep `response` beside the input `items` it answered, each given an id of its own
        where the client sent none (as OpenAI lists them)."""
        items = [item if "id" in item else {"id": _item_id(item), **item} for item in items]
        data = msgspec.json.encode(StoredResponse(response, items))
        await self.bus.r.set(self.bus.streams.response_key(response["id"]), data, ex=self.ttl_s)

    async def get(self, response_id: str) -> StoredResponse | None:
        if not RESPONSE_ID.fullmatch(response_id):
            return None
        data = await _answered(self.bus.r.get(self.bus.streams.response_key(response_id)))
        return None if data is None else msgspec.json.decode(data, type=StoredResponse)

    async def delete(self, response_id: str) -> bool:
        return bool(RESPONSE_ID.fullmatch(response_id)) and bool(
            await _answered(self.bus.r.delete(self.bus.streams.response_key(response_id))))


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _item_id(item: dict[str, Any]) -> str:
    return f"{_ID_PREFIX.get(item.get('type', 'message'), 'item')}_{uuid.uuid4().hex}"


async def _answered(command: Awaitable[T]) -> T:
    """A read of the broker for a request: a broker that fails it is the client's 503."""
    try:
        return await command
    except RedisError as exc:
        raise APIError(BROKER_DOWN, 503, type="server_error") from exc
