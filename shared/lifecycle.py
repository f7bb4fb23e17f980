"""Graceful stop on SIGTERM/SIGINT for the synchronous service loops."""

from __future__ import annotations

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
