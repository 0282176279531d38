#!/usr/bin/env bash
# The static checks make test and make check both run first (make lint runs
# them alone); with --fix, what make fmt does: imports sorted, C formatted.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
c_files=(cffi_build/*.[ch] cffi_build/src/*.[ch])
if ! command -v clang-format >/dev/null; then
  echo "lint.sh: clang-format not found (apt-get install clang-format; tools/setup.sh does)" >&2
  exit 1
fi
if [ "${1:-}" = --fix ]; then
  "$PY" -m ruff check -q --fix --select I numa_engram tests tools cffi_build
  clang-format -i "${c_files[@]}"
  exit 0
fi
"$PY" -m ruff check numa_engram tests tools cffi_build
# the C core's format (.clang-format; Debian 12's clang-format 14 wrote it)
clang-format --dry-run --Werror "${c_files[@]}"
"$PY" tools/check_c.py  # the C core compiled with the build's flags and -Werror
"$PY" -m mypy  # the package and tests/support/typing_checks.py ([tool.mypy] in pyproject.toml)
"$(dirname "$PY")/lint-imports"  # the layer order ([tool.importlinter] in pyproject.toml)
