#!/usr/bin/env bash
# The fast lane: lint, types, the layer order and the tests that start no
# process world and need no guest (make test runs everything).  The static
# checks run beside the tests (each mostly one CPU); their output comes after.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
source tools/bytecode.sh
source tools/beside.sh
source tools/suite.sh
beside lint tools/lint.sh
status=0
suite -q -rs --durations=10 -m "not multiproc and not numa and not slow" "$@" || status=$?
report lint
exit "$status"
