"""How many threads each CPU step runs on: all of the worker's, or one fewer, whichever its steps
of that batch size took less time on while serving.

On a machine the worker shares with the rest of the pipeline (scheduler, broker, detokenizer,
gateway: `rill serve` on one host), each slice those take from a core stalls the worker's
lock-stepped OpenMP team; at one stream they run after every step. A small decode step then ends
sooner on one thread fewer, with the other services on the core left free; a large step still
wants every core. Which way a decode step goes depends on the machine and the load, so it is
timed, not assumed: each batch size (to the next power of two) tries both counts, then runs on
the faster, and tries the other again after a while, less often each time it loses. Steps with
prompt tokens always take every thread: they are compute-bound, and trying them on fewer costs a
whole step's worth (a 512-token step took 1.8x as long on one of two cores).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rill.shared.schema import StepPlan

SMOOTHING = 0.25  # weight of the newest step time in a count's running mean
RETRY_STEPS = 64  # steps of a batch size before its slower count is timed again, doubled per loss
MAX_BACKOFF = 6  # at most 64 x 2^6 steps between tries

log = logging.getLogger("rill.worker")


@dataclass
class _Timing:
    mean_s: float | None = None
    last_tried: int = 0  # the size's step count when this count last ran
    losses: int = 0  # tries in a row that left it slower


class StepThreads:
    """Chooses a step's thread count (`choose`) and learns from its time (`record`)."""

    def __init__(self, most: int) -> None:
        self.options = (most, most - 1) if most > 1 else (most,)
        self._sizes: dict[int, tuple[int, dict[int, _Timing]]] = {}
        self._told: dict[int, int] = {}  # the count last logged per batch size

    @staticmethod
    def batch_size(plan: StepPlan) -> int | None:
        """A decode-only step's rows rounded up to a power of two; None for any other step."""
        counts = plan.num_scheduled_tokens
        if not counts or any(n != 1 for n in counts):
            return None
        return 1 << (len(counts) - 1).bit_length()

    def choose(self, plan: StepPlan) -> int:
        key = self.batch_size(plan)
        if len(self.options) == 1 or key is None:
            return self.options[0]
        steps, timings = self._sizes.setdefault(key, (0, {n: _Timing() for n in self.options}))
        untried = [n for n in self.options if timings[n].mean_s is None]
        if untried:
            return untried[0]
        best = min(self.options, key=lambda n: timings[n].mean_s or 0.0)
        for n in self.options:
            t = timings[n]
            if n != best and steps - t.last_tried >= RETRY_STEPS << min(max(t.losses - 1, 0), MAX_BACKOFF):
                return n
        return best

    def record(self, plan: StepPlan, threads: int, seconds: float) -> None:
        key = self.batch_size(plan)
        if len(self.options) == 1 or key is None:
            return
        steps, timings = self._sizes[key]
        t = timings[threads]
        # A count timed long ago starts over: the load it was timed under has moved on.
        fresh = t.mean_s is None or steps - t.last_tried >= RETRY_STEPS
        t.mean_s = seconds if fresh else SMOOTHING * seconds + (1 - SMOOTHING) * (t.mean_s or seconds)
        t.last_tried = steps + 1
        others = [o.mean_s for n, o in timings.items() if n != threads and o.mean_s is not None]
        t.losses = t.losses + 1 if others and t.mean_s > min(others) else 0
        self._sizes[key] = (steps + 1, timings)
        self._tell(key, timings)

    def _tell(self, rows: int, timings: dict[int, _Timing]) -> None:
        """Log a batch size's count when it changes; at info the first time one settles on fewer
        threads than the worker has (the decision a reader of the log would not guess)."""
        if any(t.mean_s is None for t in timings.values()):
            return
        best = min(timings, key=lambda n: timings[n].mean_s or 0.0)
        if self._told.get(rows) != best:
            level = logging.INFO if rows not in self._told and best < self.options[0] else logging.DEBUG
            size = f"{rows // 2 + 1}-{rows}" if rows > 2 else str(rows)
            log.log(level, "decode batches of %s rows run on %d threads (%s)", size, best,
                    ", ".join(f"{n}: {(t.mean_s or 0.0) * 1e3:.1f} ms" for n, t in sorted(timings.items())))
            self._told[rows] = best

    def summary(self) -> dict[int, int]:
        """The count each timed batch size runs on now, e.g. {1: 1, 8: 2}."""
        return {rows: min(timings, key=lambda n: timings[n].mean_s or 0.0)
                for rows, (_, timings) in sorted(self._sizes.items())
                if all(t.mean_s is not None for t in timings.values())}
