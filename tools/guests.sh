#!/usr/bin/env bash
# The NUMA placement tests in QEMU guests (tools/numa-vm), one after the
# other: a 2-node guest runs every one; a 4-node guest those that need no
# torch (its import alone is ~20 s under emulation), NUMA_ENGRAM_TEST_NO_TORCH=1
# failing the run if one imports it.  The process worlds of both meet
# through SocketGroup: no torch, no forkserver.  Only the NUMA test files
# are collected (collecting the others under emulation costs minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
numa_tests=(tests/test_numa_*.py)
echo "== NUMA tests in a 2-node guest =="
tools/numa-vm -n 2 -m 2048 -t 1500 -- "$PY" -m pytest -q -rs -m numa -p no:cacheprovider \
  -o timeout=1200 "${numa_tests[@]}"
echo "== NUMA tests in a 4-node guest =="
NUMA_ENGRAM_TEST_NO_TORCH=1 tools/numa-vm -n 4 -m 768 -t 900 -- "$PY" -m pytest -q -rs \
  -m "numa and not torch" -p no:cacheprovider -o timeout=600 "${numa_tests[@]}"
