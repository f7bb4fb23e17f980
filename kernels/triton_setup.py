"""Triton under TRITON_INTERPRET=1 (the CPU tests): the flag, and a fresh import of triton when
it was imported before the flag was set. Every Triton kernel module calls `prepare_interpreter()`
before its own `import triton`.
"""

from __future__ import annotations

import sys

from rill.shared import envs

INTERPRET = envs.TRITON_INTERPRET


def prepare_interpreter() -> None:
    """Make TRITON_INTERPRET=1 work even when triton was imported before it was set.

    The flag is read when a function is decorated, and Triton's own library functions (tl.sum,
    tl.max, tl.cdiv, ...) are decorated when triton is first imported, which torch._dynamo does
    early (transformers pulls it in). Compiled library functions cannot be called from an
    interpreted kernel, so drop triton's Python modules (not its C extension) and import afresh."""
    if not envs.TRITON_INTERPRET:
        return
    standard = sys.modules.get("triton.language.standard")
    if standard is None:
        return
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(getattr(standard, "sum", None), InterpretedFunction):
        return
    for name in [m for m in sys.modules if (m == "triton" or m.startswith("triton.")) and not m.startswith("triton._C")]:
        del sys.modules[name]
