"""The admission cap: how many requests one gateway lets wait for their first token.

It counts this gateway's own requests that were sent on but have not produced a token yet (in the
tokenizer stream, the engine's waiting queue or its prefill), not the engines' `num_waiting`
from EngineStats: the local count is exact and moves the moment a request arrives, while the
stats are a step old, so a burst of a thousand requests would all pass before they showed up.
Several gateways each keep their own cap; the engines' queue is bounded by replicas x cap.
Over the cap a request gets 429 with Retry-After (an error frame on the WebSocket) at once,
instead of queueing without bound; as requests start running, room opens again.
"""

from __future__ import annotations

from rill.services.gateway.errors import APIError

DEFAULT_MAX_WAITING_REQUESTS = 1024  # per gateway; 0: no cap
RETRY_AFTER_S = 1  # a queue slot opens as soon as any request starts running: retry soon


def admit(waiting: int, cap: int) -> None:
    """Raise a 429 when `waiting` (this request included) is over `cap`."""
    if cap > 0 and waiting > cap:
        raise APIError(f"The server has {cap} requests waiting already; retry in {RETRY_AFTER_S} s.", 429,
                       type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
