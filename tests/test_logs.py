"""The structured log line: one line per event, and an error in it says what went wrong."""

from __future__ import annotations

import logging

import pytest
import redis

from rill.shared.logs import setup_logging


def test_an_error_in_a_log_line_says_its_message(capsys: pytest.CaptureFixture[str]) -> None:
    """redis-py 8's exceptions repr as their type alone ("network:ConnectionError"); a log line
    that shows one with %r names the type and says the message, %s the message."""
    root, rill = logging.getLogger(), logging.getLogger("rill")
    kept = (root.handlers[:], root.level, rill.level)
    log = setup_logging("probe", "INFO")
    try:
        log.warning("broker error: %r; then %s; %d in flight", redis.ConnectionError("Error 111 connecting"),
                    redis.exceptions.ClusterError("TTL exhausted."), 3)
        line = capsys.readouterr().err.strip()
        assert line.startswith("ts=") and " level=warning service=probe " in line
        assert "broker error: ConnectionError('Error 111 connecting'); then TTL exhausted.; 3 in flight" in line
    finally:
        root.handlers[:] = kept[0]
        root.setLevel(kept[1])
        rill.setLevel(kept[2])
