"""Environment knobs have one home: shared/envs.py reads and sets them, and lists each one."""

from __future__ import annotations

import re
from pathlib import Path

from rill.shared import envs

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("services", "shared", "kernels") for p in (ROOT / d).rglob("*.py")]


def test_only_envs_touches_the_environment() -> None:
    touching = sorted(str(p.relative_to(ROOT)) for p in SOURCES if re.search(r"os\.(environ|getenv|putenv)", p.read_text()))
    assert touching == ["shared/envs.py"]


def test_every_rill_variable_named_in_the_code_is_listed(monkeypatch) -> None:
    named = {m for p in SOURCES for m in re.findall(r"\bRILL_[A-Z0-9_]+\b", p.read_text())}
    assert named <= envs.environment_variables.keys(), named - envs.environment_variables.keys()
    monkeypatch.setenv("RILL_WORKER_THREADS", "3")  # read when accessed, not at import
    assert envs.RILL_WORKER_THREADS == 3
    monkeypatch.setenv("RILL_NATIVE_KERNELS", "off")
    assert envs.RILL_NATIVE_KERNELS is False
