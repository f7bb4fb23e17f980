"""What `--dtype auto` means on this machine.

bfloat16 on CUDA. On a CPU the answer depends on the core, not just on its flags: with AMX the
bf16 matrix units run serving-shape GEMMs several times faster than fp32; with AVX512-BF16 alone
it varies by microarchitecture (on some cores bf16 beats fp32, on others it loses; figures in
scripts/benchmarks.md). So without AMX the choice is measured once per CPU, torch build and
thread count, and kept in Rill's cache folder, so that every later start on the machine agrees
without measuring again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import platform
import time
from pathlib import Path

import torch

from rill.kernels import native_build
from rill.services.worker.llama import TORCH_DTYPES
from rill.shared.model_files import cache_root

log = logging.getLogger("rill.worker")

# bf16 also halves KV-cache bytes and attention traffic, so it wins ties: fp32 is chosen only when
# its GEMMs are clearly faster.
BF16_MIN_SPEED = 0.9
# A decode-sized and a prefill-sized GEMM of a small Llama's shapes (M rows, K in, N out).
PROBE_SHAPES = ((32, 1024, 2048), (256, 1024, 2048))


def resolve_dtype(dtype: str, device: str) -> str:
    """"auto" is bfloat16 on CUDA and on CPUs where bf16 GEMMs are at least about as fast as
    fp32 (see the module docstring), float32 on the others; an explicit dtype is checked and
    kept. float32 stays available for exact comparisons."""
    if dtype == "auto":
        return "bfloat16" if device == "cuda" or cpu_prefers_bf16() else "float32"
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return dtype


def cpu_prefers_bf16(flags: str | None = None) -> bool:
    """Whether "auto" picks bfloat16 on this CPU. `flags`: /proc/cpuinfo's flags line (default:
    this machine's); only the measurement itself always runs on this machine."""
    if not _mkldnn_bf16():
        return False  # torch would only emulate bf16
    flags = native_build.cpu_flags() if flags is None else flags
    if "amx_bf16" in flags.split():
        return True
    return bf16_speed() >= BF16_MIN_SPEED


def bf16_speed() -> float:
    """fp32 GEMM time / bf16 GEMM time on this CPU (>1: bf16 is faster), measured on the first
    call and cached on disk."""
    key = hashlib.sha256("\0".join([native_build.cpu_flags(), platform.machine(), torch.__version__,
                                    str(torch.get_num_threads())]).encode()).hexdigest()[:16]
    path = cache_root() / "dtype-probe" / f"{key}.json"
    speed = _read(path)
    if speed is not None:
        return speed
    path.parent.mkdir(parents=True, exist_ok=True)
    # Workers starting together on a fresh machine: one measures (without the others' probes
    # competing for the cores), the rest wait for its answer, so they all pick the same dtype.
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        speed = _read(path)
        if speed is not None:
            return speed
        speed = measure_bf16_speed()
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"bf16_speed": speed, "shapes": PROBE_SHAPES,
                                   "threads": torch.get_num_threads(), "torch": torch.__version__}))
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    log.info("dtype auto: bf16 GEMMs run at %.2fx fp32 on this CPU -> %s", speed,
             "bfloat16" if speed >= BF16_MIN_SPEED else "float32")
    return speed


def _read(path: Path) -> float | None:
    try:
        return float(json.loads(path.read_text())["bf16_speed"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def measure_bf16_speed(repeats: int = 7) -> float:
    """The geometric mean over PROBE_SHAPES of fp32 time / bf16 time, each the best of `repeats`,
    through the same pre-packed linear layers the model uses (~0.1-0.3 s)."""
    from rill.kernels.torch_ops import Linear

    gen = torch.Generator().manual_seed(0)
    ratio = 1.0
    for m, k, n in PROBE_SHAPES:
        weight = torch.randn(n, k, generator=gen)
        x = torch.randn(m, k, generator=gen)
        runs = [(Linear(weight.to(dtype), None), x.to(dtype)) for dtype in (torch.float32, torch.bfloat16)]
        best = [math.inf, math.inf]
        for layer, xd in runs:
            layer(xd)  # first call: oneDNN builds its kernel
        # Interleaved, so that a load on the machine while it measures slows both sides alike.
        for _ in range(repeats):
            for i, (layer, xd) in enumerate(runs):
                t = time.perf_counter()
                layer(xd)
                best[i] = min(best[i], time.perf_counter() - t)
        ratio *= best[0] / best[1]
    return ratio ** (1 / len(PROBE_SHAPES))


def _mkldnn_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
