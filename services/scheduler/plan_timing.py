"""When to send a plan built ahead: as late as the worker allows, so it takes in late arrivals.

Async scheduling hides the scheduler's share of each step (building the plan, the broker hop,
applying the result) behind the step the worker is running. A plan built the moment that step
starts is fixed for all of it, though: a request arriving a moment later misses it and waits one
more step. That is the common case, not a corner: a client's next request follows the reply to
its last one by a few milliseconds, and the reply leaves when the step that finished it does.
On a CPU, where a decode step is long, the follow-ups of one step then miss two plans and
bunch up with the next step's into prompt steps over the budget, which spill further (TTFT
figures in scripts/benchmarks.md).

So the plan ahead waits until only LEAD of the running step is left, by an estimate of the
step's length from the worker's timing of the decode-only steps before it (plans are built
ahead only behind decode-only steps, see Scheduler.may_plan_ahead). A step that ends earlier than estimated
costs the worker the difference in idle time; one that ends later costs nothing (the plan just
went out sooner than needed). With no estimate yet the plan goes out at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

LEAD = 0.25  # share of the running step's estimated length left when the plan ahead goes out
MIN_LEAD_S = 0.002  # never less: building and sending a plan takes about a millisecond
SMOOTHING = 0.3  # weight of the newest decode step in the running estimate


class PlanTimer:
    """Step start and end times as the scheduler sees them, and when the next plan is due."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.decode_step_s: float | None = None  # estimated length of a decode-only step
        self._sent: dict[int, tuple[float, bool]] = {}  # step id -> (sent at, decode only)
        self._last_result: tuple[int, float] | None = None  # (step id, received at)

    def sent(self, step_id: int, num_scheduled_tokens: list[int]) -> None:
        self._sent[step_id] = (self.clock(), all(n == 1 for n in num_scheduled_tokens))

    def received(self, step_id: int, worker_s: float = 0.0) -> None:
        """The result of `step_id` arrived; `worker_s` is how long the worker says the step took
        (StepResult.forward_ms). A decode-only step's length updates the estimate: the worker's
        own figure when it gives one, since the time the result was read here can be late (the
        scheduler may have been asleep until a plan's due time), which would feed back into
        ever later due times."""
        start = self.started_at(step_id)
        now = self.clock()
        sent = self._sent.pop(step_id, None)
        for older in [s for s in self._sent if s < step_id]:  # failed or lost steps
            del self._sent[older]
        took = worker_s if worker_s > 0 else None if start is None else now - start
        if sent is not None and sent[1] and took is not None:
            self.decode_step_s = took if self.decode_step_s is None else (
                SMOOTHING * took + (1 - SMOOTHING) * self.decode_step_s)
        self._last_result = (step_id, now)

    def started_at(self, step_id: int) -> float | None:
        """When the worker started `step_id`: when it was sent, or, if it was queued behind the
        step before, when that one's result came back (the worker then went straight on)."""
        sent = self._sent.get(step_id)
        if sent is None:
            return None
        if self._last_result is not None and self._last_result[0] == step_id - 1:
            return max(sent[0], self._last_result[1])
        return sent[0]

    def plan_due_at(self, running_step: int | None) -> float:
        """Clock time at which the plan that follows `running_step` (None: nothing running)
        should be sent."""
        if running_step is None or self.decode_step_s is None:
            return float("-inf")
        start = self.started_at(running_step)
        if start is None:
            return float("-inf")
        return start + self.decode_step_s - max(MIN_LEAD_S, LEAD * self.decode_step_s)

    def plan_due(self, running_step: int | None) -> bool:
        return self.clock() >= self.plan_due_at(running_step)

    def reset(self) -> None:
        """The worker restarted: steps in flight are gone (the estimate still holds)."""
        self._sent.clear()
        self._last_result = None
