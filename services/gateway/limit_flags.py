"""The gateway's flags for hostile clients and shutdown, defined once for `rill serve` and
`rill service gateway`, and handed from one to the other (cli.py keeps a line for each use)."""

from __future__ import annotations

import argparse
from typing import Any

from rill.services.gateway.admission import DEFAULT_MAX_WAITING_REQUESTS
from rill.services.gateway.deadline import DEFAULT_PROGRESS_TIMEOUT_S
from rill.services.gateway.drain import DEFAULT_SHUTDOWN_TIMEOUT_S
from rill.services.gateway.server import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_S,
    DEFAULT_MAX_CONNECTIONS,
    ServerLimits,
)
from rill.services.gateway.websocket import DEFAULT_WS_IDLE_TIMEOUT_S


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds (0 or more), got {text!r}")
    return value


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number (0 or more), got {text!r}")
    return int(text)


# (flag, type, default, help); the dest is the flag's name with underscores.
FLAGS: list[tuple[str, Any, float | int, str]] = [
    ("--header-timeout", _seconds, DEFAULT_HEADER_TIMEOUT_S, "seconds a request's headers may take to arrive"),
    ("--body-timeout", _seconds, DEFAULT_BODY_TIMEOUT_S, "seconds its body may take after them"),
    ("--keep-alive-timeout", _seconds, DEFAULT_KEEP_ALIVE_S,
     "seconds an idle kept-alive connection stays open (keep it above your proxy's idle timeout)"),
    ("--max-connections", _count, DEFAULT_MAX_CONNECTIONS, "open sockets per gateway; more get 503"),
    ("--ws-idle-timeout", _seconds, DEFAULT_WS_IDLE_TIMEOUT_S,
     "a WebSocket with no frame and no request in flight this long is closed (0: never)"),
    ("--max-waiting-requests", _count, DEFAULT_MAX_WAITING_REQUESTS,
     "requests one gateway lets wait for their first token; more get 429 with Retry-After (0: no cap)"),
    ("--progress-timeout", _seconds, DEFAULT_PROGRESS_TIMEOUT_S,
     "a request with no new token this long ends with 504 and is aborted (0: never)"),
    ("--shutdown-timeout", _seconds, DEFAULT_SHUTDOWN_TIMEOUT_S,
     "on SIGTERM, seconds requests in flight may take to finish before they are ended"),
]


def add_limit_flags(p: argparse.ArgumentParser) -> None:
    for flag, kind, default, text in FLAGS:
        p.add_argument(flag, type=kind, default=default, help=f"{text} (default {default:g})")


def limit_argv(ns: argparse.Namespace) -> list[str]:
    """The flags again, for a child's command line."""
    return [arg for flag, *_ in FLAGS for arg in (flag, str(getattr(ns, _dest(flag))))]


def limit_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """app.run's keyword arguments from the flags."""
    return {"server_limits": ServerLimits(header_timeout_s=ns.header_timeout, body_timeout_s=ns.body_timeout,
                                          max_connections=ns.max_connections, keep_alive_s=ns.keep_alive_timeout),
            "ws_idle_timeout_s": ns.ws_idle_timeout, "max_waiting_requests": ns.max_waiting_requests,
            "progress_timeout_s": ns.progress_timeout, "shutdown_timeout_s": ns.shutdown_timeout}


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")
