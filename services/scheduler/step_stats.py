"""What the scheduler counts for the stats key: per-step counters and the queue-time histogram."""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass


@dataclass
class StepCounters:
    steps: int = 0
    mixed_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    max_step_tokens: int = 0
    last_step_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    preemptions: int = 0

    def record_step(self, decode: int, total: int) -> None:
        """Count one plan before it is sent: `total` tokens, `decode` of them decode rows' tokens."""
        prefill = total - decode
        self.steps += 1
        self.prefill_tokens += prefill
        self.decode_tokens += decode
        self.mixed_steps += int(prefill > 0 and decode > 0)
        self.last_step_tokens = total
        self.max_step_tokens = max(self.max_step_tokens, total)


# Bucket bounds (seconds) of the queue-time histogram; fixed, so every scrape of every engine
# lines up, and the gateway exports them as they come (rill:request_queue_time_seconds).
QUEUE_TIME_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
                     120.0, 300.0, 600.0, 1800.0)


class QueueTimeHistogram:
    """Counts per bucket and the sum of observed queue times, since this scheduler started."""

    def __init__(self, bounds: tuple[float, ...] = QUEUE_TIME_BOUNDS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)  # the gateway's clock may run a little ahead of ours
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def cumulative(self) -> list[int]:
        """Prometheus' shape: requests with a queue time <= each bound, then the total."""
        return list(itertools.accumulate(self.counts))
