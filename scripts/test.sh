#!/usr/bin/env bash
# The project's test command: installs what it needs on first run, lints, then runs the suite.
# Uses the Redis at $REDIS_URL when set; otherwise the tests start an embedded valkey-server.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
# Keep the working directory off sys.path (here and in every service a test starts): the
# repository's kernels/ folder would shadow the `kernels` package transformers imports.
export PYTHONSAFEPATH=1
# The slowest tests close every run: what to look at when the suite grows past ~20 minutes.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
