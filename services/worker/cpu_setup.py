"""Setting a worker up for the machine it runs on: the device, CPU threads, the GEMM kernels
measured on this CPU, and how the allocator keeps memory."""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from rill.kernels import chooser, float_copies, native_build
from rill.kernels.cpu_tuning import ModelShapes, tune_gguf, tune_model
from rill.services.worker.gguf_weights import GGUFSource
from rill.shared import envs
from rill.shared.config import ModelConfig

log = logging.getLogger("rill.worker")


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    return device


def cpu_has_int8_dot(flags: str | None = None) -> bool:
    """Whether the CPU has int8 dot-product units (AVX512-VNNI, AVX-VNNI or AMX-INT8), which
    oneDNN's int8 GEMM needs to beat float (without them it is far slower than fp32).
    `flags`: /proc/cpuinfo's flags line (default: this machine's)."""
    flags = native_build.cpu_flags() if flags is None else flags
    if not flags.startswith("flags"):  # not x86, or unreadable: no warning on a guess
        return True
    return bool(set(flags.split()) & {"avx512_vnni", "avx_vnni", "amx_int8"})


def configure_cpu_threads(ranks: int = 1) -> int:
    """Intra-op threads for the CPU forward: RILL_WORKER_THREADS, else every core we may run on
    (shared among the `ranks` tensor-parallel processes of one machine)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    n = envs.RILL_WORKER_THREADS or (usable or 1) // ranks or 1
    torch.set_num_threads(max(1, n))
    return torch.get_num_threads()


def choose_cpu_kernels(cfg: ModelConfig, dtype: torch.dtype, quantization: str,
                       model_dir: str | None = None, remeasure: bool = False) -> tuple[chooser.KernelTable, list[str]]:
    """Install the kernel choices measured on this machine for this model's shapes (measuring
    what Rill's cache lacks: a second or two on a machine's first start); with quantization
    "gguf", also the routes of the GGUF block layers (`model_dir`: the converted checkpoint)."""
    shapes = ModelShapes.of(cfg)
    table, keys = tune_model(shapes, dtype, quantization, remeasure=remeasure)
    if quantization == "gguf" and model_dir is not None:
        parts, head = GGUFSource.of(Path(model_dir), cfg).part_shapes(cfg.tie_word_embeddings)
        table, gguf_keys = tune_gguf(parts, dtype, head, remeasure=remeasure)
        keys = keys + gguf_keys
        fitted = float_copies.fit(table, parts, head, dtype, float_copies.budget(parts, head))
        if fitted.dropped:
            table = fitted.table
            chooser.install(table)
            log.info("gguf float copies: %d of the %d MiB measured faster kept, within %d MiB "
                     "(RILL_GGUF_FLOAT_COPIES); %d weight shapes serve from their blocks instead",
                     fitted.kept >> 20, fitted.wanted >> 20, fitted.budget >> 20, fitted.dropped)
    log.info("kernels (%s, %d threads): %s", chooser.cpu_model(), torch.get_num_threads(),
             chooser.summary(table, keys))
    return table, keys


def keep_freed_memory() -> None:
    """Ask glibc to keep freed large buffers instead of unmapping them. The CPU forward frees
    and re-allocates the same multi-MB activations and KV gathers every layer; returning them
    to the OS makes each reuse page-fault again, which measured ~2x slower gathers."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: keep the defaults


def release_freed_memory() -> None:
    """Return the heap's free pages to the OS. With keep_freed_memory's thresholds nothing freed is
    ever returned, so the load's transients (checkpoint tensors read in fp32, dequantized blocks,
    kernel-choice probes) would stay resident for the worker's life: call this after loading."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc
