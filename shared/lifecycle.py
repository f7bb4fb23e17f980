"""A service process's life: its heap once started, a graceful stop on SIGTERM/SIGINT."""

from __future__ import annotations

import gc
import signal
import threading

# A service's exit status for a configuration it can never serve (sysexits' EX_CONFIG): the
# supervisor stops the server instead of restarting it (services/supervisor.py).
EXIT_CONFIG = 78


class StopFlag:
    """Set by SIGTERM/SIGINT; loops poll it between bounded blocking reads."""

    def __init__(self, install: bool = True) -> None:
        self._event = threading.Event()
        if install and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handle)
            signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self._event.set()

    def set(self) -> None:
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        return self._event.wait(seconds)


# Blocking reads wake at least this often so a stop request is noticed promptly.
POLL_MS = 500


# The collector's young-generation threshold in a service process. It counts tracked containers
# allocated minus freed, so a step's short-lived lists never reach it; serving state that grows
# does, and at Python's 700 that meant a collection every few scheduler steps with a thousand
# requests running (scripts/benchmarks.md, bench_scheduler.py).
GEN0_THRESHOLD = 20_000


def settle_heap() -> None:
    """Called by a service's own process once its modules are imported (torch's and transformers'
    are most of a worker's objects): freeze them out of the cyclic collector's sight, as vLLM
    does, so a full collection scans only what serving allocates instead of the whole import heap."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, *gc.get_threshold()[1:])
