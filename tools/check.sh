#!/usr/bin/env bash
# The fast lane: lint, types, the layer order and the tests that start no
# process world and need no guest (make test runs everything).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PYTHON="$PY" tools/lint.sh
"$PY" -m pytest -q -rs --durations=10 -m "not multiproc and not numa and not slow" "$@"
