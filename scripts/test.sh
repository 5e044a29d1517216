#!/usr/bin/env bash
# The test command from the README: sets itself up, then runs the whole suite
# (tiny-model tests and the real-model SmolLM2 tests). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
set +e
.venv/bin/python -m pytest -q -rs --durations=15 "$@"
rc=$?
set -e
# pytest exits 5 when nothing was collected (e.g. a -k filter that matches nothing).
if [ "$rc" -eq 5 ]; then echo "no tests collected"; exit 0; fi
exit "$rc"
