#!/usr/bin/env bash
# The fast lane: lint, types, the layer order and the tests that start no
# process world and need no guest (make test runs everything).  The static
# checks run beside the tests (each mostly one CPU); their output comes after.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
lint_log=$(mktemp)
PYTHON="$PY" setsid tools/lint.sh > "$lint_log" 2>&1 &
lint=$!
trap 'kill -- "-$lint" 2>/dev/null || true; rm -f "$lint_log"' EXIT
status=0
"$PY" -m pytest -q -rs --durations=10 -m "not multiproc and not numa and not slow" "$@" \
  || status=$?
lint_status=0
wait "$lint" || lint_status=$?
echo "== lint (run beside the tests) =="
cat "$lint_log"
[ "$lint_status" = 0 ] || { echo "check.sh: lint failed (status $lint_status)" >&2; exit "$lint_status"; }
exit "$status"
