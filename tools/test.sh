#!/usr/bin/env bash
# Run every test: the host suite, then the NUMA placement tests in a
# 2-node and a 4-node guest (tools/numa-vm) unless this host already has
# >= 2 NUMA nodes, in which case they ran directly in the host suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m ruff check numa_engram tests tools cffi_build
"$PY" -m pytest -q -rs "$@"
nodes=$(ls -d /sys/devices/system/node/node[0-9]* 2>/dev/null | wc -l)
if [ "${NUMA_ENGRAM_SKIP_VM:-0}" = 1 ]; then
  echo "test.sh: NUMA_ENGRAM_SKIP_VM=1: placement tests in the VM skipped" >&2
elif [ "$nodes" -lt 2 ]; then
  for n in 2 4; do
    echo "== NUMA tests in a ${n}-node guest =="
    tools/numa-vm -n "$n" -t 1500 -- "$PY" -m pytest -q -m numa -p no:cacheprovider \
      -o timeout=1200 tests
  done
fi
