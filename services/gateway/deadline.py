"""The progress deadline: a request that gets no new token for too long is ended, not left hanging.

A reply or request entry trimmed before anyone read it, a gap the DeltaSequencer can never fill,
or an engine that stalls without dying would otherwise keep a client waiting for ever. The
gateway's watch task calls `stalled` every round, ends those requests with a 504 (an error frame
on the WebSocket) and aborts them, so their engine KV blocks are freed. The clock starts when the
request is registered, so the wait for the first token counts too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from rill.shared.schema import ErrorReply

DEFAULT_PROGRESS_TIMEOUT_S = 300.0  # 0: no deadline


class _Progressing(Protocol):
    request_id: str
    terminal: bool
    last_progress: float


def stalled(streams: Iterable[_Progressing], now: float, timeout_s: float) -> list[str]:
    """Ids of the requests with no progress for more than `timeout_s` (none when it is 0)."""
    if timeout_s <= 0:
        return []
    return [s.request_id for s in streams if not s.terminal and now - s.last_progress > timeout_s]


def timed_out(request_id: str, timeout_s: float) -> ErrorReply:
    return ErrorReply(request_id=request_id, status=504, type="timeout",
                      message=f"The request made no progress for {timeout_s:g} s and was stopped; "
                              f"please retry.")
