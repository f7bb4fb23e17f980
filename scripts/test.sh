#!/usr/bin/env bash
# The project's test command: installs what it needs on first run, lints, then runs the suite.
# Uses the Redis at $REDIS_URL when set; otherwise the tests start an embedded valkey-server.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
