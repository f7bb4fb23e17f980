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


@dataclass
class _Size:
    steps: int  # decode steps of this batch size so far
    timings: dict[int, _Timing]  # per thread count

    def best(self) -> int | None:
        """The count with the lower running mean; None while one is untimed."""
        if any(t.mean_s is None for t in self.timings.values()):
            return None
        return min(self.timings, key=lambda n: self.timings[n].mean_s or 0.0)


class StepThreads:
    """Chooses a step's thread count (`choose`) and learns from its time (`record`)."""

    def __init__(self, most: int) -> None:
        self.options = (most, most - 1) if most > 1 else (most,)
        self._sizes: dict[int, _Size] = {}
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
        size = self._sizes.setdefault(key, _Size(0, {n: _Timing() for n in self.options}))
        best = size.best()
        if best is None:
            return next(n for n, t in size.timings.items() if t.mean_s is None)
        for n, t in size.timings.items():
            if n != best and size.steps - t.last_tried >= RETRY_STEPS << min(max(t.losses - 1, 0), MAX_BACKOFF):
                return n
        return best

    def record(self, plan: StepPlan, threads: int, seconds: float) -> None:
        key = self.batch_size(plan)
        if len(self.options) == 1 or key is None:
            return
        size = self._sizes[key]
        t = size.timings[threads]
        # A count timed long ago starts over: the load it was timed under has moved on.
        fresh = t.mean_s is None or size.steps - t.last_tried >= RETRY_STEPS
        t.mean_s = seconds if fresh else SMOOTHING * seconds + (1 - SMOOTHING) * (t.mean_s or seconds)
        size.steps += 1
        t.last_tried = size.steps
        others = [o.mean_s for n, o in size.timings.items() if n != threads and o.mean_s is not None]
        t.losses = t.losses + 1 if others and t.mean_s > min(others) else 0
        self._tell(key, size)

    def _tell(self, rows: int, size: _Size) -> None:
        """Log a batch size's count when it changes; at info the first time one settles on fewer
        threads than the worker has (the decision a reader of the log would not guess)."""
        best = size.best()
        if best is not None and self._told.get(rows) != best:
            level = logging.INFO if rows not in self._told and best < self.options[0] else logging.DEBUG
            span = f"{rows // 2 + 1}-{rows}" if rows > 2 else str(rows)
            log.log(level, "decode batches of %s rows run on %d threads (%s)", span, best,
                    ", ".join(f"{n}: {(t.mean_s or 0.0) * 1e3:.1f} ms" for n, t in sorted(size.timings.items())))
            self._told[rows] = best

    def summary(self) -> dict[int, int]:
        """The count each timed batch size runs on now, e.g. {1: 1, 8: 2}."""
        return {rows: best for rows, size in sorted(self._sizes.items()) if (best := size.best()) is not None}
