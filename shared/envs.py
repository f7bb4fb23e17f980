"""Every environment variable Rill reads, with its meaning: the one place they are read and set.

As vLLM's envs.py: `envs.RILL_LOG_LEVEL` reads the variable when accessed, not at import, so a
launcher or test that sets one before use is heard. Flags (`RILL_*_KERNELS`, `RILL_AMX`,
`RILL_CUDA_GRAPHS`) are on unless set to 0, false, no or off.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    RILL_REDIS_URL: str | None
    RILL_API_KEY: str | None
    RILL_LOG_LEVEL: str
    RILL_CACHE_DIR: str
    RILL_WORKER_THREADS: int | None
    RILL_STEP_THREADS: bool
    RILL_CPU_STEP_TARGET_MS: float
    RILL_KERNELS: str
    RILL_NATIVE_KERNELS: bool
    RILL_NATIVE_MARCH: str
    RILL_AMX: bool
    RILL_DECODE_LAYERS: bool
    RILL_BATCH_INVARIANT: bool
    RILL_PREFILL_KERNEL: str
    RILL_GGUF_FLOAT_COPIES: str
    RILL_CUDA_GRAPHS: bool
    RILL_CUDA_GRAPH_MAX_BATCH: int
    RILL_SMOOTHQUANT_ALPHA: str | None
    RILL_KV_TRANSFER_TIMEOUT_S: float
    RILL_TEST_KV_IMPORT_DELAY_S: float
    RILL_TP_ADDRESS: str
    RILL_TP_JOIN_TIMEOUT: float | None
    RILL_URL: str | None
    RILL_RESPONSES_TTL_S: int
    TRITON_INTERPRET: bool
    CC: str | None
    NO_COLOR: bool


def _text(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


def _flag(name: str, default: bool = True) -> Callable[[], bool]:
    return lambda: (os.environ.get(name) or ("1" if default else "0")).strip().lower() not in ("0", "false", "no", "off")


def _choice(name: str, default: str) -> Callable[[], str]:
    return lambda: os.environ.get(name, "").strip().lower() or default


def _number(name: str, kind: type[int] | type[float], default: Any) -> Callable[[], Any]:
    return lambda: kind(os.environ[name]) if os.environ.get(name) else default


environment_variables: dict[str, Callable[[], Any]] = {
    # The broker: the default of --redis-url, and how `rill serve` hands it to its children.
    "RILL_REDIS_URL": lambda: _text("RILL_REDIS_URL"),
    # The gateway's API key when --api-key is not given (kept off command lines).
    "RILL_API_KEY": lambda: _text("RILL_API_KEY"),
    # Log level of every service: DEBUG, INFO (default), WARNING, ERROR.
    "RILL_LOG_LEVEL": lambda: (os.environ.get("RILL_LOG_LEVEL") or "INFO").upper(),
    # Converted checkpoints and compiled kernels (default $XDG_CACHE_HOME/rill, ~/.cache/rill).
    "RILL_CACHE_DIR": lambda: _text("RILL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rill"),
    # CPU threads of the worker (per tensor-parallel rank); default: the usable cores.
    "RILL_WORKER_THREADS": _number("RILL_WORKER_THREADS", int, None),
    # A CPU decode step of a batch size may run on one of those threads fewer where steps of that
    # size measured faster so while serving (services/worker/step_threads.py); 0: always all of them.
    "RILL_STEP_THREADS": _flag("RILL_STEP_THREADS"),
    # The longest a CPU step carrying a prompt chunk should take, when the worker measures the
    # step budget that --max-num-batched-tokens leaves open and the scheduler cuts chunks deep in
    # a long prompt to it (services/worker/step_budget.py).
    "RILL_CPU_STEP_TARGET_MS": _number("RILL_CPU_STEP_TARGET_MS", float, 300.0),
    # Kernel backend: auto (Triton on CUDA, torch + native on CPU), torch, triton.
    "RILL_KERNELS": _choice("RILL_KERNELS", "auto"),
    # The native C CPU kernels (compiled at first use); 0 leaves plain torch.
    "RILL_NATIVE_KERNELS": _flag("RILL_NATIVE_KERNELS"),
    # The -march they are built for: native (this CPU), or an older level to run that level's code
    # on this CPU (haswell: the AVX2 paths; tests and comparisons). Each level builds apart.
    "RILL_NATIVE_MARCH": _choice("RILL_NATIVE_MARCH", "native"),
    # AMX tiles where the CPU has them; 0 keeps the AVX-512 kernels.
    "RILL_AMX": _flag("RILL_AMX"),
    # 0: steps of few rows run op by op from Python, not in the native layer driver (A/B, debugging).
    "RILL_DECODE_LAYERS": _flag("RILL_DECODE_LAYERS"),
    # 1: a request's output does not depend on what shares its steps (GGUF weights always multiply
    # on their blocks, whose kernel rounds each row alone), at the cost of the float routes' speed.
    "RILL_BATCH_INVARIANT": _flag("RILL_BATCH_INVARIANT", default=False),
    # Force one CPU prefill attention kernel (auto: chosen by measurement; sdpa, native, dot, amx).
    "RILL_PREFILL_KERNEL": _choice("RILL_PREFILL_KERNEL", "auto"),
    # Bytes the float copies of GGUF weights may take where they measured faster than the blocks
    # (auto: half the memory available at start, less the blocks; 0: none; e.g. 2GiB).
    "RILL_GGUF_FLOAT_COPIES": _choice("RILL_GGUF_FLOAT_COPIES", "auto"),
    # CUDA graphs for decode steps, and the largest batch captured.
    "RILL_CUDA_GRAPHS": _flag("RILL_CUDA_GRAPHS"),
    "RILL_CUDA_GRAPH_MAX_BATCH": _number("RILL_CUDA_GRAPH_MAX_BATCH", int, 256),
    # SmoothQuant migration strength for --quantization int8: one alpha, or kind=alpha,... .
    "RILL_SMOOTHQUANT_ALPHA": lambda: _text("RILL_SMOOTHQUANT_ALPHA"),
    # Disaggregation: seconds a KV hand-off may take before the request is recomputed.
    "RILL_KV_TRANSFER_TIMEOUT_S": _number("RILL_KV_TRANSFER_TIMEOUT_S", float, 60.0),
    # Tests only: seconds each KV import sleeps, to hold a transfer open.
    "RILL_TEST_KV_IMPORT_DELAY_S": _number("RILL_TEST_KV_IMPORT_DELAY_S", float, 0.0),
    # Tensor parallel: the rendezvous host:port of rank 0, and seconds the ranks wait to join.
    "RILL_TP_ADDRESS": lambda: os.environ.get("RILL_TP_ADDRESS", ""),
    "RILL_TP_JOIN_TIMEOUT": _number("RILL_TP_JOIN_TIMEOUT", float, None),
    # `rill chat`: the server's URL.
    "RILL_URL": lambda: _text("RILL_URL"),
    # Seconds a stored /v1/responses response is kept in the broker (0: none is stored).
    "RILL_RESPONSES_TTL_S": _number("RILL_RESPONSES_TTL_S", int, 3600),
    # Triton's interpreter (CPU tensors through the Triton kernels, for tests).
    "TRITON_INTERPRET": lambda: os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    # The C compiler for the native kernels (else cc, then gcc).
    "CC": lambda: _text("CC"),
    # No colours in `rill chat` (no-color.org).
    "NO_COLOR": lambda: bool(os.environ.get("NO_COLOR")),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)


def export(name: str, value: str, overwrite: bool = True) -> None:
    """Set a variable for this process and the processes it starts (the launcher's hand-off)."""
    if overwrite or name not in os.environ:
        os.environ[name] = value
