"""Structured, quiet-by-default logging: one line per event, `key=value` fields.

Rill's own loggers default to INFO, used only for start-up facts (KV sizing, addresses) and
lifecycle events; nothing logs per step or per token above DEBUG. Third-party libraries are held
at WARNING. RILL_LOG_LEVEL overrides Rill's level.
"""

from __future__ import annotations

import logging
import sys
import time

from rill.shared import envs


class _Error:
    """An exception in a log line's arguments: its repr names its type and says its message, as
    Python's own does (redis-py 8's says only the type: "network:ConnectionError")."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __repr__(self) -> str:
        return f"{type(self.exc).__name__}({str(self.exc)!r})"

    def __str__(self) -> str:
        return str(self.exc)


class _KeyValueFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        if isinstance(record.args, tuple):
            record.args = tuple(_Error(a) if isinstance(a, BaseException) else a for a in record.args)
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = f"ts={ts}.{int(record.msecs):03d}Z level={record.levelname.lower()} service={self.service} pid={record.process} msg={record.getMessage()!r}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(service: str, level: str | None = None) -> logging.Logger:
    level = (level or envs.RILL_LOG_LEVEL).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_KeyValueFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("rill").setLevel(level)
    return logging.getLogger(f"rill.{service}")
