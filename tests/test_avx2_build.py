"""The AVX2 code of the native kernels, run on this CPU. Most machines the suite runs on have
AVX-512, where the AVX2 paths (what a CPU with neither AVX-512 nor AMX serves on) would only be
compiled (test_cpu_native's syntax check), never run. Here the kernel tests that hold native
against torch run again in a child pytest, with the kernels built for -march=haswell
(RILL_NATIVE_MARCH) and torch held to its AVX2 kernels, whose GELU takes the 8-lane tanh the
AVX2 layer driver takes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rill.kernels import native_build

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = ["tests/test_decode_layers.py", "tests/test_gguf_kernels.py", "tests/test_cpu_native.py"]
pytestmark = pytest.mark.skipif("avx512f" not in native_build.cpu_flags().split(),
                                reason="no AVX-512 here: the whole suite runs on the AVX2 (or plain C) build, "
                                       "with torch on its AVX2 kernels")


def test_the_avx2_build_passes_the_kernel_tests() -> None:
    env = {**os.environ, "RILL_NATIVE_MARCH": "haswell", "ATEN_CPU_CAPABILITY": "avx2", "PYTHONSAFEPATH": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-rs", "-p", "no:cacheprovider", *KERNEL_TESTS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = proc.stdout[-4000:] + proc.stderr[-1000:]
    assert proc.returncode == 0, tail
    # It was the AVX2 build that ran: the AVX512-BF16 kernels' tests skipped, the driver's did not.
    assert "no AVX512-BF16" in proc.stdout, tail
    assert "test_decode_layers.py" not in "".join(line for line in proc.stdout.splitlines() if "SKIPPED" in line), tail


def test_the_driver_takes_no_geglu_when_torch_runs_other_lanes() -> None:
    """The AVX2 build's GELU is torch's only while torch's own kernels are AVX2 too: with torch on
    its AVX-512 kernels (16-lane tanh) the driver declines GeGLU models, rather than differ from
    the per-op path in the last bits."""
    code = ("import torch; from rill.kernels import cpu_native; "
            "print(torch.backends.cpu.get_cpu_capability(), cpu_native.geglu_exact())")

    def probe(**extra: str) -> str:
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        proc = subprocess.run([sys.executable, "-c", code], env={**env, "RILL_NATIVE_MARCH": "haswell", **extra},
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-1000:]
        return proc.stdout.strip()

    assert probe() == "AVX512 False"
    assert probe(ATEN_CPU_CAPABILITY="avx2") == "AVX2 True"
