#!/usr/bin/env bash
# The NUMA placement tests in QEMU guests (tools/numa-vm), both at once: a
# 2-node guest runs every one; a 4-node guest those that need no torch (its
# import alone is ~20 s under emulation), NUMA_ENGRAM_TEST_NO_TORCH=1
# failing the run if one imports it.  The process worlds of both meet
# through SocketGroup: no torch, no forkserver.  Only the NUMA test files
# are collected (collecting the others under emulation costs minutes).
# Each guest's output is printed after both ended, the first failure's
# status is the script's.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
numa_tests=(tests/test_numa_*.py)
tools/numa-vm --setup  # the kernel and initramfs, once, before both guests want them
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
tools/numa-vm -n 2 -m 2048 -t 1500 -- "$PY" -m pytest -q -rs -m numa -p no:cacheprovider \
  -o timeout=1200 "${numa_tests[@]}" > "$out/2" 2>&1 &
two=$!
NUMA_ENGRAM_TEST_NO_TORCH=1 tools/numa-vm -n 4 -m 768 -t 1500 -- "$PY" -m pytest -q -rs \
  -m "numa and not torch" -p no:cacheprovider -o timeout=600 "${numa_tests[@]}" > "$out/4" 2>&1 &
four=$!
status=0
wait "$two" || status=$?
rc=0; wait "$four" || rc=$?
[ "$status" != 0 ] || status=$rc
echo "== NUMA tests in a 2-node guest =="
cat "$out/2"
echo "== NUMA tests in a 4-node guest =="
cat "$out/4"
exit "$status"
