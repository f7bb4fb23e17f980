"""Amplification: a request's parameters are bounded where they would be copied per sample and
per step (stop strings ride every detokenizer row), so the largest broker entry stays small
even for n at its cap with the longest stop lists, and other requests are served meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from service_stack import ServiceStack, fresh_stack

from rill.services.gateway.bodies import MAX_N, MAX_STOP, MAX_STOP_LEN, MAX_STOP_TOKEN_IDS, MAX_TOKEN_CHARS

ENTRY_BOUND = 1 << 20  # bytes: the largest entry any stream may hold during the run


@pytest.fixture(scope="module")
def stack(redis_url: str, smollm2_dir: str) -> Iterator[ServiceStack]:
    with fresh_stack(redis_url, smollm2_dir, "amp", ["--max-num-seqs", str(MAX_N)]) as s:
        yield s


def largest_entry(stack: ServiceStack) -> tuple[int, str]:
    """(bytes, stream) of the largest entry still held on any of the stack's streams."""
    best = (0, "")
    for key in stack.redis.scan_iter(match=f"{stack.prefix}:*", count=1000):
        if stack.redis.type(key) != b"stream":
            continue
        for _, fields in stack.redis.xrange(key):
            size = sum(len(k) + len(v) for k, v in fields.items())
            best = max(best, (size, key.decode()))
    return best


@pytest.mark.parametrize("field,value,param", [
    ("stop", ["x" * (MAX_STOP_LEN + 1)], "stop"),
    ("stop", "y" * (MAX_STOP_LEN + 1), "stop"),
    ("stop", ["z"] * (MAX_STOP + 1), "stop"),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
    # Prompts that cannot fit the context (2,048 tokens here), refused before tokenizing.
    ("prompt", "a" * (2048 * MAX_TOKEN_CHARS + 1), "prompt"),
    ("prompt", [5] * 2049, "prompt"),
])
def test_oversized_parameters_are_refused(stack: ServiceStack, field: str, value: object, param: str) -> None:
    r = httpx.post(f"{stack.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text


def test_largest_request_runs_with_bounded_entries(stack: ServiceStack) -> None:
    stops = [f"{i:02d}" + "q" * (MAX_STOP_LEN - 2) for i in range(MAX_STOP)]
    big = {"prompt": "Count: 1, 2, 3,", "max_tokens": 3, "n": MAX_N, "stop": stops, "min_tokens": 2,
           "stop_token_ids": list(range(1000, 1000 + MAX_STOP_TOKEN_IDS)), "temperature": 1.0}

    async def run() -> tuple[httpx.Response, httpx.Response, int]:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as c:
            biggest = 0
            task = asyncio.create_task(c.post("/v1/completions", json=big))
            other = await c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
            while not task.done():  # sample the streams while the big request runs
                biggest = max(biggest, largest_entry(stack)[0])
                await asyncio.sleep(0.05)
            return await task, other, biggest

    resp, other, biggest = asyncio.run(run())
    assert resp.status_code == 200 and len(resp.json()["choices"]) == MAX_N, resp.text[:500]
    assert other.status_code == 200 and other.json()["choices"][0]["text"]
    size, where = largest_entry(stack)
    assert max(size, biggest) < ENTRY_BOUND, (size, where, biggest)
