#!/usr/bin/env bash
# Starts the whole stack on the default model (installs what it needs on first run).
# Extra arguments go to `rill serve`, e.g. scripts/serve.sh --port 8080 --tokenizer-replicas 2
set -euo pipefail
cd "$(dirname "$0")/.."
RILL_SETUP_BROWSER=0 scripts/setup.sh  # the test browser is not needed to serve
exec .venv/bin/rill serve "$@"
