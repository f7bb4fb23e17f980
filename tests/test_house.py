"""The house rules a newcomer relies on (issue 32): files small enough to read in one sitting,
functions short enough to follow, and the environment read in one place.

Each test names every offender when it fails, so a fix needs no second run to find them.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("services", "shared", "kernels")
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 60  # from `def` to the end of the body, inclusive
# Kernels are exempt: a Triton kernel or a C binding reads best as one piece.
FUNCTION_PACKAGES = ("services", "shared")
# The one module that reads and sets the environment (every RILL_* knob is declared there; the
# launcher hands its children their environment through envs.export).
ENVIRON_HOMES = {"shared/envs.py"}


def _sources(packages: tuple[str, ...]) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_no_file_over_the_line_limit() -> None:
    long = [f"{_rel(p)}: {n} lines" for p in _sources(PACKAGES)
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, f"files over {MAX_FILE_LINES} lines (split them by job):\n" + "\n".join(long)


def _long_functions() -> dict[str, int]:
    out: dict[str, int] = {}
    for path in _sources(FUNCTION_PACKAGES):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    out[f"{_rel(path)}::{node.name}"] = lines
    return out


def test_no_function_over_the_line_limit() -> None:
    long = [f"{name}: {n} lines" for name, n in sorted(_long_functions().items())]
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines (break them into named helpers):\n"
                      + "\n".join(long))


def _code_mentions(source: str, needle: str) -> list[int]:
    """Lines where `needle` appears in code (not in comments or strings)."""
    lines: list[int] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.string == needle:
            lines.append(tok.start[0])
    return lines


def test_environment_read_in_one_module() -> None:
    offenders: list[str] = []
    for path in _sources(PACKAGES):
        rel = _rel(path)
        if rel in ENVIRON_HOMES:
            continue
        source = path.read_text()
        # os.environ, os.getenv, os.putenv, or `environ` imported from os under any name.
        lines = [n for name in ("environ", "getenv", "putenv", "unsetenv") for n in _code_mentions(source, name)]
        offenders += [f"{rel}:{n}: {source.splitlines()[n - 1].strip()}" for n in sorted(set(lines))]
    assert not offenders, ("the environment is read outside shared/envs.py (declare the knob there and "
                           "read it through rill.shared.envs):\n" + "\n".join(offenders))
