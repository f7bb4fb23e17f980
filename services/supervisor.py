"""Starts every service as a child process, watches them, and stops them all together.

A child that dies is reported and restarted with backoff: the broker redelivers what a
stateless one (gateway, tokenizer, detokenizer) had not acked, a restarted worker is re-fed by
its scheduler, and a restarted scheduler fails with a clear error the requests its predecessor
held (scheduler/held_requests.py) while the engine's other processes and every other engine
serve on. A child that keeps dying, more than `max_restarts` restarts within RESTART_WINDOW_S,
ends the whole server with a non-zero status (a child killed now and then, as chaos testing
does, is restarted for ever); one that exits with EXIT_CONFIG (a configuration it can never
serve, said in its last line) ends it at once. Children of one `group` (the ranks of a
tensor-parallel worker) live and die together: when one exits, the others are killed and all of
them start again together.

Stopping goes front to back (STOP_ORDER), each stage waited for: the gateways first, given
`drain_s` to let their requests in flight finish (they drain on SIGTERM, gateway/drain.py) while
every other service still runs; then the tokenizers, the engine, the detokenizers, each finishing
(and acknowledging) what it read, so nothing is left in the broker's pending lists.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rill.shared.lifecycle import EXIT_CONFIG

log = logging.getLogger("rill.supervisor")

RESTARTABLE = {"gateway", "tokenizer", "detokenizer", "worker", "scheduler"}
STOP_ORDER = ("gateway", "tokenizer", "scheduler", "worker", "detokenizer")
RESTART_WINDOW_S = 60.0


@dataclass
class Child:
    name: str  # e.g. "tokenizer-1"
    kind: str  # service name
    argv: list[str]
    group: str = ""  # children that restart together (tensor-parallel ranks); "" for none
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    next_start: float = 0.0
    history: list[float] = field(default_factory=list)  # restart times within the window

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv)
        self.started_at = time.monotonic()
        log.info("started %s pid=%d", self.name, self.proc.pid)


class Supervisor:
    def __init__(self, children: list[Child], max_restarts: int = 5, drain_s: float = 0.0) -> None:
        self.children = children
        self.max_restarts = max_restarts
        self.drain_s = drain_s  # the gateways' --shutdown-timeout
        self.stopping = False
        self.exit_code = 0

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stopping = True

    def start(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        for child in self.children:
            child.start()

    def poll(self) -> bool:
        """Check children once; returns False when the server must stop (and from then on)."""
        if self.exit_code:  # a later poll must not restart what ended the server
            return False
        now = time.monotonic()
        for child in self.children:
            if child.proc is None:
                if now >= child.next_start:
                    child.start()
                continue
            code = child.proc.poll()
            if code is None:
                continue
            log.error("service %s (pid %d) exited with code %s", child.name, child.proc.pid, code)
            print(f"rill: service {child.name} exited with code {code}", file=sys.stderr, flush=True)
            child.proc = None
            if code == EXIT_CONFIG:  # it said why; a restart would say it again
                print(f"rill: {child.name} cannot serve this configuration (above): stopping", file=sys.stderr,
                      flush=True)
                self.exit_code = EXIT_CONFIG
                return False
            child.history = [t for t in child.history if now - t < RESTART_WINDOW_S]
            if child.kind not in RESTARTABLE or len(child.history) >= self.max_restarts:
                self.exit_code = 1
                return False
            child.restarts += 1
            child.history.append(now)
            child.next_start = now + min(10.0, 0.5 * 2 ** len(child.history))
            self._stop_group(child)
        return not self.stopping

    def _stop_group(self, dead: Child) -> None:
        """Kill the rest of a dead child's group; they all start again at its restart time."""
        if not dead.group:
            return
        for other in self.children:
            if other is dead or other.group != dead.group:
                continue
            if other.proc is not None:
                if other.proc.poll() is None:
                    other.proc.kill()
                other.proc.wait()
                log.warning("stopped %s with %s (one group)", other.name, dead.name)
                other.proc = None
            other.next_start = dead.next_start

    def wait(self) -> int:
        try:
            while self.poll():
                time.sleep(0.2)
        finally:
            self.stop()
        return self.exit_code

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every child, stage by stage (see the module docstring); `timeout` per stage,
        beyond the gateways' drain."""
        order = {kind: i for i, kind in enumerate(STOP_ORDER)}
        for stage in sorted({order.get(c.kind, len(order)) for c in self.children}):
            live = [c.proc for c in self.children if c.proc is not None and c.proc.poll() is None
                    and order.get(c.kind, len(order)) == stage]
            for proc in live:
                proc.terminate()
            deadline = time.monotonic() + timeout + (self.drain_s if stage == order["gateway"] else 0.0)
            for proc in live:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def children_of(pid: int) -> dict[int, str]:
    """pid -> command line of the direct children of `pid`, read from /proc (Linux): how tools
    and tests find the processes a `rill serve` started."""
    out: dict[int, str] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
    return out
