"""Building the native CPU kernels: the machine's C compiler (`$CC`, else cc/gcc), for this exact
CPU (-march=native; RILL_NATIVE_MARCH names another level), into a cache folder keyed by a hash
of the sources, the flags, the compiler and the CPU's feature flags, so a changed source or another
CPU builds anew. Several services starting at once build once (a file lock). The bindings are in
cpu_native.py."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from rill.shared import envs

log = logging.getLogger("rill.kernels")

SOURCES = [Path(__file__).with_name(n) for n in ("cpu_paged_attention.c", "cpu_prefill_attention.c",
                                                 "cpu_prefill_amx.c", "cpu_prefill_bf16dot.c", "cpu_quant.c", "cpu_elementwise.c",
                                                 "cpu_small_gemm.c", "cpu_sampling.c", "cpu_gguf.c",
                                                 "cpu_gguf_dequant.c", "cpu_gguf_x16.c", "cpu_decode_layers.c")]
HEADERS = [Path(__file__).with_name(n) for n in ("cpu_bf16.h", "cpu_vec_math.h", "cpu_gguf_formats.h", "cpu_gguf_simd.h",
                                                 "cpu_gguf_kquants.h")]
FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]


def _compiler() -> str:
    for name in (envs.CC, "cc", "gcc"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C compiler (set CC, or install gcc)")


def cpu_flags() -> str:
    """The "flags" line of /proc/cpuinfo (x86 Linux), else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def isa_macros(cc: str, march: str) -> set[str]:
    """The instruction-set macros (__AVX2__, __AVX512F__, __AMX_TILE__, ...) `cc` defines for -march."""
    proc = subprocess.run([cc, f"-march={march}", "-dM", "-E", "-x", "c", os.devnull], capture_output=True,
                          text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"{cc} does not take -march={march}: {proc.stderr.strip()[-200:]}")
    return set(re.findall(r"#define (__(?:AVX|AMX|FMA|F16C|BMI)\w*__) ", proc.stdout))


def build(folder: Path) -> tuple[Path, str]:
    """The library for this machine in `folder` (built unless there), and its key."""
    cc = _compiler()
    march = envs.RILL_NATIVE_MARCH
    if march != "native" and (beyond := isa_macros(cc, march) - isa_macros(cc, "native")):
        # Code for instructions this CPU lacks dies on its first one (SIGILL): refuse it here.
        raise RuntimeError(f"RILL_NATIVE_MARCH={march} needs instructions this CPU lacks "
                           f"({', '.join(sorted(m.strip('_') for m in beyond))})")
    flags = [*FLAGS, f"-march={march}"]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([*(src.read_text() for src in SOURCES + HEADERS), " ".join(flags), version,
                                    cpu_flags(), platform.machine()]).encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"rill_cpu_kernels-{key}.so"
    if target.exists():
        return target, key
    # Several services may start at once: one builds, the others wait for it.
    with open(folder / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target, key
        log.info("building native CPU kernels for this machine (once: later starts reuse them) ...")
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            built = Path(tmp) / target.name
            cmd = [cc, *flags, "-I", str(HEADERS[0].parent), "-o", str(built), *map(str, SOURCES)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
            os.replace(built, target)
        log.info("built native CPU kernels in %.1f s: %s", time.perf_counter() - start, target)
    return target, key
