"""Kernel choice by measurement on the serving machine.

Several CPU ops have more than one implementation, and which one is fastest depends on the core,
not on its flags alone: on an AMX Xeon oneDNN's bf16 GEMMs beat the native AVX512-BF16 small GEMM
3-10x from 16 rows up, on an AMD EPYC without AMX the small GEMM beats oneDNN up to 1024 rows, and
on an Intel Xeon without AMX oneDNN's fp32 GEMM beats both bf16 ones from ~64 rows. So at start-up
the worker times the candidates of every op on its model's own shapes (`tune`, a second or two the
first time), keeps the answer in Rill's cache folder keyed by the CPU model, its flags, torch's
version, the native kernels' sources and the thread count, and every later start on the machine
reads it back. A changed key measures anew.

Ops and their candidates (the first is the incumbent: a challenger must win by `MARGIN`):
- `gemm`, per weight shape and row bucket: `onednn` (weight pre-packed for oneDNN; AMX where the
  CPU has it), `small` (native AVX512-BF16 dot products) and, for a bf16 layer, `f32` (oneDNN's
  fp32 GEMM on an fp32 copy of the weight: faster where the bf16 units are slower than the FMAs).
- `gemm_int8` (`--quantization int8`), per shape and row bucket: `int_mm` (oneDNN's s8 GEMM:
  VNNI / AMX-INT8) and `fp32` (the same int8 values multiplied in fp32).
- `gguf_gemm` (GGUF models), per weight part's shape, format and row bucket: `blocks` (the native
  integer-dot GEMM on the blocks), `dequant` (tiles dequantized, then torch's GEMM) and `float`
  (a float copy made at load, served as a `gemm` layer); see gguf_linear.py. The incumbent is
  `blocks` up to 4 rows, `float` above, except where the x16 GEMM serves the format (`blocks`).
- `prefill`, per head layout and context bucket: `amx`, `dot`, `vector` (native kernels reading
  the paged cache in place) and `sdpa` (torch's attention over gathered keys).
- `decode`, per head layout: `native` (registers-only path where the shape allows), `generic`
  (the native kernel's general loop) and `torch` (gathers and batched matmuls).
- `silu_mul`, per MLP width and row bucket: `native` (one pass, cpu_elementwise.c) and `torch`
  (three ops); the incumbent is `native` where the build has its AVX512-BF16 path. The layer
  driver (decode_layers.py) takes a SwiGLU model's steps only where it is `native`.

Every candidate runs on the same inputs before it is timed; one whose output differs from the
incumbent's beyond rounding is dropped (and logged), so a choice never changes results beyond
the dtype's rounding. The installed table (`install`, done by the model runner before it loads
the model) is read when a layer is built and once per attention step; without one every op
keeps its incumbent.
"""

from __future__ import annotations

import bisect
import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rill.shared.model_files import cache_root

log = logging.getLogger("rill.kernels")

VERSION = 8  # bump when what is measured, or how, changes: every cached table is then stale
ROW_BUCKETS = (1, 4, 16, 32, 64, 256, 512)  # a call with m rows uses the first bucket >= m (else the last)
LOGIT_BUCKETS = (1, 4, 16, 32, 64, 128)  # the LM head sees sampled rows only (about the decode batch)
DECODE_ROWS = 64  # the most rows of a decode-sized step (the buckets above are prompt chunks')
DECODE_BUCKETS = tuple(b for b in ROW_BUCKETS if b <= DECODE_ROWS)
CONTEXT_BUCKETS = (1024, 8192)  # prompt attention: longest context of the step's chunks
MARGIN = 0.05  # a challenger replaces the incumbent only when this much faster
BUDGET_S = 0.025  # timing budget of one entry after its first runs (at least MIN_REPEATS each)
MIN_REPEATS = 3
EVICT_MAX = 256 << 20  # bytes read to evict the caches before a cold probe's call
TOTAL_S = 10.0  # past this, the rest of a table keeps its incumbents (measured at a later start)

Entry = dict[str, object]  # {"choice": name, "us": {name: best µs}, "dropped": [names]}


@dataclass
class KernelTable:
    """Measured choices, keyed by op, shape and bucket (see `key`)."""

    entries: dict[str, Entry] = field(default_factory=dict)

    @staticmethod
    def key(op: str, shape: Sequence[object], bucket: int) -> str:
        return f"{op}|{'x'.join(map(str, shape))}|{bucket}"

    def choice(self, op: str, shape: Sequence[object], bucket: int) -> str | None:
        entry = self.entries.get(self.key(op, shape, bucket))
        return str(entry["choice"]) or None if entry is not None else None

    def route(self, op: str, shape: Sequence[object], buckets: Sequence[int],
              defaults: Sequence[str]) -> Route:
        """The measured choice per bucket; `defaults[i]` (the incumbent) where none was measured."""
        return Route(tuple(buckets), tuple(self.choice(op, shape, b) or d
                                           for b, d in zip(buckets, defaults, strict=True)))

    def rows(self) -> list[tuple[str, str, str, str, dict[str, float]]]:
        """(op, shape, bucket, choice, µs by candidate) for each entry, in key order."""
        out = []
        for k in sorted(self.entries, key=_sort_key):
            op, shape, bucket = k.split("|")
            e = self.entries[k]
            if not e["choice"]:
                continue  # one candidate only: nothing was measured
            out.append((op, shape, bucket, str(e["choice"]), dict(e["us"])))  # type: ignore[arg-type]
        return out


def _sort_key(k: str) -> tuple[str, str, int]:
    op, shape, bucket = k.split("|")
    return op, shape, int(bucket)


@dataclass(frozen=True)
class Route:
    """Which implementation serves a call of `size` rows (or tokens of context): the choice of
    the first bucket >= size (the last bucket's beyond it)."""

    buckets: tuple[int, ...]
    choices: tuple[str, ...]

    def pick(self, size: int) -> str:
        return self.choices[min(bisect.bisect_left(self.buckets, size), len(self.choices) - 1)]

    def uses(self, name: str, buckets: Collection[int] | None = None) -> bool:
        """Whether some bucket (of `buckets`; None: any) chose `name`."""
        return any(c == name and (buckets is None or b in buckets) for b, c in zip(self.buckets, self.choices, strict=True))

    def buckets_of(self, name: str) -> tuple[int, ...]:
        """The buckets that chose `name`."""
        return tuple(b for b, c in zip(self.buckets, self.choices, strict=True) if c == name)


_installed = KernelTable()


def install(table: KernelTable) -> None:
    """Make `table` the process's choices (the model runner, before it builds layers)."""
    global _installed
    _installed = table


def installed() -> KernelTable:
    return _installed


# ------------------------------------------------------------------------------ measuring

@dataclass
class Probe:
    """One op at one shape and bucket: candidates (name -> a call on prepared inputs returning
    its output), the first being the incumbent; outputs must match within rtol/atol."""

    op: str
    shape: tuple[object, ...]
    bucket: int
    candidates: dict[str, Callable[[], torch.Tensor]]
    rtol: float = 2e-2
    atol: float = 2e-2
    # Evict the CPU caches before each timed call: a layer's weights stream from memory when a model
    # larger than the cache serves, which is what separates a compact weight format from a wide one.
    cold: bool = False
    # Per candidate, run between the eviction and the timed call: the same route on other (small)
    # weights, as the layer before it would in a step. Without it a cold call also pays for waking
    # the thread pool and reloading code (~150-200 µs on a 2-core VM), which hid the weight bytes.
    primes: dict[str, Callable[[], object]] = field(default_factory=dict)


def measure(probe: Probe, budget_s: float = BUDGET_S) -> Entry:
    """Time the probe's candidates in interleaved rounds (so a load on the machine slows all of
    them alike) and keep each one's best; the fastest wins unless the incumbent is within MARGIN."""
    names = list(probe.candidates)
    outs = {name: probe.candidates[name]().float() for name in names}  # also their first calls (set-up)
    reference = outs[names[0]]
    scale = 1.0 + float(reference.abs().max()) if reference.numel() else 1.0
    usable, dropped = [], []
    for name, out in outs.items():
        if out.shape == reference.shape and torch.allclose(out, reference, rtol=probe.rtol, atol=probe.atol * scale):
            usable.append(name)
        else:
            dropped.append(name)
            log.warning("kernel %s %s: candidate %s disagrees with %s; not used", probe.op, probe.shape, name,
                        names[0])
    del outs
    best = dict.fromkeys(usable, math.inf)
    deadline = None
    rounds = 0
    while rounds < MIN_REPEATS or (deadline is not None and time.perf_counter() < deadline):
        for name in usable:
            if probe.cold:
                _evict_caches()
                if name in probe.primes:
                    probe.primes[name]()
            t = time.perf_counter()
            probe.candidates[name]()
            best[name] = min(best[name], time.perf_counter() - t)
        rounds += 1
        if deadline is None:
            deadline = time.perf_counter() + budget_s
    incumbent = usable[0]
    fastest = min(usable, key=best.__getitem__)
    choice = fastest if best[fastest] < best[incumbent] * (1 - MARGIN) else incumbent
    return {"choice": choice, "us": {n: round(v * 1e6, 1) for n, v in best.items()}, "dropped": dropped}


@functools.cache
def _eviction_buffer() -> torch.Tensor:
    """Twice the last-level cache (sysfs; 32 MiB where it does not say), read to push it out; at
    most EVICT_MAX (a VM may report its host's whole L3, 480 MiB on one, of which it gets a share)."""
    size = 32 << 20
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        size = int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1], 0)
    except (OSError, ValueError):
        pass
    return torch.ones(min(2 * size, EVICT_MAX) // 4, dtype=torch.float32)


def _evict_caches() -> None:
    _eviction_buffer().sum()


# ------------------------------------------------------------------------------ the cache

def cpu_model() -> str:
    """The "model name" line of /proc/cpuinfo (x86 Linux), else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> str:
    """What a cached table holds for: CPU model and flags, torch, the native kernels' build, the
    thread count and this module's VERSION."""
    from rill.kernels import cpu_native, native_build

    parts = [cpu_model(), native_build.cpu_flags(), platform.machine(), torch.__version__,
             cpu_native.build_key() or "no-native", str(torch.get_num_threads()), str(VERSION)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def table_path(key: str | None = None) -> Path:
    return cache_root() / "kernel-choice" / f"{key or machine_key()}.json"


def load(key: str | None = None) -> KernelTable:
    try:
        data = json.loads(table_path(key).read_text())
        return KernelTable(dict(data["entries"]))
    except (OSError, ValueError, KeyError, TypeError):
        return KernelTable()


NOTHING_TO_CHOOSE: Entry = {"choice": "", "us": {}, "dropped": []}


def tune(probes: Iterable[Callable[[], Probe | None]], keys: Iterable[str], key: str | None = None,
         remeasure: bool = False) -> tuple[KernelTable, int]:
    """The cached table with every missing entry of `keys` measured (probes[i] builds the probe
    of keys[i], None where this machine has one candidate only) and saved; returns (table, entries measured now). Workers starting together on a
    fresh machine: one measures (without the others' probes competing for the cores), the rest
    wait for it and read its answer. `remeasure`: measure `keys` anew (the table's other entries
    stay)."""
    key = key or machine_key()
    path = table_path(key)
    pairs = list(zip(keys, probes, strict=True))

    def cached() -> KernelTable:
        table = load(key)
        for k, _ in pairs if remeasure else ():
            table.entries.pop(k, None)
        return table

    table = cached()
    if all(k in table.entries for k, _ in pairs):
        return table, 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        table = cached()
        todo = [(k, make) for k, make in pairs if k not in table.entries]
        if todo:
            log.info("kernel choice: measuring %d entries on this machine (once: later starts reuse them) ...",
                     len(todo))
        start = time.perf_counter()
        for i, (k, make) in enumerate(todo):
            if time.perf_counter() - start > TOTAL_S:
                log.warning("kernel choice: %d entries left unmeasured after %.0f s; their incumbents serve "
                            "until a later start measures them", len(todo) - i, TOTAL_S)
                todo = todo[:i]
                break
            probe = make()
            table.entries[k] = measure(probe) if probe is not None else dict(NOTHING_TO_CHOOSE)
        _eviction_buffer.cache_clear()  # not held for the process's life
        if todo:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"cpu": cpu_model(), "torch": torch.__version__,
                                       "threads": torch.get_num_threads(), "entries": table.entries}, indent=1))
            os.replace(tmp, path)  # atomic: a reader never sees half a file
            log.info("kernel choice: measured %d entries in %.1f s (%s)", len(todo), time.perf_counter() - start, path)
    return table, len(todo)


def summary(table: KernelTable, keys: Iterable[str]) -> str:
    """One line for the log: each measured op and shape with its choice per bucket."""
    by_shape: dict[str, list[str]] = {}
    for k in keys:
        e = table.entries.get(k)
        if e and e["choice"]:
            op, shape, bucket = k.split("|")
            by_shape.setdefault(f"{op} {shape}", []).append(f"{bucket}:{e['choice']}")
    return "; ".join(f"{name} {' '.join(cells)}" for name, cells in by_shape.items()) or "nothing to choose"


def report(table: KernelTable, keys: Iterable[str] | None = None) -> str:
    """The table as text: one line per entry, every candidate's best time, the choice marked."""
    wanted = None if keys is None else set(keys)
    lines = [f"kernel choices on {cpu_model()} ({torch.get_num_threads()} threads, torch {torch.__version__})",
             f"{'op':<10} {'shape':<22} {'bucket':>6}  candidates (best µs; * chosen)"]
    for op, shape, bucket, choice, us in table.rows():
        if wanted is not None and KernelTable.key(op, shape.split("x"), int(bucket)) not in wanted:
            continue
        cells = "  ".join(f"{'*' if n == choice else ' '}{n} {v:.0f}" for n, v in us.items())
        lines.append(f"{op:<10} {shape:<22} {bucket:>6}  {cells}")
    return "\n".join(lines)
