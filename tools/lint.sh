#!/usr/bin/env bash
# The static checks make test and make check both run first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m ruff check numa_engram tests tools cffi_build
"$PY" -m mypy  # the package and tests/typing_checks.py ([tool.mypy] in pyproject.toml)
"$(dirname "$PY")/lint-imports"  # the layer order ([tool.importlinter] in pyproject.toml)
