"""`rill serve` as a benchmark starts it: a child process, ready when it prints "ready at", its
engines' /stats, terminated afterwards. Shared by the benchmarks that compare serving settings."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def serving(argv: list[str], port: int, env: dict[str, str] | None = None) -> Iterator[str]:
    """Run `argv` (a `rill serve` command on `port`); yield its base URL once ready."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "ready at" not in line:
            raise RuntimeError(f"rill serve did not start: {line!r}")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(60)


def engine_stats(base_url: str) -> list[dict[str, Any]]:
    """Every engine's EngineStats from the gateway's /stats, by engine id."""
    with urllib.request.urlopen(f"{base_url}/stats", timeout=10) as resp:
        return sorted(json.loads(resp.read())["engines"], key=lambda s: s["engine_id"])
